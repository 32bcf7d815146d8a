"""The code the fused W4A16 kernel makes for sm_90 (Hopper), compiled on the CPU: a look at each
launch of `TUNED_CONFIGS` before any GPU time is spent.

    python -m benchmarks.quant_sass [--dtype bf16] [--group-size 128]
        [--candidates 1,128]

Each distinct launch (of `TUNED_CONFIGS`, or with --candidates of the sweep's candidates at those
token counts) is compiled by Triton for an H100/H200 target with the specialization a real
launch gets (pointers, N, K and strides divisible by 16, 4-bit) and disassembled with the
cuobjdump that ships with Triton. Printed per launch: registers, spilled-register operations,
shared memory, the main loop's instructions per weight (the loop is the largest backward branch
of the SASS; per weight = its instructions / the weights one thread covers per tile) and its most
frequent opcodes, and the kernel's global / shared memory instructions by width (LDGSTS.128:
16-byte asynchronous copies). Needs no GPU; the figures are a model of the issue cost, not a
timing.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace

from loraplex.kernels.w4a16.types import FRAGMENT_LANES, TILE_K, W4A16Config

_INTS = ("M", "N", "K", "tiles_per_split", "stride_xm", "stride_qn", "stride_sg", "stride_om",
         "SPLIT_K")  # fmt: skip
_DIVISIBLE = ("N", "K", "stride_xm", "stride_qn", "stride_sg", "stride_om")
_LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_MAGIC = {"bf16": (0x4300, 128.0), "fp16": (0x6400, 1024.0)}


@dataclass(frozen=True)
class KernelFigures:
    config: W4A16Config
    registers: int
    spills: int
    shared_bytes: int
    loop_instructions: int
    per_weight: float
    top: tuple[tuple[str, int], ...]
    memory_ops: tuple[tuple[str, int], ...]


def compile_sm90(config: W4A16Config, dtype: str, group_size: int):
    """The fused kernel of `config` compiled for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loraplex.kernels.w4a16.triton_mma import w4a16_mma_kernel as fn
    from loraplex.kernels.w4a16.types import scale_dots

    magic, offset = _MAGIC[dtype]
    constants = dict(
        GROUP_SIZE=group_size, SCALE_DOTS=scale_dots(group_size, 4096, 4), BITS=4, MAGIC=magic,
        OFFSET=offset, HAS_BIAS=False, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, DOT_PRECISION="tf32",
        USE_ASM=True, SCALE_WEIGHTS=config.kind == "mma_wscale", PREFETCH=config.prefetch,
        TILE_K=TILE_K,
        LANES=FRAGMENT_LANES,
    )  # fmt: skip
    types = dict(x_ptr=f"*{dtype}", qw_ptr="*i16", scales_ptr=f"*{dtype}", zeros_ptr=f"*{dtype}",
                 bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}", ws_ptr="*fp32",
                 lock_ptr="*i32", **dict.fromkeys(_INTS, "i32"))  # fmt: skip
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    divisible = [n for n in fn.arg_names if n not in constants
                 and (n.endswith("_ptr") or n in _DIVISIBLE)]  # fmt: skip
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


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
    return [opcode.split(".")[0] for address, opcode, _ in lines if start <= address <= end]


def figures(config: W4A16Config, dtype: str, group_size: int) -> KernelFigures:
    kernel = compile_sm90(config, dtype, group_size)
    text = _cuobjdump(kernel.asm["cubin"], "-sass")
    registers = re.search(r"REG:(\d+)", _cuobjdump(kernel.asm["cubin"], "-res-usage"))
    opcodes = loop_opcodes(text)
    every = [m.group(2) for line in text.splitlines() if (m := _LINE.match(line))]
    memory = collections.Counter(o for o in every if o.startswith(("LDG", "LDS", "STS", "STG")))
    weights_per_thread = config.block_n * TILE_K / (32 * config.num_warps)
    return KernelFigures(
        config=config,
        registers=int(registers.group(1)) if registers else -1,
        spills=len(re.findall(r"\b(?:STL|LDL)\b", text)),
        shared_bytes=kernel.metadata.shared,
        loop_instructions=len(opcodes),
        per_weight=len(opcodes) / weights_per_thread,
        top=tuple(collections.Counter(opcodes).most_common(8)),
        memory_ops=tuple(sorted(memory.items())),
    )


def main() -> int:
    from benchmarks.common.quant_gemm_candidates import w4a16_candidates
    from loraplex.kernels.w4a16.dispatch import TUNED_CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(_MAGIC), default="bf16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--candidates", default="", help="token counts: the sweep's candidates")
    args = parser.parse_args()
    launches = list(TUNED_CONFIGS.values())
    if args.candidates:
        tokens = [int(m) for m in args.candidates.split(",")]
        launches = [c for m in tokens for c in w4a16_candidates(m, 4096, 4096, 132)]
    configs = dict.fromkeys(replace(c, split_k=1) for c in launches if c.kind != "dequant")
    for config in configs:
        f = figures(config, args.dtype, args.group_size)
        c = config
        ahead = " prefetch" if c.prefetch else ""
        print(f"{c.kind:10s} {c.block_m:3d}x{c.block_n:<3d} w{c.num_warps} s{c.num_stages}{ahead}: "
              f"{f.registers} regs, {f.spills} spill ops, {f.shared_bytes // 1024} KB shared | "
              f"loop {f.loop_instructions} instr, {f.per_weight:.2f} per weight | "
              + " ".join(f"{op}:{n}" for op, n in f.top), flush=True)  # fmt: skip
        print("    " + " ".join(f"{op}:{n}" for op, n in f.memory_ops), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
