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


def test_the_command_reruns_a_benchmark_run_as_a_script_or_a_module(monkeypatch) -> None:
    """`python benchmarks/serving.py ...` and `python -m benchmarks.serving ...` both record
    `python -m benchmarks.serving ...` (a script's bare stem would not run)."""
    import sys
    import types

    script = str(record.Path(record.__file__).parent / "serving.py")
    monkeypatch.setattr(sys, "argv", [script, "--record", "--num-prompts", "8"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert record._module_argv() == ["benchmarks.serving", "--record", "--num-prompts", "8"]
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="benchmarks.quant_e2e")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert record._module_argv()[0] == "benchmarks.quant_e2e"
