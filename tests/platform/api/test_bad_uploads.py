"""Bad adapter uploads each get a 4xx, leave the registry and its files as they were, and leave
the server healthy (on the server of test_tenants.py, so no second model load)."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import pytest
import torch
from safetensors.torch import save
from test_tenants import world  # noqa: F401  (the module-scoped server fixture)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
LAYER0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _config(**overrides) -> bytes:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    return json.dumps({**config, **overrides}).encode()


def _weights(rank: int = 4, in_features: int = 576, out_features: int = 576) -> bytes:
    return save({
        f"{LAYER0}.lora_A.weight": torch.randn(rank, in_features),
        f"{LAYER0}.lora_B.weight": torch.randn(out_features, rank),
    })  # fmt: skip


def _tar(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _pair(config: bytes, weights: bytes) -> list[tuple[str, bytes]]:
    return [(CONFIG, config), (WEIGHTS, weights)]


CASES = {
    "pickle .bin": ("ok", [(CONFIG, _config()), ("adapter_model.bin", b"\x80\x04\x95garbage.")]),
    "truncated safetensors": ("ok", _pair(_config(), _weights()[:-100])),
    "oversized safetensors": ("ok", _pair(_config(), _weights() + b"\0" * 8_100_000)),
    "wrong shapes": ("ok", _pair(_config(), _weights(in_features=575))),
    "rank over the maximum": ("ok", _pair(_config(r=80), _weights(rank=80))),
    "unsupported modules": ("ok", _pair(_config(target_modules=["lm_head"]), _weights())),
    "name with /": ("a/b", _pair(_config(), _weights())),
    "name with ..": ("a..b", _pair(_config(), _weights())),
    "name with NUL": ("a\x00b", _pair(_config(), _weights())),
    "missing config": ("ok", [(WEIGHTS, _weights())]),
    "different base model": ("ok", _pair(_config(), _weights(in_features=64, out_features=64))),
    "other architecture": (
        "ok", _pair(_config(auto_mapping={"base_model_class": "GPT2LMHeadModel"}), _weights())
    ),
    "tar escaping its folder": (
        "ok", [("a.tar.gz", _tar({f"../{CONFIG}": _config(), f"../{WEIGHTS}": _weights()}))]
    ),
    "zip with absolute paths": (
        "ok", [("a.zip", _zip({f"/x/{CONFIG}": _config(), f"/x/{WEIGHTS}": _weights()}))]
    ),
    "no files": ("ok", []),
}  # fmt: skip


def _state(world):  # noqa: F811
    data = world["data_dir"]
    return (
        sorted(p.name for p in (data / "adapters").iterdir()),
        list((data / "tmp").iterdir()),
        world["server"].client(world["keys"]["beta"]).get("/v1/adapters").json(),
    )


@pytest.mark.parametrize("case", CASES)
def test_bad_upload_is_refused_and_changes_nothing(world, case):  # noqa: F811
    name, files = CASES[case]
    client = world["server"].client(world["keys"]["beta"])
    before = _state(world)
    response = client.post(
        "/v1/adapters", data={"name": name}, files=[("files", f) for f in files] or None
    )
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["message"]
    assert _state(world) == before
    assert client.get("/health").status_code == 200


def test_a_good_archive_upload_works(world):  # noqa: F811
    folder = world["folders"]["beta"]
    members = {f"adapter/{n}": (folder / n).read_bytes() for n in (CONFIG, WEIGHTS)}
    client = world["server"].client(world["keys"]["beta"])
    response = client.post(
        "/v1/adapters", data={"name": "zipped"}, files=[("files", ("a.zip", _zip(members)))]
    )
    assert response.status_code == 201, response.text
    assert client.delete("/v1/adapters/zipped").status_code == 200
