"""W4A16 and FP8 W8A8 GEMM against torch bf16 matmul on Llama-3.1-8B projection shapes.

    python benchmarks/quant_gemm.py [--out benchmarks/results/h200_quant.json]

Times each op under CUDA graphs (triton.testing.do_bench_cudagraph) for M in 1..4096 and the
four (N, K) shapes; speedup = bf16 time / our time; the metrics are geometric means over the
shapes. Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
GROUP_SIZE = 128


def _bench(fn) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph."""
    import triton.testing

    fn()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100))


def _w4a16_inputs(n: int, k: int) -> tuple[torch.Tensor, ...]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // GROUP_SIZE, n, device="cuda") * 0.01).half()
    zeros = torch.full((k // GROUP_SIZE, n), 8.0, device="cuda").half()
    return qweight, scales, zeros


def _bench_shape(n: int, k: int) -> list[dict]:
    from loraplex.kernels.fp8_gemm import fp8_linear, quantize_fp8_reference
    from loraplex.kernels.quant_gemm_w4a16 import kernel_name, wna16_gemm

    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qweight, scales, zeros = _w4a16_inputs(n, k)
    w_q, w_scale = quantize_fp8_reference(weight, k)  # per channel: [N, K], [N, 1]
    rows = []
    for m in TOKENS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = _bench(lambda x=x: torch.nn.functional.linear(x, weight))
        w4 = _bench(lambda x=x: wna16_gemm(x, qweight, scales, zeros, GROUP_SIZE, 4))
        fp8 = _bench(lambda x=x: fp8_linear(x, w_q, w_scale))
        rows.append({"n": n, "k": k, "m": m, "bf16_ms": bf16, "w4a16_ms": w4, "fp8_ms": fp8,
                     "w4a16_kernel": kernel_name(m), "w4a16_speedup": bf16 / w4,
                     "fp8_speedup": bf16 / fp8})  # fmt: skip
        print(f"N={n:6d} K={k:6d} M={m:5d}  bf16 {bf16 * 1e3:8.1f} us  "
              f"w4a16 {w4 * 1e3:8.1f} us ({bf16 / w4:4.2f}x)  "
              f"fp8 {fp8 * 1e3:8.1f} us ({bf16 / fp8:4.2f}x)", flush=True)  # fmt: skip
    return rows


def run() -> dict:
    rows = [row for n, k in SHAPES for row in _bench_shape(n, k)]
    return _summary(rows)


def _geomean(rows: list[dict], key: str, m: int) -> float:
    values = [r[key] for r in rows if r["m"] == m]
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _summary(rows: list[dict]) -> dict:
    metrics = {f"w4a16_speedup_m{m}": _geomean(rows, "w4a16_speedup", m) for m in (1, 16, 64, 1024)}
    metrics["fp8_speedup_m1024"] = _geomean(rows, "fp8_speedup", 1024)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return {
        "benchmark": "quant_gemm",
        "device": torch.cuda.get_device_name(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit.stdout.strip() or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "baseline": "torch.nn.functional.linear in bf16 (cuBLAS), same shapes, CUDA graphs",
        "targets": {
            "w4a16_speedup_m1": 3.0,
            "w4a16_speedup_m16": 3.0,
            "w4a16_speedup_m64": 1.5,
            "w4a16_speedup_m1024": 0.9,
            "fp8_speedup_m1024": 1.5,
        },  # fmt: skip
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_quant.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm benchmark: no CUDA device, skipped")
        return 0
    result = run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
