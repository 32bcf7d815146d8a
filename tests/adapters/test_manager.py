"""LoRAManager: one registration path and the keys it gives (prefix caching's identity), the
slots requests take and the batch that applies them, failures read on the loader thread, and
digests checked on load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_fixtures import (
    HF_CONFIG,
    finish_reads,
    make_peft_adapter,
    registered_adapters,
    tiny_llama,
)
from random_adapters import add_command
from test_lora_layer import TinyProjections, our_delta, peft_delta

from loraplex.adapters.errors import AdapterLoadError, AdapterNotFoundError
from loraplex.adapters.lora_layer import attach_lora_layers
from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.peft_format import AdapterValidationError, BaseModelSpec
from loraplex.adapters.request import LoRARequest
from loraplex.config import LoRAConfig
from loraplex.platform.core.commands import AddAdapter
from loraplex.platform.runner.lora_slots import LoRASlotWriter


@pytest.fixture
def manager_and_model():
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    model = TinyProjections(tiny_llama())
    state = attach_lora_layers(model, config, "cpu", torch.float32, max_num_tokens=32)
    manager = LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)
    yield manager, model, LoRASlotWriter(state.meta, torch.device("cpu"))
    manager.shutdown()


def test_keys_identify_adapter_contents(manager_and_model, tmp_path):
    manager, *_ = manager_and_model
    a = make_peft_adapter(tmp_path / "a", seed=1)
    b = make_peft_adapter(tmp_path / "b", seed=2)
    key_a = manager.adapter_key(LoRARequest("alpha", str(a)))
    key_b = manager.adapter_key(LoRARequest("beta", str(b)))
    assert key_a != key_b and manager.adapter_key(None) is None
    assert manager.adapter_key(LoRARequest("alpha", str(a))) == key_a
    make_peft_adapter(a, seed=3)  # replaced in place under the same name
    key_a2 = manager.adapter_key(LoRARequest("alpha", str(a)))
    assert key_a2 not in (key_a, key_b)
    assert registered_adapters(manager) == {"alpha": key_a2, "beta": key_b}


REGISTRATIONS = {
    "by path": lambda name, folder: LoRARequest(name, str(folder)),
    "by command": lambda name, folder: AddAdapter(name, str(folder)),
    "by command with its digest": lambda name, folder: add_command(name, folder),
}


def _register(manager: LoRAManager, how: str, name: str, folder) -> str:
    registration = REGISTRATIONS[how](name, folder)
    if isinstance(registration, LoRARequest):
        return manager.adapter_key(registration)  # type: ignore[return-value]
    return manager.register(registration).key


@pytest.mark.parametrize("second", REGISTRATIONS)
@pytest.mark.parametrize("first", REGISTRATIONS)
def test_one_folder_registered_any_way_is_one_version(manager_and_model, tmp_path, first, second):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "a", seed=1)
    key = _register(manager, first, "one", folder)
    assert _register(manager, second, "two", folder) == key
    assert registered_adapters(manager) == {"one": key, "two": key}
    finish_reads(manager.admission, manager.loader)
    assert manager.admission.can_schedule(key)
    report = manager.stats_report()
    assert (report.cpu_cache_used, report.gpu_slots_used) == (1, 1)


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_replacing_a_name_serves_new_requests_on_the_new_version(manager_and_model, tmp_path, how):
    manager, *_ = manager_and_model
    old, new = make_peft_adapter(tmp_path / "v1", seed=1), make_peft_adapter(tmp_path / "v2", 2)
    old_key = _register(manager, how, "a", old)
    finish_reads(manager.admission, manager.loader)
    assert manager.admission.can_schedule(old_key)
    slot = manager.admission.acquire_for_request("running", old_key)
    new_key = _register(manager, how, "a", new)
    assert new_key != old_key and registered_adapters(manager) == {"a": new_key}
    assert manager.adapter_key(LoRARequest("a", str(new))) == new_key
    finish_reads(manager.admission, manager.loader)
    assert manager.admission.can_schedule(new_key) and manager.pool.slot_of(old_key) == slot
    manager.admission.release_for_request("running")  # the old version's last request ends
    assert manager.pool.slot_of(old_key) is None and not manager.pool.has_host(old_key)
    assert manager.pool.slot_of(new_key) is not None


def test_replacing_a_pinned_name_lets_the_old_version_go(manager_and_model, tmp_path):
    manager, *_ = manager_and_model
    old, new = make_peft_adapter(tmp_path / "v1", seed=1), make_peft_adapter(tmp_path / "v2", 2)
    old_key = manager.register(add_command("a", old, pinned=True)).key
    finish_reads(manager.admission, manager.loader)
    assert manager.stats_report().gpu_slots_in_use == 1  # the pin holds its slot
    new_key = manager.register(add_command("a", new)).key
    (stat,) = manager.stats_report().adapters
    assert (stat.key, stat.pinned) == (new_key, False)
    assert manager.pool.slot_of(old_key) is None and manager.stats_report().gpu_slots_in_use == 0
    assert manager.pin("a") and manager.pin("a") and not manager.pin("nobody")
    with pytest.raises(ValueError, match="one must stay for the other adapters"):
        manager.register(add_command("b", old, pinned=True))  # two slots: one pin at most


def test_a_name_removed_by_command_is_refused_one_seen_by_path_comes_back(
    manager_and_model, tmp_path
):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "a", seed=1)
    key = manager.register(AddAdapter("commanded", str(folder))).key
    assert manager.adapter_key(LoRARequest("seen", str(folder))) == key
    assert manager.remove_adapter("commanded") and manager.remove_adapter("seen")
    with pytest.raises(AdapterNotFoundError, match="was removed"):
        manager.adapter_key(LoRARequest("commanded", str(folder)))
    assert manager.adapter_key(LoRARequest("seen", str(folder))) == key
    assert manager.register(AddAdapter("commanded", str(folder))).key == key  # back again


@pytest.mark.parametrize("how", ["by path", "by command"])
def test_bad_adapter_is_refused_at_registration(manager_and_model, tmp_path, how):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "big", r=16)
    with pytest.raises(AdapterValidationError, match="max_lora_rank=8"):
        _register(manager, how, "big", folder)
    assert registered_adapters(manager) == {} and manager.stats_report().cpu_cache_used == 0


def test_digests_are_checked_on_load(manager_and_model, tmp_path):
    """A folder registered with its digest whose files are another adapter's by the time they
    are read fails its load: the key names content, never whatever sits in the folder."""
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "a", seed=1)
    command = add_command("a", folder)
    make_peft_adapter(folder, seed=2)  # replaced before the loader reads it
    key = manager.register(command).key
    assert not manager.admission.can_schedule(key)
    finish_reads(manager.admission, manager.loader)
    failures = manager.take_failures()
    assert "changed on disk" in failures[key] and str(tmp_path) not in failures[key]
    with pytest.raises(AdapterLoadError, match="changed on disk"):
        manager.adapter_key(LoRARequest("a", "/unused"))


def test_requests_pin_slots_and_the_batch_applies_them(manager_and_model, tmp_path):
    from peft import PeftModel

    manager, model, writer = manager_and_model
    folders = [make_peft_adapter(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))]
    keys = [manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders]
    admission = manager.admission
    slot_a = admission.acquire_for_request("r1", keys[0])
    slot_b = admission.acquire_for_request("r2", keys[1])
    assert admission.acquire_for_request("r1", keys[0]) == slot_a
    assert admission.acquire_for_request("r0", None) == -1
    assert not admission.can_schedule(keys[2]) and admission.can_schedule(keys[0])
    admission.prefetch(keys[2])  # no free slot: host cache only, nothing evicted
    finish_reads(admission, manager.loader)
    assert manager.stats().gpu_resident == 2

    writer.write(np.array([slot_b, -1, slot_a], dtype=np.int32))
    x = torch.randn(3, 64)
    linear = model.linear(1, "self_attn.o_proj")
    delta = our_delta(linear, x)
    peft_b = PeftModel.from_pretrained(tiny_llama(), str(folders[1])).eval()
    torch.testing.assert_close(delta[0], peft_delta(peft_b, 1, "o_proj", x[:1])[0])
    assert delta[1].abs().max() == 0

    admission.release_for_request("r2")
    assert admission.can_schedule(keys[2])
    assert admission.acquire_for_request("r3", keys[2]) == slot_b
    stats = manager.stats()
    assert (stats.gpu_loads, stats.gpu_evictions, stats.gpu_pinned) == (3, 1, 2)


def test_removed_adapter_is_dropped_once_idle(manager_and_model, tmp_path):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "a")
    key = manager.adapter_key(LoRARequest("a", str(folder)))
    manager.admission.acquire_for_request("r1", key)
    assert manager.remove_adapter("a") and not manager.remove_adapter("a")
    assert manager.stats().gpu_resident == 1  # still serving r1
    manager.admission.release_for_request("r1")
    assert manager.stats().registered == 0 and manager.stats().gpu_resident == 0


@pytest.mark.parametrize("where", ["prefetch", "can_schedule"])
def test_an_adapter_that_fails_to_load_fails_alone(manager_and_model, tmp_path, where, monkeypatch):
    manager, *_ = manager_and_model
    admission = manager.admission
    folders = [make_peft_adapter(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2))]
    key_a, key_b = (manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders)
    manager.pool.forget(key_a)  # out of the caches; its next read from disk fails
    read = manager.pool._loader

    def failing_read(key):
        if key == key_a:
            raise OSError(f"{folders[0]}/adapter_model.safetensors: I/O error")
        return read(key)

    monkeypatch.setattr(manager.pool, "_loader", failing_read)
    if where == "prefetch":
        admission.prefetch(key_a)  # never raises: the failure is recorded
    assert not admission.can_schedule(key_a)
    finish_reads(admission, manager.loader)
    failures = manager.take_failures()
    assert list(failures) == [key_a] and manager.take_failures() == {}
    assert "failed to load" in failures[key_a] and "I/O error" in failures[key_a]
    assert str(tmp_path) not in failures[key_a]  # no server path in what a tenant sees
    assert manager.stats_report().adapters[0].failed == failures[key_a]
    with pytest.raises(AdapterLoadError, match="failed to load"):
        manager.adapter_key(LoRARequest("a", str(folders[0])))
    assert admission.can_schedule(key_b) and admission.acquire_for_request("r1", key_b) >= 0

    monkeypatch.undo()  # the disk recovers; registering again clears the failure
    assert manager.register(AddAdapter("a", str(folders[0]))).key == key_a
    assert admission.can_schedule(key_a) and manager.adapter_key(LoRARequest("a", "/unused"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_side_stream_loads_serve_the_next_forward_on_gpu(tmp_path):
    PeftModel = pytest.importorskip("peft").PeftModel

    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    model = TinyProjections(tiny_llama()).cuda()
    state = attach_lora_layers(model, config, "cuda", torch.float32, max_num_tokens=32)
    manager = LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)
    folders = [
        make_peft_adapter(tmp_path / n, seed=s, r=r) for n, s, r in (("a", 1, 8), ("b", 2, 2))
    ]
    keys = [manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders]
    slots = [manager.admission.acquire_for_request(f"r{i}", key) for i, key in enumerate(keys)]
    LoRASlotWriter(state.meta, torch.device("cuda")).write(
        np.array([slots[1], slots[0], -1], dtype=np.int32)
    )
    x = torch.randn(3, 96)
    linear = model.linear(0, "mlp.down_proj")
    with torch.no_grad():
        delta = (linear(x.cuda()) - torch.nn.functional.linear(x.cuda(), linear.weight)).cpu()
    for row, folder in ((0, folders[1]), (1, folders[0])):
        peft_model = PeftModel.from_pretrained(tiny_llama(), str(folder)).eval()
        expected = peft_delta(peft_model, 0, "down_proj", x[row : row + 1])[0]
        torch.testing.assert_close(delta[row], expected, rtol=1e-4, atol=1e-4)
    assert delta[2].abs().max() == 0


class VocabProjections(TinyProjections):
    """TinyProjections with an embedding, a head and the model's two vocabulary hooks."""

    def __init__(self, hf_model) -> None:
        super().__init__(hf_model)
        self.embed_tokens = torch.nn.Parameter(hf_model.model.embed_tokens.weight.detach())
        self.lm_head = self.embed_tokens
        self.embed_lora = self.logits_lora = None


def test_the_model_must_hold_the_module_copy_slots_the_config_asks_for():
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_saved_module_loras=1)
    state = attach_lora_layers(TinyProjections(tiny_llama()), config, "cpu", torch.float32, 32)
    with pytest.raises(ValueError, match="holds 0 slots of embed_tokens / lm_head copies"):
        LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)


def test_a_staged_slot_write_fills_the_module_copy_and_a_plain_adapter_clears_it(tmp_path):
    """The slot image carries an adapter's trained token rows beside its LoRA tensors: writing
    it fills the slot's embed_tokens copy (base rows, trained rows replaced); a plain adapter
    written into that slot later leaves its tokens on the base modules (copies start zero)."""
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=4, max_saved_module_loras=1)
    model = VocabProjections(tiny_llama())
    state = attach_lora_layers(model, config, "cpu", torch.float32, 32)
    manager = LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)
    saved = state.vocab[0]
    rows = make_peft_adapter(tmp_path / "rows", seed=2, trainable_token_indices=[3, 10])
    plain = make_peft_adapter(tmp_path / "plain", seed=1)
    key_r, key_p = (manager.adapter_key(LoRARequest(f.name, str(f))) for f in (rows, plain))
    assert manager.admission.acquire_for_request("r1", key_r) == 0
    image = manager.pool.read(key_r)
    assert image.needs_saved_module_slot and not manager.pool.read(key_p).needs_saved_module_slot
    trained = image.extras.tokens["embed_tokens"]
    expected = model.embed_tokens.detach().clone()
    expected[trained.indices] = trained.values
    torch.testing.assert_close(saved.copies["embed_tokens"][0], expected, rtol=0, atol=0)
    assert saved.used["embed_tokens"][0]
    manager.admission.release_for_request("r1")
    assert manager.admission.acquire_for_request("p1", key_p) == 0  # evicts the adapter with rows
    assert not saved.used["embed_tokens"][0]
