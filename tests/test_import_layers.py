"""The import contracts of pyproject.toml hold (import-linter): parts import downwards, the core
and the kernels import nothing above them, grammar knows no engine, the scheduler no device, and
the API no runner. An upward import fails here with import-linter's chain of imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is missing: install the dev extra (`make setup`)"
    return found


def test_import_contracts_hold() -> None:
    # NOTE: no cache, so concurrent test workers never share one.
    done = subprocess.run(
        [_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " kept, 0 broken." in done.stdout
