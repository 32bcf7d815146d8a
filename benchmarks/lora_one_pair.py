"""One projection's LoRA on the GPU, three times, for a profiler to look at (Nsight Compute).

The gate_up projection of the 8B shape (4,096 in, 2 x 14,336 out, rank 16, 64 slots of random
adapters), `TOKENS` tokens spread over `ADAPTERS` adapters in turn, through `add_lora` with the
default kernel configuration (at 256 tokens: the grouped shrink and expand):

    ncu -k regex:group_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python -m benchmarks.lora_one_pair 256 64
"""

from __future__ import annotations

import sys

import torch

from benchmarks.lora_kernels import _Batch, _stack
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG, add_lora


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        print("usage: python -m benchmarks.lora_one_pair TOKENS ADAPTERS", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("lora_one_pair: no CUDA device; nothing to profile", file=sys.stderr)
        return 0
    tokens, adapters = int(argv[0]), int(argv[1])
    torch.manual_seed(0)
    dev = torch.device("cuda")
    stack = _stack(4096, [14336, 14336], 64, dev, torch.bfloat16)
    meta = _Batch(64, tokens, 48, dev)
    meta.set((torch.arange(tokens) % adapters).to(torch.int32).to(dev))
    x = torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(tokens, 28672, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        add_lora(x, out, stack, meta.kernel_meta, meta.workspace, DEFAULT_KERNEL_CONFIG,
                 meta.counters)  # fmt: skip
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
