"""`loraplex serve` as the user runs it (a launcher, an engine-core process, API processes), on a
free loopback port over the embedded model, for the multi-process server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common.server_launch import free_port, wait_for_health

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ServerTokenizer:
    """What tests read of `LiveServer.engine` (its tokenizer), for a server in other processes."""

    tokenizer: object


@dataclass
class ProcessServer:
    proc: subprocess.Popen
    base_url: str
    model: str
    log_path: Path
    engine: ServerTokenizer

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def pids(self) -> tuple[int, list[int]]:
        """(engine core pid, API process pids), as the launcher logged them."""
        match = re.search(r"engine core (\d+), API processes \[([\d, ]+)\]", self.log())
        assert match, self.log()
        return int(match[1]), [int(p) for p in match[2].split(",")]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def all_pids(self) -> list[int]:
        engine, api = self.pids()
        return [self.proc.pid, engine, *api]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the launcher and wait for it; kills everything left on a timeout."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            for pid in alive(self.all_pids()):
                os.kill(pid, signal.SIGKILL)


def alive(pids: list[int]) -> list[int]:
    """The pids among `pids` that still run (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def launch(
    model_dir: Path,
    log_path: Path,
    api_server_count: int,
    *extra: str,
    max_model_len: int = 512,
    num_kv_blocks: int = 512,
    api_key: str | None = None,
    port: int | None = None,
) -> ProcessServer:
    """Start `loraplex serve` and return once /health answers 200; `api_key`: a tenant's, to
    list the models with on a server that is not open; `port`: default a free one."""
    from loraplex.platform.tokenizer.tokenizer import load_tokenizer

    port = port or free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(model_dir),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", str(max_model_len),
           "--num-kv-blocks", str(num_kv_blocks), "--max-num-seqs", "64", "--host", "127.0.0.1",
           "--port", str(port), "--api-server-count", str(api_server_count),
           "--data-dir", str(log_path.parent / "data"), "--uvicorn-log-level", "warning",
           *extra]  # fmt: skip
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base_url, START_TIMEOUT_S, "the server")
    except RuntimeError as exc:
        proc.kill()
        raise RuntimeError(f"{exc}:\n{log_path.read_text()}") from None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    model = models.json()["data"][0]["id"]
    tokenizer = load_tokenizer(model_dir, 0)
    return ProcessServer(proc, base_url, model, log_path, ServerTokenizer(tokenizer))
