"""Instructions per weight in the main loop of the W4A16 decode kernels, compiled for sm_90
(Hopper) on the CPU: a look at the code a kernel variant makes before any GPU time is spent.

    python -m benchmarks.quant_sass [--kinds stream_pair,stream,sliced_t,fma]

Each kernel is compiled by Triton for an H100/H200 target with the specialization a real launch
gets (pointers, N, K and strides divisible by 16, bf16 activations, 4-bit g128) and disassembled
with the cuobjdump that ships with Triton. The loop is the largest backward branch of the SASS;
per weight = its instructions / the weights one thread covers per K tile. Spilled registers
(local loads and stores) are counted too. Needs no GPU; the figures are a model of the issue
cost, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

#: kind -> ((block_n, block_k, num_warps, num_stages), ...), decode configs of the sweep.
CONFIGS = {
    "stream_pair": ((128, 128, 4, 3), (256, 128, 8, 1), (128, 128, 2, 1)),
    "stream": ((128, 128, 4, 3),),
    "sliced_t": ((128, 128, 4, 3),),
    "fma": ((256, 64, 4, 3), (64, 128, 2, 3)),
}
_ROW_INTS = ("M", "N", "group_size", "k_per_split", "stride_xm", "stride_qk", "stride_sg",
             "stride_om")  # fmt: skip
_DIVISIBLE = ("N", "group_size", "k_per_split", "stride_xm", "stride_qk", "stride_sg", "stride_om")
_LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


@dataclass(frozen=True)
class LoopFigures:
    kind: str
    config: tuple[int, int, int, int]
    loop_instructions: int
    per_weight: float
    spills: int
    top: tuple[tuple[str, int], ...]


def _kernel_and_constants(kind: str, block_n: int, block_k: int, stages: int):
    from loraplex.kernels.triton_quant_gemm_sliced import _wna16_sliced_kernel
    from loraplex.kernels.triton_quant_gemm_small_m import _wna16_fma_kernel
    from loraplex.kernels.triton_quant_gemm_stream import _wna16_stream_kernel

    common = dict(BITS=4, HAS_PERM=False, HAS_BIAS=False, SPLIT_K=4, BLOCK_N=block_n,
                  BLOCK_K=block_k, NUM_STAGES=stages)  # fmt: skip
    if kind == "fma":
        return _wna16_fma_kernel, common
    mma = dict(MAGIC=0x4300, OFFSET=128.0, BLOCK_M=16, DOT_PRECISION="tf32", **common)
    if kind == "sliced_t":
        return _wna16_sliced_kernel, dict(SWAP=True, **mma)
    return _wna16_stream_kernel, dict(JOIN_PAIRS=kind == "stream_pair", group_size=128, **mma)


def compile_sm90(kind: str, block_n: int, block_k: int, warps: int, stages: int):
    """The Triton kernel of `kind` compiled for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, constants = _kernel_and_constants(kind, block_n, block_k, stages)
    types = dict(x_ptr="*bf16", qw_ptr="*i32", scales_ptr="*bf16", zeros_ptr="*bf16",
                 perm_ptr="*i32", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32",
                 lock_ptr="*i32", **dict.fromkeys(_ROW_INTS, "i32"))  # fmt: skip
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    divisible = [n for n in fn.arg_names if n not in constants
                 and (n.endswith("_ptr") or n in _DIVISIBLE)]  # fmt: skip
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=warps, num_stages=stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin, with the cuobjdump Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def loop_opcodes(text: str) -> list[str]:
    """Opcodes of the largest loop: from a backward branch's target to the branch."""
    lines = [(int(m.group(1), 16), m.group(2), line)
             for line in text.splitlines() if (m := _LINE.match(line))]  # fmt: skip
    spans = []
    for address, opcode, line in lines:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    if not spans:
        return []
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return [opcode for address, opcode, _ in lines if start <= address <= end]


def figures(kind: str, config: tuple[int, int, int, int]) -> LoopFigures:
    block_n, block_k, warps, stages = config
    text = sass(compile_sm90(kind, *config).asm["cubin"])
    opcodes = loop_opcodes(text)
    weights_per_thread = block_n * block_k / (32 * warps)
    return LoopFigures(
        kind=kind,
        config=config,
        loop_instructions=len(opcodes),
        per_weight=len(opcodes) / weights_per_thread,
        spills=len(re.findall(r"\b(?:STL|LDL)\b", text)),
        top=tuple(collections.Counter(opcodes).most_common(8)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(CONFIGS), help="comma-separated kinds")
    args = parser.parse_args()
    for kind in args.kinds.split(","):
        if kind not in CONFIGS:
            parser.error(f"unknown kind {kind!r}; choose from {list(CONFIGS)}")
        for config in CONFIGS[kind]:
            f = figures(kind, config)
            top = " ".join(f"{op}:{n}" for op, n in f.top)
            print(f"{kind:12s} bn/bk/warps/stages {config}: {f.loop_instructions:5d} instr in the "
                  f"loop, {f.per_weight:4.2f} per weight, {f.spills} spill ops | {top}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
