"""LoRA layers on merged projections give PEFT's per-layer deltas, token by token."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import HF_CONFIG, make_peft_adapter, tiny_llama
from torch import nn

from loraplex.adapters.lora_layer import attach_lora_layers
from loraplex.adapters.peft_format import BaseModelSpec, load_peft_adapter
from loraplex.config import LoRAConfig
from loraplex.platform.models.linear import Linear

MERGED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


class TinyProjections(nn.Module):
    """The linear layers of a tiny Llama, merged and named as loraplex's model names them."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.projections = nn.ModuleDict()
        for n, hf_layer in enumerate(hf_model.model.layers):
            for suffix, shards in MERGED.items():
                block = getattr(hf_layer, suffix.split(".")[0])
                hf = [getattr(block, s) for s in shards]
                layer = Linear(
                    hf[0].in_features,
                    [m.out_features for m in hf],
                    shard_names=shards,
                    prefix=f"model.layers.{n}.{suffix}",
                )
                layer.weight.data.copy_(torch.cat([m.weight for m in hf]))
                self.projections[f"{n}_{suffix.replace('.', '_')}"] = layer
        self.lm_head = Linear(64, [128], prefix="lm_head")

    def linear(self, layer: int, suffix: str) -> Linear:
        return self.projections[f"{layer}_{suffix.replace('.', '_')}"]


def peft_delta(peft_model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    lora_linear = getattr(getattr(peft_model.base_model.model.model.layers[layer], block), module)
    if not hasattr(lora_linear, "base_layer"):  # a module this adapter does not target
        return torch.zeros(x.shape[0], lora_linear.out_features)
    with torch.no_grad():
        return lora_linear(x) - lora_linear.base_layer(x)


def our_delta(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    # NOTE: against the layer's own base projection (fp32 CPU linears run oneDNN through
    # `cpu_linear`, whose sums round unlike F.linear's), so the delta is the adapter's.
    from loraplex.kernels.gemv import linear as base_linear

    with torch.no_grad():
        return linear(x) - base_linear(x, linear.weight, None)


@pytest.fixture
def setup(tmp_path):
    from peft import PeftModel

    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    spec = BaseModelSpec.from_hf_config(HF_CONFIG)
    folders = [
        make_peft_adapter(tmp_path / "a", seed=1, r=4, lora_alpha=8),
        make_peft_adapter(
            tmp_path / "b",
            seed=2,
            r=8,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        ),
    ]
    peft_models = [PeftModel.from_pretrained(tiny_llama(), str(f)).eval() for f in folders]
    weights = [load_peft_adapter(f, spec, config.max_lora_rank) for f in folders]
    model = TinyProjections(tiny_llama())
    state = attach_lora_layers(model, config, "cpu", torch.float32, max_num_tokens=64)
    return model, state, peft_models, weights


def test_every_projection_is_adapted_but_lm_head(setup):
    model, state, _, _ = setup
    assert len(state.layers) == 2 * 4
    assert model.lm_head.lora is None
    state.check_spec(BaseModelSpec.from_hf_config(HF_CONFIG))
    with pytest.raises(ValueError, match="differs"):
        state.check_spec(BaseModelSpec.from_hf_config({**HF_CONFIG, "intermediate_size": 80}))


def test_mixed_batch_matches_peft_per_token(setup):
    model, state, peft_models, weights = setup
    state.load_slot(0, weights[0])
    state.load_slot(1, weights[1])
    slots = torch.tensor([1, 0, -1, 0, 1, 1, -1], dtype=torch.int32)
    state.meta.set(slots)
    torch.manual_seed(0)
    for layer in range(2):
        for suffix, shards in MERGED.items():
            linear = model.linear(layer, suffix)
            x = torch.randn(len(slots), linear.input_size)
            delta = our_delta(linear, x)
            offsets = linear.shard_offsets()
            for i, shard in enumerate(shards):
                ours = delta[:, offsets[i] : offsets[i + 1]]
                for token, slot in enumerate(slots.tolist()):
                    expected = (
                        torch.zeros(offsets[i + 1] - offsets[i])
                        if slot < 0
                        else peft_delta(peft_models[slot], layer, shard, x[token : token + 1])[0]
                    )
                    torch.testing.assert_close(ours[token], expected, rtol=1e-5, atol=1e-5)


def test_slot_reused_by_a_smaller_rank_leaves_no_stale_rows(setup):
    model, state, peft_models, weights = setup
    state.load_slot(0, weights[1])  # rank 8
    state.load_slot(0, weights[0])  # rank 4 over it
    state.meta.set(torch.zeros(3, dtype=torch.int32))
    linear = model.linear(1, "self_attn.qkv_proj")
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        our_delta(linear, x)[:, :64],
        peft_delta(peft_models[0], 1, "q_proj", x),
        rtol=1e-5,
        atol=1e-5,
    )


def test_base_only_batch_adds_nothing(setup):
    model, state, _, weights = setup
    state.load_slot(0, weights[0])
    state.meta.set(torch.full((4,), -1, dtype=torch.int32))
    assert not state.meta.active
    linear = model.linear(0, "mlp.down_proj")
    assert our_delta(linear, torch.randn(4, 96)).abs().max() == 0


def test_too_many_tokens_for_the_buffers_is_refused(setup):
    _, state, _, _ = setup
    with pytest.raises(ValueError, match="hold 64"):
        state.meta.set(torch.zeros(65, dtype=torch.int32))


def test_each_step_regroups_tokens_in_the_shared_buffers(setup):
    from loraplex.kernels.lora import lora_kernel_meta

    model, state, _, _ = setup
    buffers = set()
    for slots in ([1, 0, -1, 0, 1], [-1, 1], [0, 0, 0, 1, -1, 1, 0]):
        slots = torch.tensor(slots, dtype=torch.int32)
        state.meta.set(slots)
        expected = lora_kernel_meta(slots, num_slots=2)
        got = state.meta.kernel_meta
        assert got.token_order.tolist() == expected.token_order.tolist()
        assert got.slot_count.tolist() == expected.slot_count.tolist()
        assert got.slot_start.tolist() == expected.slot_start.tolist()
        buffers.add((state.meta.workspace.data_ptr(), got.token_order.data_ptr()))
    assert len(buffers) == 1  # CUDA graphs replay over the same addresses step after step
    assert len(state.layers[0].weights.slice_offsets) == 4  # q, k, v in one stack


def _old_path_slots(state, writes, dtype):
    """Each layer's slot tensors as the per-shard writes (one copy per shard's A and B^T and one
    assignment per rank and scaling, into zeroed slots) left them: the reference layout."""
    expected = []
    for layer in state.layers:
        w = layer.weights
        a, b_t = torch.zeros_like(w.a), torch.zeros_like(w.b_t)
        ranks, scaling = torch.zeros_like(w.ranks), torch.zeros_like(w.scaling)
        r_max = w.max_rank
        for slot, weights in writes.items():
            for i, name in enumerate(layer.shard_names):
                module = weights.modules.get((layer.layer_index, name))
                if module is None:
                    continue
                r, lo, hi = module.rank, layer.offsets[i], layer.offsets[i + 1]
                a[slot, i * r_max : i * r_max + r] = module.a.to(dtype)
                b_t[slot, :r, lo:hi] = module.b.T.to(dtype)
                ranks[i, slot], scaling[i, slot] = r, module.scaling
        expected.append((a, b_t, ranks, scaling))
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_slot_writes_are_bit_exact_with_per_shard_writes(setup, dtype):
    _, _, _, weights = setup
    config = LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    state = attach_lora_layers(TinyProjections(tiny_llama()), config, "cpu", dtype, 64)
    state.load_slot(0, weights[1])  # rank 8 on four modules ...
    state.load_slot(0, weights[0])  # ... then rank 4 on all seven over it
    state.load_slot(2, weights[1])
    expected = _old_path_slots(state, {0: weights[0], 2: weights[1]}, dtype)
    for layer, (a, b_t, ranks, scaling) in zip(state.layers, expected):
        w = layer.weights
        assert w.a.dtype == dtype and torch.equal(w.a, a), layer.prefix
        assert torch.equal(w.b_t, b_t) and torch.equal(w.ranks, ranks), layer.prefix
        assert torch.equal(w.scaling, scaling) and bool((w.dora_scale == 1).all())
    # every layer's tensors are views of one slot-major block: a slot is one contiguous row
    row = state.memory.weights[2]
    for layer in state.layers:
        for t in (layer.weights.a, layer.weights.b_t):
            assert t[2].data_ptr() >= row.data_ptr()
            assert t[2].data_ptr() + t[2].nbytes <= row.data_ptr() + row.nbytes


def test_a_slot_write_costs_three_operations_whatever_the_layer_count(setup):
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # views launch nothing on a device
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _, state, _, weights = setup
    image = state.stage(weights[0])  # the loader thread's part: host memory only
    assert image.weights.device.type == "cpu" and image.extras is None
    with CountOps() as counted:
        state.write_slot(1, image)
    assert len(counted.ops) == 3, counted.ops  # weights, ranks and scalings, DoRA scales
    assert len(state.layers) == 8  # the per-shard writes took 4 to 5 operations per shard
    state.meta.set(torch.tensor([1, -1], dtype=torch.int32))
    linear = state.layers[0].target
    x = torch.randn(2, 64)
    expected = state.layers[0].weights.scaling[0, 1] * (x[0] @ weights[0].modules[0, "q_proj"].a.T)
    expected = expected @ weights[0].modules[0, "q_proj"].b.T
    torch.testing.assert_close(our_delta(linear, x)[0, :64], expected, rtol=1e-5, atol=1e-5)


def test_a_slot_image_of_another_model_is_refused(setup):
    _, state, _, weights = setup
    image = state.stage(weights[0])
    other = attach_lora_layers(
        TinyProjections(tiny_llama()), LoRAConfig(max_loras=2, max_lora_rank=4), "cpu",
        torch.float32, 16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):
        other.write_slot(0, image)


def test_warm_up_runs_every_layer_in_every_kernel_regime(setup, monkeypatch):
    """Start-up runs each LoRA layer once per kernel regime (so no step compiles a kernel),
    then leaves the layers off; a step after it serves its adapters as before."""
    from loraplex.kernels.lora import LoRAKernelConfig, add_lora

    model, state, peft_models, weights = setup
    config = LoRAKernelConfig(decode_max_tokens=2, token_kernels_max_tokens=4)
    seen = []

    def record(x, out, lora, meta, workspace, config_=None, counters=None):
        seen.append((id(lora), config.regime(x.shape[0], counters is not None)))
        add_lora(x, out, lora, meta, workspace, config_, counters)

    monkeypatch.setattr("loraplex.adapters.lora_layer.add_lora", record)
    assert state.warm_up(config) == 3 * len(state.layers)
    regimes = {"decode", "token", "group"}
    assert all({r for k, r in seen if k == id(layer.weights)} == regimes for layer in state.layers)
    assert not state.meta.active
    state.load_slot(0, weights[0])
    state.meta.set(torch.zeros(3, dtype=torch.int32))
    linear = model.linear(1, "self_attn.qkv_proj")
    x = torch.randn(3, 64)
    expected = peft_delta(peft_models[0], 1, "q_proj", x)
    torch.testing.assert_close(our_delta(linear, x)[:, :64], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [8, 40, 128])  # the per-token pair, to its limit
def test_shrink_beside_the_base_gemm_replays_in_a_cuda_graph(num_tokens, monkeypatch):
    """A two-launch step runs its shrink on the side stream while the base GEMM runs, eagerly
    and replayed from a CUDA graph with new slots, and the layer's output is the base product
    plus each token's delta."""
    from loraplex.adapters import lora_layer as module
    from loraplex.adapters.lora_layer import LoRABatchMeta, LoRALayer
    from loraplex.kernels.lora import (
        DEFAULT_KERNEL_CONFIG,
        LoRAStack,
        lora_expand_ref,
        lora_shrink_ref,
    )

    device, dtype, slots_n = torch.device("cuda"), torch.bfloat16, 8
    assert DEFAULT_KERNEL_CONFIG.overlaps(num_tokens, has_counters=True)
    linear = Linear(4096, [1024, 256, 256], shard_names=("q_proj", "k_proj", "v_proj"),
                    prefix="model.layers.0.self_attn.qkv_proj").to(device, dtype)  # fmt: skip
    linear.weight.data.normal_(std=4096**-0.5)
    meta = LoRABatchMeta(slots_n, 16, 512, device)
    layer = LoRALayer(linear, 0, meta, 16, device, dtype)
    w = layer.weights
    w.a.normal_(std=4096**-0.5)
    w.b_t.normal_(std=0.25)
    w.ranks.copy_(torch.randint(1, 17, tuple(w.ranks.shape), dtype=torch.int32))
    w.scaling.fill_(2.0)
    linear.lora = layer
    streams = []
    shrink = module.shrink_lora

    def spy(*args, **kwargs):
        streams.append(torch.cuda.current_stream())
        return shrink(*args, **kwargs)

    monkeypatch.setattr(module, "shrink_lora", spy)
    x = torch.randn(num_tokens, 4096, dtype=dtype, device=device)
    w32 = LoRAStack(w.a.float(), w.b_t.float(), w.ranks, w.scaling, w.slice_offsets)

    def expected() -> torch.Tensor:
        t = torch.zeros(num_tokens, 48, device=device)
        ref = x.float() @ linear.weight.float().T
        lora_shrink_ref(x.float(), w32, t, meta.kernel_meta)
        lora_expand_ref(t, w32, ref, meta.kernel_meta)
        return ref

    def new_slots(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-1, slots_n, (num_tokens,), generator=g, dtype=torch.int32)

    with torch.inference_mode():
        meta.set(new_slots(1).to(device))
        torch.testing.assert_close(linear(x).float(), expected(), rtol=2e-2, atol=5e-2)
        assert streams == [meta.side_stream]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x)
        for seed in (2, 3):  # new slots written in place, same graph
            meta.set(new_slots(seed).to(device))
            graph.replay()
            torch.testing.assert_close(out.float(), expected(), rtol=2e-2, atol=5e-2)
    assert len(streams) == 2 and streams[1] != torch.cuda.current_stream()
