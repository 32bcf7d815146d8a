"""quant_e2e's record: every quantized model's ratios to bf16, greedy, t1 and the mixed batch
side by side."""

from __future__ import annotations

import pytest

from benchmarks.quant_e2e import ModelFigures, metrics_vs_bf16


def _figures(tpot: float, tok_s: float | None) -> ModelFigures:
    return ModelFigures(
        tpot_bs1_ms=tpot, gpu_decode_step_bs1_ms=tpot - 0.05, throughput_out_tok_s=tok_s,
        t1_tpot_bs1_ms=tpot * 1.1, t1_throughput_out_tok_s=tok_s and tok_s * 0.9,
        mixed_throughput_out_tok_s=tok_s and tok_s * 0.8, weight_gb=1.0, engine_start_s=1.0,
    )  # fmt: skip


def test_ratios_cover_greedy_t1_and_mixed() -> None:
    metrics = metrics_vs_bf16({"bf16": _figures(4.0, 4000.0), "awq": _figures(2.0, 5000.0)})
    assert metrics["awq_tpot_ratio"] == pytest.approx(0.5)
    assert metrics["awq_tpot_ratio_t1"] == pytest.approx(0.5)
    for suffix in ("", "_t1", "_mixed"):
        assert metrics[f"awq_throughput_ratio{suffix}"] == pytest.approx(1.25)
    assert metrics["bf16_mixed_throughput_out_tok_s"] == pytest.approx(3200.0)
    assert "bf16_tpot_ratio" not in metrics


def test_decode_only_run_has_no_throughput_ratios() -> None:
    metrics = metrics_vs_bf16({"bf16": _figures(4.0, None), "awq": _figures(3.0, None)})
    assert metrics["awq_tpot_ratio"] == pytest.approx(0.75)
    assert not [key for key in metrics if "throughput" in key]
