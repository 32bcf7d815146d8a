"""One adapter registry for all replicas: a folder every replica mounts (file://) and an
S3-compatible object store (s3://, against moto's real HTTP S3 server on loopback). An adapter
committed through one replica is served by another; a replica killed with SIGKILL mid-upload
leaves no torn adapter visible from the other. An adapter's own tokenizer is stored and fetched
with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.adapters.blob_store import ADAPTER_FILES, STORED_FILES
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_format import content_digest, load_peft_adapter
from loraplex.adapters.registry import AdapterRegistry, open_registry
from tests.waiting import wait_until

BUCKET = "loraplex-registry"
_S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

_CHILD = r"""
import sys, time
from pathlib import Path
from loraplex.adapters import blob_store
from loraplex.adapters.registry import open_registry
from loraplex.adapters.peft_format import BaseModelSpec, load_peft_adapter
sys.path.insert(0, sys.argv[6])
from lora_fixtures import HF_CONFIG
url, data, src, phase, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5])

def pause(*args, **kwargs):
    marker.write_text("paused")
    time.sleep(60)  # paused until the test kills it (kill -9 mid-upload is what is tested)

registry = open_registry(url, data)
staging = registry.new_staging_dir()
for name in ("adapter_config.json", "adapter_model.safetensors"):
    (staging / name).write_bytes((src / name).read_bytes())
weights = load_peft_adapter(staging, BaseModelSpec.from_hf_config(HF_CONFIG), 64)
if phase == "files" and url.startswith("file:"):
    blob_store.fsync_files = pause  # staged in the shared folder, not yet renamed into place
elif phase == "files":
    client, upload = registry.store.client, registry.store.client.upload_file
    calls = []
    def upload_one_then_pause(*args, **kwargs):
        if calls:
            pause()
        calls.append(args)
        return upload(*args, **kwargs)
    client.upload_file = upload_one_then_pause  # the config is up, the weights are not
else:
    registry.catalog.put = pause  # the files are stored whole, the catalogue row is not
registry.commit("t", "support", staging, weights)
"""


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free loopback port, with one bucket."""
    boto3 = pytest.importorskip("boto3")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    boto3.client("s3", endpoint_url=endpoint, **_client_env()).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def _client_env() -> dict[str, str]:
    return {"aws_access_key_id": "test", "aws_secret_access_key": "test",
            "region_name": "us-east-1"}  # fmt: skip


@pytest.fixture(params=["file", "s3"])
def shared_url(request, tmp_path, monkeypatch):
    """The URL of a fresh shared registry (a new prefix in the bucket for s3)."""
    if request.param == "file":
        return f"file://{tmp_path / 'shared'}"
    endpoint = request.getfixturevalue("s3_endpoint")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    for key, value in _S3_ENV.items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/{tmp_path.name}"


def _commit(registry: AdapterRegistry, folder: Path, spec, name: str = "support"):
    staging = registry.new_staging_dir()
    for f in ADAPTER_FILES:
        (staging / f).write_bytes((folder / f).read_bytes())
    return registry.commit("t", name, staging, load_peft_adapter(staging, spec, 64))


def test_an_adapter_committed_on_one_replica_is_served_by_the_other(
    shared_url, tmp_path, make_adapter, spec
):
    replica_a = open_registry(shared_url, tmp_path / "a")
    replica_b = open_registry(shared_url, tmp_path / "b")
    folder = make_adapter("one", seed=1)
    record, old = _commit(replica_a, folder, spec)
    assert old is None and replica_a.shared and replica_b.shared
    seen = replica_b.get("t", "support")
    assert seen is not None and seen.digest == record.digest and seen.rank == record.rank
    local = replica_b.materialize(seen)
    assert str(local) == seen.path
    for f in ADAPTER_FILES:
        assert (local / f).read_bytes() == (folder / f).read_bytes()
    assert [r.name for r in replica_b.list("t")] == ["support"]
    # a replacement through B is what A serves next; a deletion through A is seen by B
    newer, replaced = _commit(replica_b, make_adapter("two", seed=2), spec)
    assert replaced is not None and replaced.digest == record.digest
    assert replica_a.get("t", "support").digest == newer.digest
    assert replica_a.delete("t", "support") is not None
    assert replica_b.get("t", "support") is None and replica_b.list() == []


@pytest.mark.parametrize("phase", ["files", "stored"])
def test_kill_9_mid_upload_leaves_no_torn_adapter_on_the_other_replica(
    shared_url, tmp_path, make_adapter, spec, phase
):
    survivor = open_registry(shared_url, tmp_path / "survivor")
    old, _ = _commit(survivor, make_adapter("old", seed=1), spec)
    new_folder = make_adapter("new", seed=2)
    new_digest = load_peft_adapter(new_folder, spec, 64).digest
    marker = tmp_path / "marker"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, shared_url, str(tmp_path / "killed"), str(new_folder),
         phase, str(marker), str(Path(__file__).parent)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    wait_until(lambda: marker.exists() or child.poll() is not None, 90, "the child to pause")
    assert child.poll() is None, "the child exited instead of pausing"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    for view in (survivor, open_registry(shared_url, tmp_path / "restarted")):
        record = view.get("t", "support")
        assert record is not None and record.digest == old.digest  # the old row, untouched
        assert load_peft_adapter(view.materialize(record), spec, 64).digest == old.digest
        assert [r.digest for r in view.list()] == [old.digest]
        if phase == "files":  # nothing of the cut-short upload is visible under its digest
            assert new_digest not in view.store.digests()
            with pytest.raises(FileNotFoundError):
                view.store.materialize(new_digest)
    # the survivor uploads the same adapter: whole and served
    record, replaced = _commit(survivor, new_folder, spec)
    assert replaced is not None and record.digest == new_digest
    assert load_peft_adapter(survivor.materialize(record), spec, 64).digest == new_digest


def _word_tokenizer(size: int) -> bytes:
    """A tokenizer.json of `size` whole-word tokens, ids 0..size-1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str().encode()


def test_an_adapters_own_tokenizer_travels_with_it_to_the_other_replica(
    shared_url, tmp_path, make_adapter, spec
):
    folder = make_adapter("with-tokenizer", seed=3)
    (folder / "tokenizer.json").write_bytes(_word_tokenizer(spec.vocab_size))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "w1"}')
    replica_a = open_registry(shared_url, tmp_path / "a")
    replica_b = open_registry(shared_url, tmp_path / "b")
    staging = replica_a.new_staging_dir()
    for f in STORED_FILES:
        if (folder / f).is_file():
            (staging / f).write_bytes((folder / f).read_bytes())
    weights = load_peft_adapter(staging, spec, 64)
    plain = content_digest(*((folder / f).read_bytes() for f in ADAPTER_FILES))
    assert weights.digest != plain  # the digest covers the tokenizer
    record, _ = replica_a.commit("t", "support", staging, weights)
    local = replica_b.materialize(replica_b.get("t", "support"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (local / f).read_bytes() == (folder / f).read_bytes()
    assert load_peft_adapter(local, spec, 64).digest == record.digest
    (folder / "tokenizer.json").write_bytes(_word_tokenizer(spec.vocab_size + 1))
    with pytest.raises(AdapterValidationError, match="embedding rows"):
        load_peft_adapter(folder, spec, 64)  # an id past the base model's rows
