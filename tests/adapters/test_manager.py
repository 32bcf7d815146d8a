"""LoRAManager: registry identity for prefix caching, scheduling by slots, per-step batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_fixtures import HF_CONFIG, make_peft_adapter, tiny_llama
from test_lora_layer import TinyProjections, peft_delta

from loraplex.adapters.errors import AdapterLoadError
from loraplex.adapters.lora_layer import attach_lora_layers
from loraplex.adapters.manager import STARVATION_STEPS, LoRAManager
from loraplex.adapters.peft_format import AdapterValidationError, BaseModelSpec
from loraplex.adapters.request import LoRARequest
from loraplex.config import LoRAConfig
from loraplex.platform.runner.lora_slots import LoRASlotWriter


@pytest.fixture
def manager_and_model():
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    model = TinyProjections(tiny_llama())
    state = attach_lora_layers(model, config, "cpu", torch.float32, max_num_tokens=32)
    manager = LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)
    return manager, model, LoRASlotWriter(state.meta, torch.device("cpu"))


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
    assert manager.list_adapters() == {"alpha": key_a2, "beta": key_b}


def test_bad_adapter_is_refused_at_registration(manager_and_model, tmp_path):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "big", r=16)
    with pytest.raises(AdapterValidationError, match="max_lora_rank=8"):
        manager.add_adapter(LoRARequest("big", str(folder)))
    assert manager.list_adapters() == {}


def test_requests_pin_slots_and_the_batch_applies_them(manager_and_model, tmp_path):
    from peft import PeftModel

    manager, model, writer = manager_and_model
    folders = [make_peft_adapter(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))]
    keys = [manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders]
    slot_a = manager.acquire_for_request("r1", keys[0])
    slot_b = manager.acquire_for_request("r2", keys[1])
    assert manager.acquire_for_request("r1", keys[0]) == slot_a
    assert manager.acquire_for_request("r0", None) == -1
    assert not manager.can_schedule(keys[2]) and manager.can_schedule(keys[0])
    manager.prefetch(keys[2])  # no free slot: host cache only, nothing evicted
    assert manager.stats().gpu_resident == 2

    writer.write(np.array([slot_b, -1, slot_a], dtype=np.int32))
    x = torch.randn(3, 64)
    linear = model.linear(1, "self_attn.o_proj")
    with torch.no_grad():
        delta = linear(x) - torch.nn.functional.linear(x, linear.weight)
    peft_b = PeftModel.from_pretrained(tiny_llama(), str(folders[1])).eval()
    torch.testing.assert_close(delta[0], peft_delta(peft_b, 1, "o_proj", x[:1])[0])
    assert delta[1].abs().max() == 0

    manager.release_for_request("r2")
    assert manager.can_schedule(keys[2])
    assert manager.acquire_for_request("r3", keys[2]) == slot_b
    stats = manager.stats()
    assert (stats.gpu_loads, stats.gpu_evictions, stats.gpu_pinned) == (3, 1, 2)


def test_removed_adapter_is_dropped_once_idle(manager_and_model, tmp_path):
    manager, *_ = manager_and_model
    folder = make_peft_adapter(tmp_path / "a")
    key = manager.adapter_key(LoRARequest("a", str(folder)))
    manager.acquire_for_request("r1", key)
    assert manager.remove_adapter("a") and not manager.remove_adapter("a")
    assert manager.stats().gpu_resident == 1  # still serving r1
    manager.release_for_request("r1")
    assert manager.stats().registered == 0 and manager.stats().gpu_resident == 0


def _failing_loads(manager: LoRAManager, key: str) -> None:
    """Drop `key` from the caches and make its next read from disk fail."""
    manager.pool.forget(key)
    loader = manager.pool._loader

    def load(k):
        if k == key:
            raise OSError(f"{manager._paths[k]}/adapter_model.safetensors: I/O error")
        return loader(k)

    manager.pool._loader = load


@pytest.mark.parametrize("where", ["prefetch", "can_schedule"])
def test_an_adapter_that_fails_to_load_fails_alone(manager_and_model, tmp_path, where):
    manager, *_ = manager_and_model
    folders = [make_peft_adapter(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2))]
    key_a, key_b = (manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders)
    _failing_loads(manager, key_a)
    if where == "prefetch":
        manager.prefetch(key_a)  # never raises: the failure is recorded
    assert not manager.can_schedule(key_a)
    failures = manager.take_failures()
    assert list(failures) == [key_a] and manager.take_failures() == {}
    assert "failed to load" in failures[key_a] and "I/O error" in failures[key_a]
    assert str(tmp_path) not in failures[key_a]  # no server path in what a tenant sees
    with pytest.raises(AdapterLoadError, match="failed to load"):
        manager.adapter_key(LoRARequest("a", str(folders[0])))
    assert manager.can_schedule(key_b) and manager.acquire_for_request("r1", key_b) >= 0

    manager.pool._loader = manager._reload  # the disk recovers; registering again clears it
    assert manager.add_adapter(LoRARequest("a", str(folders[0]))) == key_a
    assert manager.can_schedule(key_a) and manager.adapter_key(LoRARequest("a", str(folders[0])))


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
    slots = [manager.acquire_for_request(f"r{i}", key) for i, key in enumerate(keys)]
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


def test_an_adapter_waiting_for_a_slot_gets_one_within_the_starvation_bound(
    manager_and_model, tmp_path
):
    manager, *_ = manager_and_model
    folders = [make_peft_adapter(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))]
    key_a, key_b, key_c = (manager.adapter_key(LoRARequest(f.name, str(f))) for f in folders)
    manager.acquire_for_request("a1", key_a)
    manager.acquire_for_request("b1", key_b)
    manager.acquire_for_request("b2", key_b)
    assert not manager.can_schedule(key_c)  # both slots pinned: c waits
    for _ in range(STARVATION_STEPS - 1):
        manager.poll()
        assert manager.can_schedule(key_a) and not manager.can_schedule(key_c)
    manager.poll()  # c has waited long enough: the slot with the fewest requests drains
    assert not manager.can_schedule(key_a) and manager.can_schedule(key_b)
    manager.acquire_for_request("b3", key_b)  # b keeps admitting
    manager.release_for_request("a1")  # a's last running request ends
    assert manager.can_schedule(key_c) and manager.acquire_for_request("c1", key_c) >= 0
    assert manager.pool.slot_of(key_a) is None  # c took a's slot
    assert manager.can_schedule(key_a) is False  # and a now waits its turn like c did


class VocabProjections(TinyProjections):
    """TinyProjections with an embedding, a head and the model's two vocabulary hooks."""

    def __init__(self, hf_model) -> None:
        super().__init__(hf_model)
        self.embed_tokens = torch.nn.Parameter(hf_model.model.embed_tokens.weight.detach())
        self.lm_head = self.embed_tokens
        self.embed_lora = self.logits_lora = None


def test_a_drain_for_an_adapter_with_module_copies_frees_a_copy_slot(tmp_path):
    """One of two slots holds module copies: an adapter with trained token rows waiting for it
    drains the copy slot's adapter, not the plain one with fewer requests."""
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_saved_module_loras=1)
    state = attach_lora_layers(VocabProjections(tiny_llama()), config, "cpu", torch.float32, 32)
    manager = LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG), state, torch.float32)
    plain = make_peft_adapter(tmp_path / "plain", seed=1)
    rows = [make_peft_adapter(tmp_path / f"rows{s}", seed=s, trainable_token_indices=[3, 10 + s])
            for s in (2, 3)]  # fmt: skip
    key_p, key_a, key_b = (manager.adapter_key(LoRARequest(f.name, str(f))) for f in [plain, *rows])
    assert manager.acquire_for_request("p1", key_p) == 1  # plain adapters leave slot 0 free
    assert manager.acquire_for_request("a1", key_a) == 0
    manager.acquire_for_request("a2", key_a)
    assert not manager.can_schedule(key_b)
    for _ in range(STARVATION_STEPS):
        manager.poll()
    assert manager.can_schedule(key_p) and not manager.can_schedule(key_a)  # a drains
    manager.release_for_request("a1")
    manager.release_for_request("a2")
    assert manager.can_schedule(key_b) and manager.acquire_for_request("b1", key_b) == 0
    with pytest.raises(ValueError, match="holds 0 slots of embed_tokens / lm_head copies"):
        LoRAManager(config, BaseModelSpec.from_hf_config(HF_CONFIG),
                    attach_lora_layers(TinyProjections(tiny_llama()), config, "cpu",
                                       torch.float32, 32), torch.float32)  # fmt: skip


def test_a_request_is_admitted_only_once_its_slot_copy_has_completed(
    manager_and_model, tmp_path, monkeypatch
):
    manager, *_ = manager_and_model
    key = manager.adapter_key(LoRARequest("a", str(make_peft_adapter(tmp_path / "a", seed=1))))

    class PendingCopy:  # stands in for the side stream's CUDA event
        done = False

        def query(self) -> bool:
            return self.done

    copy = PendingCopy()
    load = manager.pool._load

    def load_on_a_side_stream(k, slot):
        load(k, slot)
        manager.pool._slots[slot].ready = copy

    monkeypatch.setattr(manager.pool, "_load", load_on_a_side_stream)
    assert not manager.can_schedule(key)  # the copy starts: the request waits in the queue
    slot = manager.pool.slot_of(key)
    assert slot is not None and not manager.can_schedule(key)
    copy.done = True
    assert manager.can_schedule(key) and manager.pool.slot_of(key) == slot


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
    assert manager.acquire_for_request("r1", key_r) == 0
    image = manager.pool.read(key_r)
    assert image.needs_saved_module_slot and not manager.pool.read(key_p).needs_saved_module_slot
    trained = image.extras.tokens["embed_tokens"]
    expected = model.embed_tokens.detach().clone()
    expected[trained.indices] = trained.values
    torch.testing.assert_close(saved.copies["embed_tokens"][0], expected, rtol=0, atol=0)
    assert saved.used["embed_tokens"][0]
    manager.release_for_request("r1")
    assert manager.acquire_for_request("p1", key_p) == 0  # evicts the adapter with rows
    assert not saved.used["embed_tokens"][0]
