"""One-token projections: the Triton GEMV's configs swept against cuBLAS (F.linear) on the
shapes of a model, each call timed inside a CUDA graph (no launch overhead). Prints the
winners as `GEMV_CONFIGS` entries for loraplex/kernels/gemv.py and writes them to --configs-out.

    python -m benchmarks.gemv [--model configs/models/llama-3.1-8b.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.common.engine import LLAMA_8B, projection_shapes
from benchmarks.common.timing import graph_seconds_per_call
from benchmarks.record import write_result
from loraplex.kernels.gemv import GemvConfig

_MARGIN = 0.97  # a config must be this much faster than cuBLAS to be used


def configs() -> list[GemvConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product(
        (4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4)
    ):
        if bn * bk <= 16384 and bk >= 32 * warps:
            out.append(GemvConfig(bn, bk, warps, stages))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=LLAMA_8B)
    parser.add_argument("--configs-out", default="gemv_configs.json")
    parser.add_argument("--out", default="h200_gemv.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.gemv needs a CUDA GPU; skipped")
        return 0
    from loraplex.kernels.triton_gemv import gemv_triton

    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    winners: dict[str, list[int]] = {}
    for n, k in projection_shapes(args.model):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(x, w).float()
        cublas = graph_seconds_per_call(lambda x=x, w=w: F.linear(x, w))
        best, best_config = float("inf"), None
        for config in configs():
            out = gemv_triton(x, w, None, config)
            if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"{config} gives wrong results at {n}x{k}")
            seconds = graph_seconds_per_call(lambda x=x, w=w, c=config: gemv_triton(x, w, None, c))
            if seconds < best:
                best, best_config = seconds, config
        gb = w.numel() * 2 / 1e9
        print(
            f"{n} x {k}: cuBLAS {cublas * 1e6:.1f} us ({gb / cublas / 1e3:.2f} TB/s), Triton "
            f"{best * 1e6:.1f} us ({gb / best / 1e3:.2f} TB/s) with {best_config}"
        )
        metrics[f"gemv_{n}x{k}_us"] = best * 1e6
        metrics[f"gemv_{n}x{k}_vs_cublas"] = cublas / best
        baseline[f"cublas_{n}x{k}_us"] = cublas * 1e6
        if best < _MARGIN * cublas and best_config is not None:
            c = best_config
            winners[f"{n},{k}"] = [c.block_n, c.block_k, c.num_warps, c.num_stages]
            print(f"    ({n}, {k}): GemvConfig({', '.join(map(str, winners[f'{n},{k}']))}),")
    with open(args.configs_out, "w") as f:
        json.dump(winners, f)
    write_result(args.out, "gemv", metrics, baseline, workload={"model": args.model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
