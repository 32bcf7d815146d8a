"""Benchmark records keep `metrics` flat (name -> number), as the results README promises."""

from __future__ import annotations

import json

from benchmarks import record


def test_nested_metrics_are_flattened_and_non_numbers_kept_beside(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    metrics = {
        "threads": 1,
        "greedy_b8": {"load_avg_1m": 9.5, "wall_ms": {"linears": 108.0, "step": 176.2}},
        "c1_rounds_tok_s": [4.1, 8.2],
        "graphed": True,
    }
    path = record.write_result("x.json", "bench", metrics, {"before_step_ms": 240.0})
    written = json.loads(path.read_text())
    assert written["metrics"] == {
        "threads": 1,
        "greedy_b8_load_avg_1m": 9.5,
        "greedy_b8_wall_ms_linears": 108.0,
        "greedy_b8_wall_ms_step": 176.2,
    }
    assert written["metric_details"] == {"c1_rounds_tok_s": [4.1, 8.2], "graphed": True}
    assert written["baseline"] == {"before_step_ms": 240.0}
    for key in ("benchmark", "device", "command", "commit", "date"):
        assert key in written
