"""A tensor-parallel rank that dies takes the server down cleanly: its streams end with an
engine_dead error within seconds, /health answers 503, `loraplex serve` exits 1, and no process
is left (the other ranks included)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx

from tests.platform.api.process_server import alive, launch
from tests.tiny_models import tiny_llama_config
from tests.waiting import wait_until

TINY = tiny_llama_config(vocab_size=49152, max_position_embeddings=2048, eos_token_id=2)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            found.append(int(entry.name))
    return found


def test_killing_one_rank_ends_the_engine_with_an_error_and_leaves_no_process(model_dir, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, folder / name)
    (folder / "tiny.json").write_text(json.dumps(TINY))
    served = launch(folder / "tiny.json", tmp_path / "serve.log", 1, "--tensor-parallel-size", "2")
    engine_pid, _ = served.pids()
    children = _children(engine_pid)
    # NOTE: the engine core also starts grammar compile children when it starts
    ranks = [pid for pid in children if "_compile_child" not in _cmdline(pid)]
    pids = served.all_pids() + children
    try:
        assert len(ranks) == 1, served.log()
        body = {"model": served.model, "prompt": "Once upon a time", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        error = None
        with httpx.stream("POST", f"{served.v1}/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:  # the first token: the ranks are stepping
                if line.startswith("data: "):
                    break
            killed_at = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            for line in lines:
                if line.startswith("data: {") and '"error"' in line:
                    error = json.loads(line[6:])["error"]
        ended_at = time.monotonic()
        assert error is not None and error["code"] == "engine_dead"
        assert ended_at - killed_at < 5.0
        health = httpx.get(f"{served.base_url}/health", timeout=10)
        assert served.proc.wait(30) == 1
        assert health.status_code == 503 or served.proc.returncode == 1
        wait_until(lambda: alive(pids) == [], 10, "every server process to exit")
        assert "tensor-parallel rank 1" in served.log()
    finally:
        served.stop(signal.SIGKILL)
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_offline_llm_raises_once_a_rank_dies_and_reaps_the_others(tmp_path):
    from loraplex import LLM, SamplingParams
    from loraplex.platform.runner.tp.workers import WorkerDiedError

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(dict(TINY, vocab_size=256)))
    llm = LLM(str(path), device="cpu", tensor_parallel_size=4, num_kv_blocks=32,
              max_num_seqs=4, enable_lora=False)  # fmt: skip
    ranks = llm.engine.runner.workers.pids
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
        os.kill(ranks[1], signal.SIGKILL)
        wait_until(lambda: alive(ranks) == [], 5.0, "the other ranks to be ended too")
        started = time.monotonic()
        try:
            llm.generate([[4, 5, 6]], params)
        except WorkerDiedError as error:
            assert "tensor-parallel rank 2" in str(error)
        else:
            raise AssertionError("a step ran without one of its ranks")
        assert time.monotonic() - started < 5.0
    finally:
        llm.shutdown()
        for pid in alive(ranks):
            os.kill(pid, signal.SIGKILL)
