"""W4A16 and FP8 W8A8 GEMM against torch bf16 matmul on Llama-3.1-8B projection shapes.

    python -m benchmarks.quant_gemm [--out benchmarks/results/h200_quant.json] [--quick]
        [--tokens 1,16,64]

For each (N, K) shape and token count M: checks every W4A16 candidate config against an fp32
reference (a failing one, or one that does not compile, is reported and never picked), times it under CUDA graphs
(triton.testing.do_bench_cudagraph), keeps the fastest, and times bf16 (cuBLAS) and FP8.
speedup = bf16 time / our time; the metrics are geometric means over the shapes of the best
configs. Prints the `TUNED_CONFIGS` dict for `loraplex/kernels/quant_gemm_configs.py`.
Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

from benchmarks.record import git_commit
from loraplex.kernels.quant_gemm_configs import GemmConfig

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
GROUP_SIZE = 128
BITS = 4
_REP_MS = 40


def _fma_candidates() -> list[GemmConfig]:
    """The FMA decode kernel: tiles, warps, split-K (0: two programs per SM) and loop stages."""
    grid = [(bn, bk, s, w, 3) for bn, w in ((128, 4), (256, 4), (256, 8), (512, 8))
            for bk in (64, 128) for s in (0, 16)]  # fmt: skip
    grid += [(128, 128, 0, 4, 2), (256, 128, 0, 4, 2), (128, 128, 0, 4, 5), (256, 128, 8, 4, 4),
             (64, 128, 0, 2, 3), (128, 128, 32, 4, 3)]  # fmt: skip
    return [GemmConfig("fma", 1, bn, bk, s, w, st) for bn, bk, s, w, st in grid]


def _gemm_t_candidates(block_ms: tuple[int, ...], stages: tuple[int, ...]) -> list[GemmConfig]:
    """The swapped tensor-core kernel: token tiles, weight tiles, K tiles and loop stages."""
    grid = [(bm, bn, bk, 4, st) for bm in block_ms for bn in (64, 128)
            for bk in (64, 128) for st in stages]  # fmt: skip
    grid += [(bm, 256, 128, 8, st) for bm in block_ms for st in (2, 3)]
    return [GemmConfig("gemm_t", bm, bn, bk, 0, w, st) for bm, bn, bk, w, st in grid]


def candidates(m: int) -> list[GemmConfig]:
    """W4A16 configs worth timing at M tokens (split_k 0: fitted to the SM count)."""
    if m <= 4:
        old = [GemmConfig("gemv", 1, 128, 128, s, 4, 2) for s in (0, 8)]
        mma = [GemmConfig("gemm_t", 16, bn, 128, 0, 4, 3) for bn in (64, 128)]
        return old + _fma_candidates() + mma
    if m <= 16:
        old = [GemmConfig("gemm", 16, 128, 128, 0, 4, st) for st in (1, 3)]
        return old + _gemm_t_candidates((16,), (2, 3, 4))
    if m <= 64:
        old = [GemmConfig("gemm", 64, 64, 128, 0, 4, 3), GemmConfig("gemm", 64, 128, 64, 0, 4, 3)]
        return old + _gemm_t_candidates((32, 64), (2, 4))
    if m <= 256:
        return [GemmConfig("gemm", bm, bn, 64, 0, w, st)
                for bm, bn, w, st in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
                                      (64, 256, 8, 4))]  # fmt: skip
    return [GemmConfig("dequant", 0, 0, 128, 1, 4, 1), GemmConfig("dequant", 0, 2048, 128, 1, 4, 1),
            GemmConfig("dequant", 0, 1024, 128, 1, 4, 1),
            GemmConfig("gemm", 128, 128, 64, 1, 8, 4)]  # fmt: skip


def _bench(fn) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=_REP_MS))


def _w4a16_inputs(n: int, k: int) -> tuple[torch.Tensor, ...]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // GROUP_SIZE, n, device="cuda") * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 16, (k // GROUP_SIZE, n), device="cuda").half()
    return qweight, scales, zeros


def _config_str(c: GemmConfig) -> str:
    return (f'GemmConfig("{c.kind}", {c.block_m}, {c.block_n}, {c.block_k}, {c.split_k}, '
            f"{c.num_warps}, {c.num_stages})")  # fmt: skip


def _bench_shape(n: int, k: int, tokens: list[int]) -> list[dict]:
    from loraplex.kernels.fp8_gemm import fp8_linear, quantize_fp8_reference
    from loraplex.kernels.quant_gemm_w4a16 import wna16_dequantize_reference, wna16_gemm_triton

    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qweight, scales, zeros = _w4a16_inputs(n, k)
    w_ref = wna16_dequantize_reference(qweight, scales, zeros, GROUP_SIZE, BITS)  # [K, N] fp32
    w_q, w_scale = quantize_fp8_reference(weight, k)  # per channel: [N, K], [N, 1]
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expected = x[:64].float() @ w_ref  # [min(m, 64), N]
        bf16 = _bench(lambda x=x: torch.nn.functional.linear(x, weight))
        fp8 = _bench(lambda x=x: fp8_linear(x, w_q, w_scale))
        configs = []
        for c in candidates(m):
            run = lambda x=x, c=c: wna16_gemm_triton(  # noqa: E731
                x, qweight, scales, zeros, GROUP_SIZE, BITS, config=c
            )
            try:
                got = run()[:64].float()
                err = float((got - expected).abs().max() / expected.abs().max())
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                print(f"  {_config_str(c)} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                err = float("inf")
            ok = err < 2e-2
            ms = _bench(run) if ok else float("inf")
            configs.append({"config": _config_str(c), "ms": ms, "rel_err": err, "ok": ok})
        best = min(configs, key=lambda r: r["ms"])
        rows.append({"n": n, "k": k, "m": m, "bf16_ms": bf16, "fp8_ms": fp8,
                     "w4a16_ms": best["ms"], "w4a16_config": best["config"],
                     "w4a16_speedup": bf16 / best["ms"], "fp8_speedup": bf16 / fp8,
                     "configs": configs})  # fmt: skip
        times = " ".join(f"{r['ms'] * 1e3:.1f}" if r["ok"] else "FAIL" for r in configs)
        print(f"N={n:5d} K={k:5d} M={m:4d} bf16 {bf16 * 1e3:7.1f} fp8 {fp8 * 1e3:7.1f} "
              f"({bf16 / fp8:4.2f}x) w4 {best['ms'] * 1e3:7.1f} ({bf16 / best['ms']:4.2f}x) "
              f"us | all: {times}", flush=True)  # fmt: skip
    return rows


def _geomean(rows: list[dict], key: str, m: int) -> float:
    values = [r[key] for r in rows if r["m"] == m]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _tuned_table(rows: list[dict]) -> str:
    lines = ["TUNED_CONFIGS: dict[tuple[int, int, int, int], GemmConfig] = {"]
    lines += [f"    ({BITS}, {r['m']}, {r['n']}, {r['k']}): {r['w4a16_config']}," for r in rows]
    return "\n".join([*lines, "}"])


def _summary(rows: list[dict]) -> dict:
    metrics = {f"w4a16_speedup_m{m}": _geomean(rows, "w4a16_speedup", m) for m in (1, 16, 64, 1024)}
    metrics["fp8_speedup_m1024"] = _geomean(rows, "fp8_speedup", 1024)
    return {
        "benchmark": "quant_gemm",
        "device": torch.cuda.get_device_name(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
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
        "tuned_configs": _tuned_table(rows),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_quant.json"))
    parser.add_argument("--quick", action="store_true", help="only M = 1, 16, 64, 1024")
    parser.add_argument(
        "--tokens", type=str, default="", help="comma-separated token counts (overrides --quick)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm benchmark: no CUDA device, skipped")
        return 0
    tokens = [1, 16, 64, 1024] if args.quick else TOKENS
    if args.tokens:
        tokens = [int(m) for m in args.tokens.split(",")]
    result = _summary([row for n, k in SHAPES for row in _bench_shape(n, k, tokens)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(result["tuned_configs"])
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
