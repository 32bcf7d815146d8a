"""One launch of each W4A16 sweep winner, for `ncu` (`benchmarks/h200_w4a16.sh` runs it under
`ncu --kernel-name regex:w4a16 --launch-count 2`): the selection table's entries for one shape
at the given token counts, on random weights, each launched exactly once.

    python -m benchmarks.quant_gemm_profile --table h200_w4a16_table.json [--shape 28672x4096]
        [--tokens 1,128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> int:
    from loraplex.kernels.w4a16 import kernel_name, w4a16_gemm_triton
    from loraplex.kernels.w4a16.dispatch import use_selection_table
    from loraplex.kernels.w4a16.types import padded_k

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=None)
    parser.add_argument("--shape", default="28672x4096", help="N x K")
    parser.add_argument("--tokens", default="1,128")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm_profile: no CUDA device, skipped")
        return 0
    if args.table is not None and args.table.exists():
        use_selection_table(args.table)
    n, k = (int(v) for v in args.shape.split("x"))
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, padded_k(k) // 8), dtype=torch.int32,
                            device="cuda")  # fmt: skip
    scales = (torch.rand(k // 128, n, device="cuda") * 0.01 + 1e-3).bfloat16()
    zeros = torch.randint(0, 16, (k // 128, n), device="cuda").bfloat16()
    for m in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        print(f"M={m} N={n} K={k}: {kernel_name(m, n, k, 128, 4)}", flush=True)
        w4a16_gemm_triton(x, qweight, scales, zeros, 128, 4)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
