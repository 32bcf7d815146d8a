"""W4A16 and FP8 W8A8 GEMM against bf16 cuBLAS and PyTorch's own quantized kernels, on the
Llama-3.1-8B projection shapes, in one run.

    python -m benchmarks.quant_gemm [--out benchmarks/results/h200_quant.json] [--sweep]
        [--tokens 1,4,16] [--rep-ms 25]

For each (N, K) shape and token count M, each timed under CUDA graphs
(triton.testing.do_bench_cudagraph, median) over `copies` copies of the weights whose total is
several times the L2 (so no weight is served from L2 as it would not be in a model):
- bf16: torch.nn.functional.linear (cuBLAS);
- ours W4A16 (`wna16_gemm`, the config `select_config` dispatches), group 128;
- PyTorch int4: torch._weight_int4pack_mm (tinygemm), group 128;
- ours FP8 (`fp8_linear`: activation quantization included), per-channel and 128x128 blocks;
- PyTorch FP8: per-token quantization in torch ops + torch._scaled_mm with row-wise scales.
Outputs are checked against fp32 references first (ours and PyTorch's own).
speedup = bf16 time / time; metrics are geometric means over the shapes. Achieved bandwidth
(weight + activation + output bytes / time) is reported per kernel beside the device-to-device
copy bandwidth measured in the same run.

With --sweep, every candidate W4A16 config and FP8 decode config is also checked and timed, and
the fastest per (M bucket, N, K) is printed as the `TUNED_CONFIGS` / `FP8_TUNED_CONFIGS` dicts
to paste into `loraplex/kernels/quant_gemm_configs.py` and `loraplex/kernels/fp8_gemm.py`
(--sweep-w4a16: the W4A16 configs only, FP8 not timed). Each row keeps the dispatched kernel's own time
(`w4a16_dispatched_*`) and the best "stream" / "stream_pair" config's (`w4a16_stream_*`)
beside the winner's.
--table PATH writes the W4A16 winners as a selection table file: run the engine with
LORAPLEX_QUANT_GEMM_TABLE=PATH to dispatch from it (e.g. `benchmarks.quant_e2e` right after).
Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch

from benchmarks.record import git_commit, record_header
from loraplex.kernels.fp8_gemm import FP8_DECODE_MAX_M, Fp8DecodeConfig
from loraplex.kernels.quant_gemm_configs import M_BUCKETS, GemmConfig, write_selection_table

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
TOKENS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
GROUP_SIZE = 128
BITS = 4
FP8_MAX = 448.0
L2_BYTES = 50 * 2**20
TARGETS = {
    "w4a16_speedup_m1": 2.5, "w4a16_speedup_m4": 2.2, "w4a16_speedup_m16": 1.6,
    "w4a16_speedup_m64": 1.1, "w4a16_speedup_m256": 0.95, "w4a16_speedup_m1024": 0.95,
    "w4a16_speedup_m4096": 0.95, "fp8_speedup_m1": 1.7, "fp8_speedup_m16": 1.5,
    "fp8_speedup_m32": 1.5, "fp8_speedup_m64": 1.5, "fp8_speedup_m1024": 1.6,
}  # fmt: skip


def w4a16_candidates(m: int) -> list[GemmConfig]:
    """W4A16 configs worth timing at M tokens (split_k 0: fitted to the SM count). Pruned by
    the first H200 sweep: the non-swapped "sliced" kernel lost everywhere above M = 16, and
    every tensor-core kernel lost to "dequant" + cuBLAS from M = 1024."""
    if m <= 4:
        grid = [("fma", 1, 256, 64, 16, 4, 3), ("fma", 1, 64, 128, 0, 2, 3),
                ("fma", 1, 128, 128, 0, 4, 3), ("sliced_t", 16, 128, 128, 0, 4, 3)]  # fmt: skip
    elif m <= 32:
        bm = 16 if m <= 16 else 32
        grid = [("gemm", bm, 128, 128, 0, 4, 1), ("gemm_t", bm, 64, 128, 0, 4, 2),
                ("sliced_t", bm, 128, 128, 0, 4, 3), ("sliced", 16, 128, 128, 0, 4, 3)]  # fmt: skip
    elif m <= 256:
        grid = [("gemm_t", 64, 64, 64, 0, 4, 4), ("gemm", 64, 64, 128, 0, 4, 3),
                ("gemm", 64, 128, 64, 0, 4, 3), ("dequant", 0, 0, 128, 1, 4, 1),
                ("dequant", 0, 2048, 128, 1, 4, 1)]  # fmt: skip
    else:
        grid = [("dequant", 0, 0, 128, 1, 4, 1), ("dequant", 0, 2048, 128, 1, 4, 1),
                ("dequant", 0, 1024, 128, 1, 4, 1)]  # fmt: skip
    return [GemmConfig(*c) for c in grid + stream_candidates(m)]


def stream_candidates(m: int) -> list[tuple]:
    """The stream decode kernels' config space at M tokens: token tile, weight columns per
    program (the MMA's M side), split-K (0: about two programs per SM), warps, stages. Mostly
    "stream_pair" (sm_90 SASS: ~3-3.7 instructions per weight in its loop, "stream" ~5.3, as
    "sliced_t" and "fma"); stages 1 loads the word tile to registers with 128-bit loads, more
    stages copy it asynchronously, 4 bytes at a time (the MMA operand wants it K-major); 2 warps
    run mma.sync with both operands in registers, 4 and 8 the warpgroup MMA (x through shared
    memory, one wait per pair of positions)."""
    if m > 64:
        return []
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    pair = [(128, 0, 4, 1), (128, 0, 4, 3), (256, 0, 8, 1), (256, 0, 8, 3), (128, 0, 2, 3),
            (128, 0, 2, 1), (256, 0, 4, 3), (128, 4, 4, 3), (256, 4, 8, 1), (128, 8, 4, 1)]  # fmt: skip
    if m > 16:
        pair = [(128, 0, 4, 1), (128, 0, 4, 3), (256, 0, 8, 3), (64, 0, 4, 3)]
    return [("stream_pair", bm, bn, 128, split, warps, stages)
            for bn, split, warps, stages in pair] + [("stream", bm, 128, 128, 0, 4, 3)]  # fmt: skip


def fp8_candidates() -> list[Fp8DecodeConfig]:
    """FP8 decode configs (M <= FP8_DECODE_MAX_M), per-channel scales."""
    grid = [(128, 128, 0, 4, 4), (64, 128, 0, 4, 4), (256, 128, 0, 8, 3), (128, 256, 0, 4, 3),
            (64, 256, 0, 4, 3)]  # fmt: skip
    return [Fp8DecodeConfig(*c) for c in grid]


def _config_str(c: GemmConfig | Fp8DecodeConfig) -> str:
    fields = [f'"{c.kind}"'] if isinstance(c, GemmConfig) else []
    if isinstance(c, GemmConfig):
        fields += [str(v) for v in (c.block_m, c.block_n, c.block_k, c.split_k)]
    else:
        fields += [str(v) for v in (c.block_n, c.block_k, c.split_k)]
    return f"{type(c).__name__}({', '.join(fields)}, {c.num_warps}, {c.num_stages})"


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
        return float(triton.testing.do_bench_cudagraph(run_all, rep=self.rep_ms)) / copies


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=200))
    return 2 * 2**31 / ms / 1e6


class ShapeWeights:
    """`copies` copies of one (N, K) weight in each format (random values)."""

    def __init__(self, n: int, k: int) -> None:
        from loraplex.kernels.fp8_gemm import quantize_fp8_reference

        self.n, self.k = n, k
        self.int4_bytes = n * k // 2 + 2 * 2 * n * k // GROUP_SIZE
        self.copies = max(1, math.ceil(4 * L2_BYTES / self.int4_bytes))
        groups = k // GROUP_SIZE
        self.bf16, self.w4, self.tiny, self.fp8, self.fp8_block = [], [], [], [], []
        for _ in range(self.copies):
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02  # [N, K]
            self.bf16.append(weight)
            qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32,
                                    device="cuda")  # fmt: skip
            scales = (torch.rand(groups, n, device="cuda") * 0.01 + 1e-3).bfloat16()
            zeros = torch.randint(0, 16, (groups, n), device="cuda").bfloat16()
            self.w4.append((qweight, scales, zeros))
            nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8)
            scales_zeros = torch.rand(groups, n, 2, device="cuda").bfloat16() * 0.01
            self.tiny.append((nibbles, packed, scales_zeros))
            self.fp8.append(quantize_fp8_reference(weight, k))  # [N, K], [N, 1]
            w_q, block_scales = quantize_fp8_reference(weight, 128)  # [N, K], [N, K / 128]
            self.fp8_block.append((w_q, block_scales))


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


def _ours_scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear`'s path above the decode kernel: Triton per-token quantization, _scaled_mm."""
    from loraplex.kernels.fp8_gemm import quantize_fp8_triton

    x_q, x_scale = quantize_fp8_triton(x, x.shape[1])
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16
    )


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def _checked(fn: Callable[[], torch.Tensor], expected: torch.Tensor) -> float:
    """Relative error of fn()'s first rows (inf when it raises); a failed check is printed,
    and its path is not timed."""
    try:
        err = _rel_err(fn()[: expected.shape[0]], expected)
    except Exception as exc:  # noqa: BLE001 - report and go on: the other paths still count
        print(f"    failed: {type(exc).__name__}: {exc}"[:400], flush=True)
        err = float("inf")
    if not err < 2e-2:
        print(f"    CHECK FAILED: relative error {err}", flush=True)
    return err


def _bench_point(
    w: ShapeWeights, m: int, timer: Timer, sweep: bool, sweep_fp8: bool, with_fp8: bool = True
) -> dict:
    from loraplex.kernels.fp8_gemm import fp8_linear, fp8_small_m_reference, fp8_small_m_triton
    from loraplex.kernels.quant_gemm_w4a16 import (
        kernel_name,
        wna16_dequantize_reference,
        wna16_gemm,
    )

    n, k, c = w.n, w.k, w.copies
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = min(m, 64)
    # References (fp32, first 64 tokens) and checks of every timed path.
    w_ref = wna16_dequantize_reference(*w.w4[0], GROUP_SIZE, BITS)  # [K, N]
    w4_expected = x[:rows].float() @ w_ref
    nibbles, packed, sz = w.tiny[0]
    # NOTE: the FP8 references quantize x as W8A8 does (e4m3 keeps 3 mantissa bits, ~3% off x).
    w_q, w_s = w.fp8[0]
    dense_fp8 = fp8_small_m_reference(x[:rows], w_q, w_s, None, None, None).float()
    bq, bs = w.fp8_block[0]
    dense_block = fp8_small_m_reference(x[:rows], bq, bs, 128, None, None).float()
    checks = {
        "w4a16": (lambda: wna16_gemm(x, *w.w4[0], GROUP_SIZE, BITS), w4_expected),
        "torch_int4": (
            lambda: torch._weight_int4pack_mm(x, packed, GROUP_SIZE, sz),
            _tinygemm_reference(x[:rows], nibbles, sz),
        ),
        "fp8": (lambda: fp8_linear(x, w_q, w_s), dense_fp8),
        "torch_fp8": (lambda: _torch_fp8(x, w_q, w_s), dense_fp8),
        "fp8_block": (lambda: fp8_linear(x, bq, bs, block_k=128), dense_block),
    }
    if not with_fp8:
        checks = {name: check for name, check in checks.items() if "fp8" not in name}
    errors = {name: _checked(fn, expected) for name, (fn, expected) in checks.items()}
    lin = torch.nn.functional.linear
    calls = {
        "bf16": lambda i: lin(x, w.bf16[i]),
        "w4a16": lambda i: wna16_gemm(x, *w.w4[i], GROUP_SIZE, BITS),
        "torch_int4": lambda i: torch._weight_int4pack_mm(
            x, w.tiny[i][1], GROUP_SIZE, w.tiny[i][2]
        ),
        "fp8": lambda i: fp8_linear(x, *w.fp8[i]),
        "fp8_block": lambda i: fp8_linear(x, *w.fp8_block[i], block_k=128),
        "torch_fp8": lambda i: _torch_fp8(x, *w.fp8[i]),
    }
    ms = {
        name: timer(fn, c) if errors.get(name, 0.0) < 2e-2 else float("nan")
        for name, fn in calls.items()
        if with_fp8 or "fp8" not in name
    }
    act_bytes = 2 * m * (k + n)
    weight_bytes = w.int4_bytes
    bytes_of = {"bf16": 2 * n * k, "w4a16": w.int4_bytes, "torch_int4": w.int4_bytes,
                    "fp8": n * k + 4 * n, "fp8_block": n * k + 4 * n * k // 128,
                    "torch_fp8": n * k + 4 * n}  # fmt: skip
    row = {"n": n, "k": k, "m": m, "copies": c, "w4a16_kernel": kernel_name(m, n, k, 128, BITS)}
    for name, t in ms.items():
        row[f"{name}_ms"] = t
        row[f"{name}_gbps"] = (bytes_of[name] + act_bytes) / t / 1e6
        row[f"{name}_rel_err"] = errors.get(name, float("nan"))
        if name != "bf16":
            row[f"{name}_speedup"] = ms["bf16"] / t
    if sweep:
        # NOTE: the dispatched config runs in the sweep too, so the winner, which becomes the
        # table entry for this (M bucket, N, K), is what dispatch runs at this M after pasting.
        row["w4a16_sweep"] = _sweep_w4a16(w, x, w4_expected, timer)
        for key in ("ms", "gbps", "speedup"):
            row[f"w4a16_dispatched_{key}"] = row[f"w4a16_{key}"]
        stream = [r for r in row["w4a16_sweep"] if r["fields"][0].startswith("stream")]
        if stream:
            best = min(stream, key=lambda r: r["ms"])
            row["w4a16_stream_ms"], row["w4a16_stream_kernel"] = best["ms"], best["config"]
            row["w4a16_stream_speedup"] = ms["bf16"] / best["ms"]
            row["w4a16_stream_gbps"] = (weight_bytes + act_bytes) / best["ms"] / 1e6
        _take_best(row, "w4a16", row["w4a16_sweep"], ms["bf16"], weight_bytes + act_bytes)
        if sweep_fp8 and m <= FP8_DECODE_MAX_M:
            row["fp8_sweep"] = _sweep_fp8(w, x, dense_fp8, timer, fp8_small_m_triton)
            # The path above the decode kernel (Triton quantization + _scaled_mm), at this M too.
            row["fp8_scaled_mm_ms"] = timer(lambda i: _ours_scaled_mm(x, *w.fp8[i]), c)
            take_faster_gemm(row, n * k + 4 * n + act_bytes)
            _take_best(row, "fp8", row["fp8_sweep"], ms["bf16"], n * k + 4 * n + act_bytes)
        ms["w4a16"] = row["w4a16_ms"]
        if with_fp8:
            ms["fp8"] = row["fp8_ms"]
    print(
        f"N={n:5d} K={k:5d} M={m:4d} bf16 {ms['bf16'] * 1e3:7.1f}us | "
        + " ".join(f"{name} {ms['bf16'] / t:5.2f}x" for name, t in ms.items() if name != "bf16")
        + f" | w4 {row['w4a16_gbps']:.0f} GB/s {row['w4a16_kernel']}",
        flush=True,
    )
    return row


def _try_config(run: Callable[[int], torch.Tensor], expected, timer: Timer, copies: int) -> dict:
    err = _checked(lambda: run(0), expected)
    ok = err < 2e-2
    return {"ms": timer(run, copies) if ok else float("inf"), "rel_err": err, "ok": ok}


def _take_best(row: dict, name: str, sweep: list[dict], bf16_ms: float, nbytes: int) -> None:
    """Replace the row's figures for `name` by the sweep's fastest config."""
    best = min(sweep, key=lambda r: r["ms"])
    if best["ok"]:
        row[f"{name}_ms"], row[f"{name}_kernel"] = best["ms"], best["config"]
        row[f"{name}_speedup"] = bf16_ms / best["ms"]
        row[f"{name}_gbps"] = nbytes / best["ms"] / 1e6


def take_faster_gemm(row: dict, nbytes: int) -> None:
    """Where Triton quantization + _scaled_mm beat the best decode config, the FP8 figures are
    its own (the tuned table then holds None for this point, and dispatch takes that path)."""
    if row["fp8_scaled_mm_ms"] < row["fp8_ms"]:
        row["fp8_ms"], row["fp8_kernel"] = row["fp8_scaled_mm_ms"], "quantize + _scaled_mm"
        row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["fp8_gbps"] = nbytes / row["fp8_ms"] / 1e6


def _sweep_w4a16(w: ShapeWeights, x, expected, timer: Timer) -> list[dict]:
    from loraplex.kernels.quant_gemm_w4a16 import _num_sms, select_config, wna16_gemm_triton

    m = x.shape[0]
    dispatched = select_config(m, w.n, w.k, GROUP_SIZE, BITS, _num_sms(x.device))
    results = []
    for cfg in dict.fromkeys([dispatched, *w4a16_candidates(m)]):
        run = lambda i, cfg=cfg: wna16_gemm_triton(  # noqa: E731
            x, *w.w4[i], GROUP_SIZE, BITS, config=cfg
        )
        timed = _try_config(run, expected, timer, w.copies)
        results.append({"config": _config_str(cfg), "fields": list(astuple(cfg)), **timed})
    return results


def _sweep_fp8(w: ShapeWeights, x, expected, timer: Timer, kernel) -> list[dict]:
    from loraplex.kernels.fp8_gemm import fp8_decode_config

    results = []
    dispatched = fp8_decode_config(x.shape[0], w.n, w.k)
    for cfg in dict.fromkeys([c for c in (dispatched, *fp8_candidates()) if c is not None]):
        run = lambda i, cfg=cfg: kernel(x, *w.fp8[i], None, None, None, cfg)  # noqa: E731
        results.append({"config": _config_str(cfg), **_try_config(run, expected, timer, w.copies)})
    return results


def _geomean(rows: list[dict], key: str, m: int) -> float:
    values = [r[key] for r in rows if r["m"] == m and key in r and r[key] > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _bucket(m: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if m <= b), buckets[-1])


def tuned_tables(rows: list[dict]) -> str:
    """The sweep's winners as the two dicts to paste (one entry per M bucket and shape)."""
    from loraplex.kernels.fp8_gemm import FP8_M_BUCKETS

    w4, fp8 = {}, {}
    for r in rows:
        if "w4a16_sweep" in r:
            best = min(r["w4a16_sweep"], key=lambda c: c["ms"])
            if best["ok"]:
                w4[(BITS, _bucket(r["m"], M_BUCKETS), r["n"], r["k"])] = best["config"]
        if "fp8_sweep" in r:
            best = min(r["fp8_sweep"], key=lambda c: c["ms"])
            faster_gemm = r.get("fp8_scaled_mm_ms", math.inf) < best["ms"]
            if best["ok"] or faster_gemm:
                key = (_bucket(r["m"], FP8_M_BUCKETS), r["n"], r["k"])
                fp8[key] = "None" if faster_gemm else best["config"]
    lines = ["TUNED_CONFIGS: dict[tuple[int, int, int, int], GemmConfig] = {"]
    lines += [f"    {key}: {cfg}," for key, cfg in w4.items()]
    lines += ["}", "FP8_TUNED_CONFIGS: dict[tuple[int, int, int], Fp8DecodeConfig | None] = {"]
    lines += [f"    {key}: {cfg}," for key, cfg in fp8.items()]
    return "\n".join([*lines, "}"])


def selection_table(rows: list[dict]) -> dict[tuple[int, int, int, int], GemmConfig]:
    """The W4A16 sweep's winner per (bits, M bucket, N, K), for `write_selection_table`."""
    table = {}
    for r in rows:
        ok = [c for c in r.get("w4a16_sweep", []) if c["ok"]]
        if ok:
            best = min(ok, key=lambda c: c["ms"])
            key = (BITS, _bucket(r["m"], M_BUCKETS), r["n"], r["k"])
            table[key] = GemmConfig(*best["fields"])
    return table


def metrics_of(rows: list[dict], copy_gbps: float) -> dict[str, float]:
    """Geometric means over the shapes per M: speed-ups over bf16 and achieved bandwidth."""
    metrics: dict[str, float] = {"copy_gbps": copy_gbps}
    names = ("w4a16", "w4a16_dispatched", "w4a16_stream", "fp8", "fp8_block", "torch_int4",
             "torch_fp8")  # fmt: skip
    for m in sorted({r["m"] for r in rows}):
        for name in names:
            value = _geomean(rows, f"{name}_speedup", m)
            if not math.isnan(value):
                metrics[f"{name}_speedup_m{m}"] = value
        for name in ("bf16", "w4a16", "w4a16_dispatched", "w4a16_stream", "fp8"):
            value = _geomean(rows, f"{name}_gbps", m)
            if not math.isnan(value):
                metrics[f"{name}_gbps_m{m}"] = value
    return metrics


def summary(rows: list[dict], copy_gbps: float) -> dict:
    metrics = metrics_of(rows, copy_gbps)
    return {
        "benchmark": "quant_gemm",
        "device": torch.cuda.get_device_name(),
        "command": " ".join(["python", "-m", "benchmarks.quant_gemm", *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "baseline": "torch.nn.functional.linear in bf16 (cuBLAS), same shapes, CUDA graphs, "
        "weights rotated over copies larger than L2; PyTorch int4 = torch._weight_int4pack_mm "
        "(group 128), PyTorch FP8 = torch-ops per-token quant + torch._scaled_mm row-wise",
        "targets": TARGETS,
        "tuned_configs": tuned_tables(rows),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_quant.json"))
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config")
    parser.add_argument(
        "--sweep-w4a16", action="store_true", help="like --sweep, W4A16 only (no FP8 timed)"
    )
    parser.add_argument(
        "--table", type=Path, default=None, help="write the W4A16 winners as a selection table"
    )
    parser.add_argument("--tokens", type=str, default="", help="comma-separated token counts")
    parser.add_argument("--shapes", type=str, default="", help="e.g. 6144x4096,4096x14336 (NxK)")
    parser.add_argument("--rep-ms", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm benchmark: no CUDA device, skipped")
        return 0
    tokens = [int(m) for m in args.tokens.split(",")] if args.tokens else TOKENS
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    sweep = args.sweep or args.sweep_w4a16
    if args.table is not None and not sweep:
        parser.error("--table needs --sweep or --sweep-w4a16")
    timer, rows = Timer(args.rep_ms), []
    for n, k in shapes:
        weights = ShapeWeights(n, k)
        rows += [
            _bench_point(weights, m, timer, sweep, args.sweep, not args.sweep_w4a16) for m in tokens
        ]
        del weights
        torch.cuda.empty_cache()
        result = summary(rows, copy_gbps)  # written after each shape: a cut-off run keeps rows
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        if args.table is not None:
            args.table.parent.mkdir(parents=True, exist_ok=True)
            table = selection_table(rows)
            about = {
                **record_header("quant_gemm W4A16 selection table"),
                "metrics": {"entries": len(table)},
                "baseline": {"what": "each entry: the fastest W4A16 kernel config of its shape "
                             "in the sweep, timed beside bf16 cuBLAS in the same run"},
            }  # fmt: skip
            write_selection_table(args.table, table, about)
            print(f"wrote the W4A16 selection table {args.table}", flush=True)
    if sweep:
        print(result["tuned_configs"])
    print(json.dumps({k: round(v, 3) for k, v in result["metrics"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
