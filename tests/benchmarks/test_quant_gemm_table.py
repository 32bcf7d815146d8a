"""The W4A16 sweep's selection table: the fastest checked launch per (M bucket, N, K) becomes
the entry the runtime dispatches from; the metrics put each kind beside the winner."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from benchmarks.common.quant_gemm_candidates import compile_keys, w4a16_candidates
from benchmarks.quant_gemm import metrics_of, selection_table
from loraplex.kernels.w4a16.dispatch import read_selection_table, write_selection_table
from loraplex.kernels.w4a16.types import W4A16Config

DECODE = W4A16Config("mma", 16, 128, 8, 4, 3)
WIDE = W4A16Config("mma", 16, 256, 4, 8, 3)
WRONG = W4A16Config("mma", 16, 64, 4, 4, 4)


def _entry(config: W4A16Config, ms: float, ok: bool = True) -> dict:
    return {"fields": list(astuple(config)), "ms": ms, "ok": ok, "dispatched": False}


def _row(m: int, sweep: list[dict]) -> dict:
    return {"n": 6144, "k": 4096, "m": m, "w4a16_sweep": sweep, "w4a16_speedup": 1.5,
            "w4a16_mma_speedup": 1.5, "w4a16_dequant_speedup": 0.5, "w4a16_gbps": 1000.0,
            "bf16_gbps": 3000.0}  # fmt: skip


def test_fastest_checked_config_per_bucket_is_written_and_read_back(tmp_path) -> None:
    rows = [
        # A failed check never wins, however fast it looked.
        _row(1, [_entry(DECODE, 0.012), _entry(WIDE, 0.008), _entry(WRONG, 0.001, ok=False)]),
        _row(3, [_entry(DECODE, 0.010), _entry(WIDE, 0.011)]),  # M 3 -> bucket 4
    ]
    table = selection_table(rows)
    assert table == {(4, 1, 6144, 4096): WIDE, (4, 4, 6144, 4096): DECODE}
    path = tmp_path / "table.json"
    write_selection_table(path, table)
    assert read_selection_table(path) == table


def test_metrics_report_each_kind_and_the_copy_fraction() -> None:
    metrics = metrics_of([_row(1, [])], copy_gbps=4000.0)
    assert metrics["w4a16_speedup_m1"] == 1.5
    assert metrics["w4a16_dequant_speedup_m1"] == 0.5
    assert metrics["w4a16_copy_fraction_m1"] == pytest.approx(0.25)
    assert "w4a16_dispatched_speedup_m1" not in metrics  # not measured: no figure


def test_candidates_split_less_as_tokens_grow_and_share_compiled_kernels() -> None:
    decode = w4a16_candidates(1, 4096, 4096, 132)
    prefill = w4a16_candidates(4096, 4096, 4096, 132)
    assert max(c.split_k for c in decode) > 1 and {c.split_k for c in prefill} == {1}
    assert "dequant" in {c.kind for c in prefill} and "dequant" not in {c.kind for c in decode}
    keys = compile_keys(decode)
    assert len(keys) < len(decode) and {c.split_k for c in keys} == {1}


def test_the_shipped_h200_table_is_what_the_runtime_dispatches_by_default() -> None:
    """The committed sweep table reads back (its run's record fields beside the entries), and
    `TUNED_CONFIGS` holds each of its winners: serving without the table file dispatches what
    the H200 sweep measured."""
    from pathlib import Path

    from loraplex.kernels.w4a16.dispatch import TUNED_CONFIGS

    path = Path(__file__).parents[2] / "benchmarks/results/h200_w4a16_table.json"
    table = read_selection_table(path)
    assert len(table) == 32
    assert all(TUNED_CONFIGS[key] == config for key, config in table.items())
