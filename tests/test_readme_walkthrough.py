"""The README's walkthrough runs as written: the shell and Python blocks of its quick start, HTTP
API, tool-calling / Responses and own-adapter sections, in order, against a server started as
the README says (the command `make serve` runs, with the environment its `make serve` blocks
set), waited for by the line the README names. Each block must exit 0, and no curl may print an
error body."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.common.server_launch import free_port
from loraplex.entrypoints.launcher import ready_line

_TOOLS = ("make", "curl", "jq", "bash")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(tool) is None for tool in _TOOLS),
        reason=f"the README's walkthrough runs {', '.join(_TOOLS)}, not all installed here",
    ),
]

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SECTIONS = ("Quick start", "The HTTP API", "Tool calling and the Responses API",
            "A LoRA adapter of your own")  # fmt: skip
README_URL = "127.0.0.1:8000"
START_TIMEOUT_S = 240.0
BLOCK_TIMEOUT_S = 240.0
_BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_SERVER_START = re.compile(r"^((?:[A-Z_]+=\S+ )*)make serve$")


def _blocks() -> list[tuple[str, str]]:
    """(language, code) of the walkthrough sections' blocks, in README order."""
    text = README.read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    chosen = [s for s in sections if s.split("\n", 1)[0].strip() in SECTIONS]
    assert len(chosen) == len(SECTIONS), "a walkthrough section was renamed"
    return [(m[1], m[2]) for section in chosen for m in _BLOCK.finditer(section)]


def _serve_command(port: int) -> list[str]:
    """The command `make serve` runs (`make -n` prints it without running anything), as the
    interpreter running these tests runs it (this checkout's loraplex)."""
    out = subprocess.run(
        ["make", "-n", "serve", "HOST=127.0.0.1", f"PORT={port}"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines = out.replace("\\\n", " ").splitlines()
    (serve,) = [line for line in lines if re.search(r"\bloraplex serve\b", line)]
    argv = shlex.split(serve)
    assert argv[0].endswith("loraplex") and argv[1] == "serve", serve
    return [sys.executable, "-m", "loraplex.cli", *argv[1:]]


def _run(language: str, code: str, workdir: Path, env: dict[str, str], index: int):
    if language == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        script = workdir / f"block_{index}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    return subprocess.run(
        argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    blocks = _blocks()
    starts = [code.strip() for lang, code in blocks if lang == "bash" and
              all(_SERVER_START.match(line) for line in code.strip().splitlines())]  # fmt: skip
    assert starts and starts[0] == "make serve"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLEX_DATA_DIR": str(tmp_path / "data")}
    for start in starts:  # e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING=True make serve
        for assignment in shlex.split(_SERVER_START.match(start)[1]):
            name, value = assignment.split("=", 1)
            env[name] = value
    port = free_port()
    ready = ready_line("127.0.0.1", 8000)
    assert f"`{ready}`" in README.read_text().replace("\n", " ")  # the line the README names
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            _serve_command(port), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready_line("127.0.0.1", port) not in log_path.read_text():
            assert server.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        workdir = tmp_path / "work"
        workdir.mkdir()
        outputs = []
        for index, (language, code) in enumerate(blocks):
            if code.strip() in starts:
                continue
            code = code.replace(README_URL, f"127.0.0.1:{port}")
            done = _run(language, code, workdir, env, index)
            report = f"{language} block {index}:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            assert done.returncode == 0, report
            assert '"error":' not in done.stdout, report
            outputs.append(done.stdout)
        compared = [o for o in outputs if o.startswith("SmolLM2-135M-Instruct: ")]
        (lines,) = [o.splitlines() for o in compared]
        base, adapter = (line.split(": ", 1)[1] for line in lines)
        assert lines[1].startswith("my-adapter: ") and base != adapter  # a visible change
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        queued = re.search(r"^vllm:request_queue_time_seconds_count\{[^}]*\} (\S+)$", metrics,
                           re.MULTILINE)  # fmt: skip
        assert queued and float(queued[1]) >= len(outputs)  # timings crossed the process IPC
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
