"""The adapter registry: catalogue + content-addressed files that survive restarts, and a
kill -9 at any point of an upload leaves the old state or the complete new adapter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterValidationError,
    load_peft_adapter,
)
from loraplex.adapters.registry import AdapterRegistry
from tests.waiting import wait_until

_CHILD = r"""
import shutil, sys, time
from pathlib import Path
from loraplex.adapters import blob_store, registry as reg
from loraplex.adapters.peft_format import BaseModelSpec, load_peft_adapter
sys.path.insert(0, sys.argv[5])
from lora_fixtures import HF_CONFIG
data, src, phase, marker = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])

def pause():
    marker.write_text("paused")
    time.sleep(60)  # paused until the test kills it (kill -9 mid-upload is what is tested)

registry = reg.AdapterRegistry(data)
staging = registry.new_staging_dir()
shutil.copyfile(src / "adapter_config.json", staging / "adapter_config.json")
weights_bytes = (src / "adapter_model.safetensors").read_bytes()
if phase == "staging":
    (staging / "adapter_model.safetensors").write_bytes(weights_bytes[: len(weights_bytes) // 2])
    pause()
(staging / "adapter_model.safetensors").write_bytes(weights_bytes)
weights = load_peft_adapter(staging, BaseModelSpec.from_hf_config(HF_CONFIG), 64)
if phase == "renamed":
    blob_store._fsync_dir = lambda path: pause()
registry.commit("t", "support", staging, weights)
if phase == "committed":
    pause()
"""


def _commit(registry: AdapterRegistry, folder: Path, spec, name: str = "support"):
    staging = registry.new_staging_dir()
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        (staging / f).write_bytes((folder / f).read_bytes())
    return registry.commit("t", name, staging, load_peft_adapter(staging, spec, 64))


def test_records_survive_reopening_byte_identical(tmp_path, make_adapter, spec):
    folder = make_adapter("a")
    registry = AdapterRegistry(tmp_path / "data")
    record, old = _commit(registry, folder, spec)
    assert old is None and record.rank == 4 and record.engine_name.startswith("t/support@")
    registry.close()
    reopened = AdapterRegistry(tmp_path / "data")
    assert reopened.get("t", "support") == record
    assert reopened.get("other", "support") is None
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        assert (Path(record.path) / f).read_bytes() == (folder / f).read_bytes()


def test_replacing_keeps_old_files_until_reopened(tmp_path, make_adapter, spec):
    registry = AdapterRegistry(tmp_path / "data")
    old, _ = _commit(registry, make_adapter("a", seed=1), spec)
    new, replaced = _commit(registry, make_adapter("b", seed=2), spec)
    assert replaced == old and new.digest != old.digest
    assert Path(old.path).is_dir()  # a request still running on it may reload it
    registry.close()
    AdapterRegistry(tmp_path / "data")
    assert not Path(old.path).exists() and Path(new.path).is_dir()


@pytest.mark.parametrize("phase", ["staging", "renamed", "committed"])
def test_kill_9_mid_upload_leaves_old_or_complete_new(tmp_path, make_adapter, spec, phase):
    data = tmp_path / "data"
    registry = AdapterRegistry(data)
    old, _ = _commit(registry, make_adapter("old", seed=1), spec)
    registry.close()
    new_folder = make_adapter("new", seed=2)
    marker = tmp_path / "marker"
    tests_dir = str(Path(__file__).parent)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(data), str(new_folder), phase, str(marker), tests_dir],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    wait_until(lambda: marker.exists() or child.poll() is not None, 60, "the child to pause")
    assert child.poll() is None, "the child exited instead of pausing"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    recovered = AdapterRegistry(data)
    record = recovered.get("t", "support")
    new_digest = load_peft_adapter(new_folder, spec, 64).digest
    expected = new_digest if phase == "committed" else old.digest
    assert record is not None and record.digest == expected
    weights = load_peft_adapter(record.path, spec, 64)  # complete and valid
    assert weights.digest == expected
    assert list(recovered.tmp.iterdir()) == []
    assert sorted(p.name for p in recovered.blobs.iterdir()) == [expected]


def test_uploading_the_same_content_again_repairs_damaged_files(tmp_path, make_adapter, spec):
    folder = make_adapter("a")
    registry = AdapterRegistry(tmp_path / "data")
    record, _ = _commit(registry, folder, spec)
    stored = Path(record.path) / WEIGHTS_FILE
    stored.write_bytes(stored.read_bytes()[:-4] + b"\x00\x00\xc0\x7f")  # a NaN: damaged on disk
    with pytest.raises(AdapterValidationError, match="NaN"):
        load_peft_adapter(record.path, spec, 64)
    again, _ = _commit(registry, folder, spec)
    assert again.path == record.path and again.digest == record.digest
    assert stored.read_bytes() == (folder / WEIGHTS_FILE).read_bytes()
    assert load_peft_adapter(record.path, spec, 64).digest == record.digest
    assert list(registry.tmp.iterdir()) == []  # the damaged copy is gone
    registry.close()
