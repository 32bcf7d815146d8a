"""The W4A16 sweep's selection table: the fastest checked config per (M bucket, N, K) becomes
the entry the runtime dispatches from, and the metrics put the stream kernel beside the rest."""

from __future__ import annotations

from dataclasses import astuple

from benchmarks.quant_gemm import metrics_of, selection_table
from loraplex.kernels.quant_gemm_configs import (
    GemmConfig,
    read_selection_table,
    write_selection_table,
)

FMA = GemmConfig("fma", 1, 256, 64, 16, 4, 3)
STREAM = GemmConfig("stream", 16, 128, 128, 0, 8, 4)
WRONG = GemmConfig("stream", 16, 256, 128, 0, 8, 3)


def _entry(config: GemmConfig, ms: float, ok: bool = True) -> dict:
    return {"config": repr(config), "fields": list(astuple(config)), "ms": ms, "ok": ok}


def _row(m: int, sweep: list[dict]) -> dict:
    return {"n": 6144, "k": 4096, "m": m, "w4a16_sweep": sweep, "w4a16_speedup": 1.5,
            "w4a16_stream_speedup": 2.0, "w4a16_gbps": 1000.0, "bf16_gbps": 3000.0}  # fmt: skip


def test_fastest_checked_config_per_bucket_is_written_and_read_back(tmp_path) -> None:
    rows = [
        # A failed check never wins, however fast it looked.
        _row(1, [_entry(FMA, 0.012), _entry(STREAM, 0.008), _entry(WRONG, 0.001, ok=False)]),
        _row(3, [_entry(FMA, 0.010), _entry(STREAM, 0.011)]),  # M 3 -> bucket 4
    ]
    table = selection_table(rows)
    assert table == {(4, 1, 6144, 4096): STREAM, (4, 4, 6144, 4096): FMA}
    path = tmp_path / "table.json"
    write_selection_table(path, table)
    assert read_selection_table(path) == table


def test_metrics_report_the_stream_kernel_beside_the_winner() -> None:
    metrics = metrics_of([_row(1, [])], copy_gbps=4000.0)
    assert metrics["w4a16_speedup_m1"] == 1.5
    assert metrics["w4a16_stream_speedup_m1"] == 2.0
    assert "w4a16_dispatched_speedup_m1" not in metrics  # not measured: no figure


def test_the_shipped_h200_table_is_what_the_runtime_dispatches_by_default() -> None:
    """The committed sweep table reads back (its run's record fields beside the entries), and
    `TUNED_CONFIGS` holds each of its winners: serving without the table file dispatches what
    the H200 sweep measured."""
    from pathlib import Path

    from loraplex.kernels.quant_gemm_configs import TUNED_CONFIGS

    path = Path(__file__).parents[2] / "benchmarks/results/h200_w4a16_table.json"
    table = read_selection_table(path)
    assert len(table) == 16
    assert all(TUNED_CONFIGS[key] == config for key, config in table.items())
