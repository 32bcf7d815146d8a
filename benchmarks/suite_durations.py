"""Where `make test`'s wall time goes: the suite as `make test` runs it (two xdist workers, whole
modules per worker), timed, with each module's seconds (its tests' setup, call and teardown, as
pytest's JUnit report counts them) and the slowest tests.

    python -m benchmarks.suite_durations
    # writes benchmarks/results/cpu_suite_durations.json

CI (`.ci/run`) fails the suite past 1,200 s on its 2 cores; this is the record to cut from. A
module's seconds move with the host's other load: compare modules within one run. `--baseline`
names an earlier record of this benchmark whose figures are kept beside the new ones (another
run, so only its order of modules compares, not its seconds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks.record import RESULTS, write_result

REPO = Path(__file__).resolve().parents[1]


def durations(junit: Path) -> tuple[Counter, list[tuple[float, str]]]:
    """(seconds per module path, [(seconds, test id)]) from a JUnit report."""
    modules: Counter = Counter()
    tests = []
    for case in ET.parse(junit).iter("testcase"):
        seconds = float(case.get("time", 0.0))
        parts = case.get("classname", "").split(".")
        if len(parts) > 1 and parts[-1].startswith("Test"):  # a test class's method
            parts.pop()
        module = "/".join(parts) + ".py"
        modules[module] += seconds
        tests.append((seconds, f"{module}::{case.get('name')}"))
    return modules, sorted(tests, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="xdist workers (make test's 2)")
    parser.add_argument("--top", type=int, default=25, help="modules and tests to record")
    parser.add_argument("--baseline", default="", help="an earlier record to keep beside")
    parser.add_argument("--out", default="cpu_suite_durations.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadfile",
             "-p", "no:cacheprovider", f"--junitxml={junit}"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.monotonic() - start
        modules, tests = durations(junit)
    lines = run.stdout.strip().splitlines()
    print("\n".join(lines[-40:]))  # failures' summary, the wall-time line, pytest's last line
    summary = lines[-1] if lines else ""
    metrics = {
        "wall_s": wall,
        "test_seconds_total": sum(modules.values()),
        "exit_code": run.returncode,
        "module_s": {m.removeprefix("tests/"): s for m, s in modules.most_common(args.top)},
    }
    baseline = {}
    if args.baseline:
        before = json.loads((RESULTS / args.baseline).read_text())
        baseline = {"commit": before["commit"], **before["metrics"]}
    write_result(
        args.out, "suite_durations", metrics, baseline,
        workload={"workers": args.workers, "dist": "loadfile", "summary": summary},
        metric_details={"slowest_tests": [[round(s, 1), t] for s, t in tests[: args.top]]},
    )  # fmt: skip


if __name__ == "__main__":
    main()
