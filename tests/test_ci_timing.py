"""The CI bound on the suite's wall time (tests/conftest.py, set by `.ci/run`): the run prints
its wall time against the bound, fails when over it, and pytest's summary line stays last."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST_TEST = "tests/test_config.py::test_options_land_in_their_parts"


def _pytest(budget_s: str, *args: str) -> tuple[int, list[str]]:
    # NOTE: without the outer run's xdist variables, or the inner run would take itself for a
    # worker and stay silent.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["LORAPLEX_TEST_WALL_BUDGET_S"] = budget_s
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, FAST_TEST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout.strip().splitlines()


def test_a_run_over_the_bound_fails_and_keeps_pytests_summary_last():
    code, lines = _pytest("0")
    assert code == 1, lines
    assert re.fullmatch(
        r"test wall time: \d+ s \(bound 0 s, xdist workers: 0\) -- OVER THE BOUND", lines[-2]
    ), lines
    assert re.fullmatch(r"1 passed in [\d.]+s( \(.*\))?", lines[-1]), lines


def test_a_run_within_the_bound_passes_and_says_its_wall_time_once_under_xdist():
    code, lines = _pytest("600", "-n", "1")
    assert code == 0, lines
    timing = [line for line in lines if line.startswith("test wall time:")]
    assert len(timing) == 1 and re.fullmatch(
        r"test wall time: \d+ s \(bound 600 s, xdist workers: 1\)", timing[0]
    ), lines
    assert lines.index(timing[0]) == len(lines) - 2
    assert re.fullmatch(r"1 passed in [\d.]+s( \(.*\))?", lines[-1]), lines
