"""W4A16 and FP8 W8A8 GEMM against bf16 cuBLAS and PyTorch's own quantized kernels, on the
Llama-3.1-8B projection shapes, in one run; the W4A16 sweep's winners become the selection table.

    python -m benchmarks.quant_gemm [--out benchmarks/results/h200_quant.json]
        [--table benchmarks/results/h200_w4a16_table.json] [--tokens 1,4,16] [--rep-ms 8]

For each (N, K) shape and token count M, each path timed under CUDA graphs
(triton.testing.do_bench_cudagraph, median) over `copies` copies of the weights whose total is
several times the L2 (so no weight is served from L2 as it would not be in a model):
- bf16: torch.nn.functional.linear (cuBLAS);
- ours W4A16 (`w4a16_gemm_triton`), group 128: every candidate of `quant_gemm_candidates`
  (the fused kernel's tiles and splits, dequant + cuBLAS from 128 tokens), the fastest that
  passes its check is the row's figure and the table's entry; the launch dispatch picked before
  this run (`w4a16_dispatched_*`) and the best of each kind beside it;
- PyTorch int4: torch._weight_int4pack_mm (tinygemm), group 128 (up to 128 tokens: beyond, it
  runs at ~0.05x and would take most of the run);
- ours FP8 (`fp8_linear`, activation quantization included), per-channel and 128x128 blocks;
- PyTorch FP8: per-token quantization in torch ops + torch._scaled_mm with row-wise scales.
Every path is checked against an fp32 reference first (relative error < 1e-2; a failed check is
not timed). speedup = bf16 time / time; metrics are geometric means over the shapes. Achieved
bandwidth (weight + activation + output bytes / time) is reported per path beside the
device-to-device copy bandwidth measured in the same run (`w4a16_copy_fraction_m<M>`).
Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch

from benchmarks.common.quant_gemm_candidates import precompile, w4a16_candidates
from benchmarks.record import record_header
from loraplex.kernels.w4a16.dispatch import M_BUCKETS, m_bucket, write_selection_table
from loraplex.kernels.w4a16.types import W4A16Config, padded_k

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
TOKENS = [1, 4, 16, 64, 128, 256, 1024, 4096]
GROUP_SIZE = 128
BITS = 4
FP8_MAX = 448.0
L2_BYTES = 50 * 2**20
TINYGEMM_MAX_M = 128
DEVICE = "cuda"
#: Activations, bf16 weights, W4A16 scales and zero points.
DTYPE = torch.bfloat16
TARGETS = {
    "w4a16_speedup_m1": 2.2, "w4a16_speedup_m16": 2.0, "w4a16_speedup_m64": 1.4,
    "w4a16_speedup_m128": 1.0, "w4a16_speedup_m256": 1.0, "w4a16_speedup_m1024": 0.9,
    "w4a16_speedup_m4096": 0.9,
}  # fmt: skip


class Timer:
    """Median ms of one call, replayed from a CUDA graph over `copies` weight copies."""

    def __init__(self, rep_ms: int) -> None:
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[int], object], copies: int) -> float:
        import triton.testing

        def run_all() -> None:
            for i in range(copies):
                fn(i)

        run_all()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(run_all, rep=self.rep_ms, return_mode="median")
        return float(ms) / copies


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.int16, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median"))
    return 2 * 2**31 / ms / 1e6


class ShapeWeights:
    """`copies` copies of one (N, K) weight in each format (random values)."""

    def __init__(self, n: int, k: int) -> None:
        from loraplex.kernels.fp8_gemm import quantize_fp8_reference

        self.n, self.k = n, k
        groups = k // GROUP_SIZE
        self.int4_bytes = n * k // 2 + 2 * 2 * n * groups
        self.copies = max(1, math.ceil(4 * L2_BYTES / self.int4_bytes))
        self.bf16, self.w4, self.tiny, self.fp8, self.fp8_block = [], [], [], [], []
        for _ in range(self.copies):
            weight = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02  # [N, K]
            self.bf16.append(weight)
            # NOTE: random words are random 4-bit values in any layout, the kernels' too.
            qweight = torch.randint(-(2**31), 2**31 - 1, (n, padded_k(k) // 8),
                                    dtype=torch.int32, device=DEVICE)  # fmt: skip
            scales = (torch.rand(groups, n, device=DEVICE) * 0.01 + 1e-3).to(DTYPE)
            zeros = torch.randint(0, 16, (groups, n), device=DEVICE).to(DTYPE)
            self.w4.append((qweight, scales, zeros))
            nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEVICE)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8)
            scales_zeros = torch.rand(groups, n, 2, device=DEVICE).bfloat16() * 0.01
            self.tiny.append((nibbles, packed, scales_zeros))
            self.fp8.append(quantize_fp8_reference(weight, k))  # [N, K], [N, 1]
            self.fp8_block.append(quantize_fp8_reference(weight, 128))  # [N, K], [N, K / 128]


def _tinygemm_reference(x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor):
    """fp32 x @ W^T for tinygemm's format: w = (q - 8) * scale + zero, byte i = columns 2i
    (high nibble) and 2i + 1 (low nibble)."""
    q = torch.stack(((nibbles >> 4), nibbles & 15), dim=-1).reshape(nibbles.shape[0], -1).float()
    scale = scales_zeros[..., 0].float().t().repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]
    zero = scales_zeros[..., 1].float().t().repeat_interleave(GROUP_SIZE, dim=1)
    return x.float() @ ((q - 8) * scale + zero).t()


def _torch_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's own FP8 path: per-token quantization in torch ops, then row-wise _scaled_mm."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [M, 1]
    x_q = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16
    )


def _checked(fn: Callable[[], torch.Tensor], expected: torch.Tensor) -> float:
    """Relative error of fn()'s first rows (inf when it raises); a failure is printed."""
    try:
        got = fn()[: expected.shape[0]].float()
        err = float((got - expected).norm() / expected.norm())
    except Exception as exc:  # noqa: BLE001 - report and go on: the other paths still count
        print(f"    failed: {type(exc).__name__}: {exc}"[:400], flush=True)
        err = float("inf")
    if not err < 1e-2:
        print(f"    CHECK FAILED: relative error {err}", flush=True)
    return err


def _time_checked(fn, expected, timer: Timer, copies: int) -> dict:
    err = _checked(lambda: fn(0), expected)
    ok = err < 1e-2
    return {"ms": timer(fn, copies) if ok else math.inf, "rel_err": err, "ok": ok}


def _sweep_w4a16(w: ShapeWeights, x, expected, timer: Timer) -> list[dict]:
    from loraplex.kernels.split_k import num_sms
    from loraplex.kernels.w4a16 import w4a16_gemm_triton
    from loraplex.kernels.w4a16.dispatch import select_config

    m = x.shape[0]
    dispatched = select_config(m, w.n, w.k, BITS)
    results = []
    for i, cfg in enumerate(
        dict.fromkeys([dispatched, *w4a16_candidates(m, w.n, w.k, num_sms(x.device))])
    ):
        run = lambda c, cfg=cfg: w4a16_gemm_triton(  # noqa: E731
            x, *w.w4[c], GROUP_SIZE, BITS, config=cfg
        )
        timed = _time_checked(run, expected, timer, w.copies)
        results.append({"fields": list(astuple(cfg)), "dispatched": i == 0, **timed})
    return results


def bench_point(w: ShapeWeights, m: int, timer: Timer, with_fp8: bool) -> dict:
    """Every path at M tokens of one shape: a row of times, speed-ups, bandwidths, errors."""
    from loraplex.kernels.fp8_gemm import fp8_linear, fp8_small_m_reference
    from loraplex.kernels.w4a16.reference import dequantize_reference

    n, k, c = w.n, w.k, w.copies
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    rows = min(m, 64)
    w4_expected = x[:rows].float() @ dequantize_reference(*w.w4[0], GROUP_SIZE, BITS)
    lin = torch.nn.functional.linear
    paths = {"bf16": (lambda i: lin(x, w.bf16[i]), None)}
    if m <= TINYGEMM_MAX_M:
        nibbles, _, sz = w.tiny[0]
        paths["torch_int4"] = (
            lambda i: torch._weight_int4pack_mm(x, w.tiny[i][1], GROUP_SIZE, w.tiny[i][2]),
            _tinygemm_reference(x[:rows], nibbles, sz),
        )
    if with_fp8:
        # NOTE: the FP8 references quantize x as W8A8 does (e4m3 keeps 3 mantissa bits).
        dense_fp8 = fp8_small_m_reference(x[:rows], *w.fp8[0], None, None, None).float()
        dense_block = fp8_small_m_reference(x[:rows], *w.fp8_block[0], 128, None, None).float()
        paths["fp8"] = (lambda i: fp8_linear(x, *w.fp8[i]), dense_fp8)
        paths["fp8_block"] = (lambda i: fp8_linear(x, *w.fp8_block[i], block_k=128), dense_block)
        paths["torch_fp8"] = (lambda i: _torch_fp8(x, *w.fp8[i]), dense_fp8)
    act_bytes = 2 * m * (k + n)
    weight_bytes = {"bf16": 2 * n * k, "w4a16": w.int4_bytes, "torch_int4": w.int4_bytes,
                    "fp8": n * k + 4 * n, "fp8_block": n * k + 4 * n * k // 128,
                    "torch_fp8": n * k + 4 * n}  # fmt: skip
    row: dict = {"n": n, "k": k, "m": m, "copies": c}
    for name, (fn, expected) in paths.items():
        timed = {"ms": timer(fn, c), "ok": True} if expected is None else None
        timed = timed or _time_checked(fn, expected, timer, c)
        row[f"{name}_ms"], row[f"{name}_rel_err"] = timed["ms"], timed.get("rel_err", 0.0)
    sweep = _sweep_w4a16(w, x, w4_expected, timer)
    row["w4a16_sweep"] = sweep
    best = min(sweep, key=lambda r: r["ms"])
    row["w4a16_ms"], row["w4a16_config"] = best["ms"], best["fields"]
    row["w4a16_dispatched_ms"] = next(r["ms"] for r in sweep if r["dispatched"])
    for kind in {r["fields"][0] for r in sweep}:
        row[f"w4a16_{kind}_ms"] = min(r["ms"] for r in sweep if r["fields"][0] == kind)
    bf16_ms = row["bf16_ms"]
    for key in [key for key in row if key.endswith("_ms")]:
        name = key.removesuffix("_ms")
        nbytes = weight_bytes.get(name.split("_")[0] if name.startswith("w4a16") else name)
        if name != "bf16":
            row[f"{name}_speedup"] = bf16_ms / row[key]
        if nbytes is not None:
            row[f"{name}_gbps"] = (nbytes + act_bytes) / row[key] / 1e6
    kind, bm, bn, split, warps, stages, *ahead = best["fields"]
    ahead = " prefetch" if any(ahead) else ""
    print(
        f"N={n:5d} K={k:5d} M={m:4d} bf16 {bf16_ms * 1e3:8.1f}us | w4a16 "
        f"{row['w4a16_speedup']:5.2f}x ({row['w4a16_gbps']:.0f} GB/s, {kind} {bm}x{bn} "
        f"split {split} w{warps} s{stages}{ahead}; dispatched "
        f"{row['w4a16_dispatched_speedup']:.2f}x) | "
        + " ".join(f"{p} {row[f'{p}_speedup']:.2f}x" for p in paths if p != "bf16"),
        flush=True,
    )
    return row


def _geomean(rows: list[dict], key: str, m: int) -> float:
    values = [r[key] for r in rows if r["m"] == m and r.get(key, 0) > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def metrics_of(rows: list[dict], copy_gbps: float) -> dict[str, float]:
    """Geometric means over the shapes per M: speed-ups over bf16 and achieved bandwidth."""
    metrics: dict[str, float] = {"copy_gbps": copy_gbps}
    names = sorted({key.removesuffix("_speedup") for r in rows for key in r
                    if key.endswith("_speedup")})  # fmt: skip
    for m in sorted({r["m"] for r in rows}):
        for name in names:
            value = _geomean(rows, f"{name}_speedup", m)
            if not math.isnan(value):
                metrics[f"{name}_speedup_m{m}"] = value
        for name in ("bf16", "w4a16", "fp8"):
            value = _geomean(rows, f"{name}_gbps", m)
            if not math.isnan(value):
                metrics[f"{name}_gbps_m{m}"] = value
        if f"w4a16_gbps_m{m}" in metrics:
            metrics[f"w4a16_copy_fraction_m{m}"] = metrics[f"w4a16_gbps_m{m}"] / copy_gbps
    return metrics


def selection_table(rows: list[dict]) -> dict[tuple[int, int, int, int], W4A16Config]:
    """The sweep's fastest checked launch per (bits, M bucket, N, K)."""
    table = {}
    for r in rows:
        ok = [c for c in r.get("w4a16_sweep", []) if c["ok"]]
        if ok:
            best = min(ok, key=lambda c: c["ms"])
            table[(BITS, m_bucket(r["m"]), r["n"], r["k"])] = W4A16Config(*best["fields"])
    return table


def summary_table(metrics: dict[str, float], tokens: list[int]) -> str:
    """The short table printed last: per M the geometric means against bf16 and the target."""
    lines = ["   M  w4a16 (target)  best mma  dequant  torch_int4  fp8   fp8_block  torch_fp8"]

    def cell(name: str, m: int, width: int = 8) -> str:
        value = metrics.get(f"{name}_speedup_m{m}")
        return f"{value:{width}.2f}" if value is not None else " " * (width - 1) + "-"

    for m in tokens:
        target = TARGETS.get(f"w4a16_speedup_m{m}")
        best_mma = max(metrics.get(f"w4a16_{k}_speedup_m{m}", 0.0) for k in ("mma", "mma_wscale"))
        lines.append(
            f"{m:4d} {cell('w4a16', m, 6)} ({target if target else '-':>4}) {best_mma:9.2f} "
            f"{cell('w4a16_dequant', m)} {cell('torch_int4', m, 10)} {cell('fp8', m, 5)} "
            f"{cell('fp8_block', m, 9)} {cell('torch_fp8', m, 9)}"
        )
    if "w4a16_gbps_m1" in metrics:
        lines.append(
            f"M=1: w4a16 {metrics['w4a16_gbps_m1']:.0f} GB/s = "
            f"{metrics['w4a16_copy_fraction_m1']:.2f} of the {metrics['copy_gbps']:.0f} GB/s copy"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_quant.json"))
    parser.add_argument("--table", type=Path, default=None, help="write the selection table")
    parser.add_argument("--tokens", type=str, default="", help="comma-separated token counts")
    parser.add_argument("--shapes", type=str, default="", help="e.g. 6144x4096,4096x14336 (NxK)")
    parser.add_argument("--rep-ms", type=int, default=8)
    parser.add_argument("--no-fp8", action="store_true", help="time W4A16 and bf16 only")
    parser.add_argument("--compile-workers", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm benchmark: no CUDA device, skipped")
        return 0
    tokens = [int(m) for m in args.tokens.split(",")] if args.tokens else TOKENS
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if any(m_bucket(m) != m for m in tokens):
        print(f"note: token counts off the table's buckets {M_BUCKETS} fill the next bucket")
    from loraplex.kernels.split_k import num_sms

    sms = num_sms(torch.device(DEVICE))
    configs = [c for n, k in shapes for m in tokens for c in w4a16_candidates(m, n, k, sms)]
    try:
        failures = precompile(configs, args.compile_workers)
    except Exception as exc:  # noqa: BLE001 - the sweep then compiles each launch itself
        failures = [f"the compile pool stopped: {type(exc).__name__}: {exc}"]
    print(f"compiled {len(configs)} W4A16 launches; failures: {failures or 'none'}", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    timer, rows = Timer(args.rep_ms), []
    for n, k in shapes:
        weights = ShapeWeights(n, k)
        rows += [bench_point(weights, m, timer, not args.no_fp8) for m in tokens]
        del weights
        torch.cuda.empty_cache()
        # Written after each shape: a cut-off run keeps its rows.
        header = record_header("quant_gemm")
        metrics = metrics_of(rows, copy_gbps)
        record = {**header, "metrics": metrics, "targets": TARGETS, "rows": rows,
                  "baseline": "torch.nn.functional.linear in bf16 (cuBLAS), same shapes, CUDA "
                  "graphs, weights rotated over copies larger than L2; PyTorch int4 = "
                  "torch._weight_int4pack_mm (group 128), PyTorch FP8 = torch-ops per-token "
                  "quant + torch._scaled_mm row-wise"}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        if args.table is not None:
            args.table.parent.mkdir(parents=True, exist_ok=True)
            table = selection_table(rows)
            about = {**record_header("quant_gemm W4A16 selection table"),
                     "metrics": {"entries": len(table)},
                     "baseline": {"what": "each entry: the fastest checked W4A16 launch of its "
                                  "shape in the sweep, timed beside bf16 cuBLAS in the same run"}}  # fmt: skip
            write_selection_table(args.table, table, about)
    print(summary_table(metrics_of(rows, copy_gbps), tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
