"""`loraplex serve` as a benchmark's subprocess: a free loopback port, the launch, the wait for
/health, and the serve flags for LLM keyword options. Used by the serving benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

# NOTE: the repository root, where `python -m loraplex.cli` imports this checkout's loraplex
# (not whichever one the environment has installed)
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server(
    extra_args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`loraplex serve` on a free loopback port (`env`: its environment, default ours); returns
    once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", *extra_args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    base_url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base_url, 300, "the server")
    return proc, base_url


def wait_for_health(proc: subprocess.Popen, base_url: str, timeout_s: float, name: str) -> None:
    """Return once `base_url`/health answers 200; raise if `proc` exits or `timeout_s` passes
    (then `proc` is terminated)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"{name} did not start within {timeout_s:g} s")


def serve_flags(options: dict) -> list[str]:
    """`loraplex serve` flags for LLM keyword options (`enable_lora=False` -> --no-enable-lora)."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags
