"""Bad adapter uploads each get a 4xx, leave the registry and its files as they were, and leave
the server healthy (on the server of test_tenants.py, so no second model load); each adapter
form beyond plain LoRA (DoRA, embed_tokens and lm_head LoRA, trained token rows) uploads and serves as PEFT runs
it, and its malformed variants are refused like the others."""

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


def _weights(rank: int = 4, in_features: int = 576, out_features: int = 576, **extra) -> bytes:
    return save({
        f"{LAYER0}.lora_A.weight": torch.randn(rank, in_features),
        f"{LAYER0}.lora_B.weight": torch.randn(out_features, rank),
        **extra,
    })  # fmt: skip


VOCAB = 49152  # the embedded model's
LM_HEAD = "base_model.model.lm_head"
EMBED = "base_model.model.model.embed_tokens"


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
    "DoRA without magnitudes": ("ok", _pair(_config(use_dora=True), _weights())),
    "DoRA magnitude too short": ("ok", _pair(
        _config(use_dora=True),
        _weights(**{f"{LAYER0}.lora_magnitude_vector": torch.ones(575)}),
    )),
    "DoRA magnitude with NaN": ("ok", _pair(
        _config(use_dora=True),
        _weights(**{f"{LAYER0}.lora_magnitude_vector": torch.full((576,), float("nan"))}),
    )),
    "magnitude without use_dora": ("ok", _pair(
        _config(), _weights(**{f"{LAYER0}.lora_magnitude_vector": torch.ones(576)})
    )),
    "lm_head one row short": ("ok", _pair(
        _config(target_modules=["q_proj", "lm_head"]),
        _weights(**{f"{LM_HEAD}.lora_A.weight": torch.randn(4, 576),
                    f"{LM_HEAD}.lora_B.weight": torch.randn(VOCAB - 1, 4)}),
    )),
    "embed_tokens ranks disagree": ("ok", _pair(
        _config(target_modules=["q_proj", "embed_tokens"]),
        _weights(**{f"{EMBED}.lora_embedding_A": torch.randn(4, VOCAB),
                    f"{EMBED}.lora_embedding_B": torch.randn(576, 8)}),
    )),
    "embed_tokens not in target_modules": ("ok", _pair(
        _config(),
        _weights(**{f"{EMBED}.lora_embedding_A": torch.randn(4, VOCAB),
                    f"{EMBED}.lora_embedding_B": torch.randn(576, 4)}),
    )),
    "norm in modules_to_save": ("ok", _pair(
        _config(modules_to_save=["norm"]), _weights(**{"base_model.model.model.norm.weight":
                                                       torch.ones(576)}),
    )),
    "trained token past the vocabulary": ("ok", _pair(
        _config(trainable_token_indices=[5, VOCAB + 2]),
        _weights(**{f"{EMBED}.token_adapter.trainable_tokens_delta": torch.randn(2, 576)}),
    )),
    "trained token rows one short": ("ok", _pair(
        _config(trainable_token_indices=[5, 9, 11]),
        _weights(**{f"{EMBED}.token_adapter.trainable_tokens_delta": torch.randn(2, 576)}),
    )),
    "trained token rows the config does not list": ("ok", _pair(
        _config(),
        _weights(**{f"{EMBED}.token_adapter.trainable_tokens_delta": torch.randn(2, 576)}),
    )),
    "DoRA on lm_head": ("ok", _pair(
        _config(use_dora=True, target_modules=["lm_head"]),
        save({f"{LM_HEAD}.lora_A.weight": torch.randn(4, 576),
              f"{LM_HEAD}.lora_B.weight": torch.randn(VOCAB, 4),
              f"{LM_HEAD}.lora_magnitude_vector": torch.ones(VOCAB)}),
    )),
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


FORMS = {
    "dora": {"target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
    "lm-head": {"target_modules": ["q_proj", "lm_head"]},
    "embed": {"target_modules": ["embed_tokens", "v_proj"]},
    # the prompt's ids but its last one (PROMPT of test_tenants), tied to lm_head as PEFT ties
    "trained-tokens": {"target_modules": ["q_proj"],
                       "trainable_token_indices": [1, 504, 3458, 260, 1345, 28, 4038]},
}  # fmt: skip


def _form_adapter(base, folder, options: dict):
    """A PEFT adapter of one form for the embedded model: non-zero B, DoRA magnitudes moved off
    their initial norms, the embedding layers not saved (PEFT's `save_embedding_layers=False`;
    a full copy of the embedding would pass the upload size limit); `base` is left unchanged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, init_lora_weights=False, **options))
    with torch.no_grad():
        for module in model.modules():
            for dora in (getattr(module, "lora_magnitude_vector", None) or {}).values():
                dora.weight.mul_(0.5 + torch.rand(dora.weight.shape))
            for rows in (getattr(module, "trainable_tokens_delta", None) or {}).values():
                rows.add_(torch.randn(rows.shape))
    model.save_pretrained(str(folder), save_embedding_layers=False)
    model.unload()
    return folder


@pytest.mark.parametrize("form", FORMS)
def test_each_adapter_form_uploads_and_serves_as_peft_runs_it(world, tmp_path, form):  # noqa: F811
    from tenant_helpers import complete, peft_greedy, upload
    from test_tenants import MAX_TOKENS, PROMPT

    base, server = world["base"], world["server"]
    folder = _form_adapter(base, tmp_path / form, FORMS[form])
    client = server.client(world["keys"]["beta"])
    response = upload(client, f"form-{form}", folder)
    assert response.status_code == 201, response.text
    assert f"form-{form}" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    response = complete(client, f"form-{form}", PROMPT, MAX_TOKENS)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text == server.engine.tokenizer.decode(peft_greedy(base, folder, PROMPT, MAX_TOKENS))
    assert text != complete(client, None, PROMPT, MAX_TOKENS).json()["choices"][0]["text"]
