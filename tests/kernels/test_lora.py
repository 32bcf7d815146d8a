"""Multi-LoRA: references against a per-token dense formula, Triton kernels against both."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loraplex.kernels.lora import (
    LoRAKernelConfig,
    LoRAStack,
    add_lora,
    expand_lora,
    fused_gemv_lora,
    lora_kernel_meta,
    lora_triton,
    new_counters,
    shrink_lora,
)

# tiny tiles, so that odd sizes cross several column tiles and reduction splits
TINY = dict(
    decode_block_k=16, decode_k_per_split=32, decode_block_n=16, token_k_per_split=32,
    shrink_block_k=16, expand_block_n=16, group_block_m=16, group_block_n=16,
)  # fmt: skip
#: Each regime forced on every batch size.
REGIMES = {
    "decode": dict(decode_max_tokens=1 << 20),
    "token": dict(decode_max_tokens=0, token_kernels_max_tokens=1 << 20),
    "group": dict(decode_max_tokens=0, token_kernels_max_tokens=0),
}


def _config(regime: str, **fields) -> LoRAKernelConfig:
    config = LoRAKernelConfig(**{**TINY, **REGIMES[regime], **fields})
    assert config.regime(7, has_counters=True) == regime
    return config


def _stack(in_features, slice_sizes, num_slots, max_rank, seed, dtype=torch.float32, first=0):
    g = torch.Generator().manual_seed(seed)
    offsets = [first]
    for n in slice_sizes:
        offsets.append(offsets[-1] + n)
    s = len(slice_sizes)
    ranks = torch.randint(0, max_rank + 1, (s, num_slots), generator=g, dtype=torch.int32)
    ranks[:, 0] = max_rank  # at least one full-rank slot
    return LoRAStack(
        a=torch.randn(num_slots, s * max_rank, in_features, generator=g).to(dtype),
        b_t=torch.randn(num_slots, max_rank, offsets[-1] + 3, generator=g).to(dtype),
        ranks=ranks,
        scaling=torch.rand(s, num_slots, generator=g) * 2,
        slice_offsets=tuple(offsets),
    )


def _inputs(num_tokens, in_features, num_slots, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, in_features, generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    return x, slots


def _dense_delta(x, lora, slots, width):
    """Token by token and slice by slice: scaling * x @ A_s[:r]^T @ B_s^T[:r]."""
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    r_max, offsets = lora.max_rank, lora.slice_offsets
    for i, slot in enumerate(slots.tolist()):
        for s in range(lora.num_slices):
            r = int(lora.ranks[s, slot]) if slot >= 0 else 0
            if r == 0:
                continue
            a = lora.a[slot, s * r_max : s * r_max + r].double()
            b_t = lora.b_t[slot, :r, offsets[s] : offsets[s + 1]].double()
            out[i, offsets[s] : offsets[s + 1]] = float(lora.scaling[s, slot]) * (
                (x[i].double() @ a.T) @ b_t
            )
    return out


@pytest.mark.parametrize(
    ("slots", "order", "start", "count"),
    [
        ([-1, -1], [0, 1], [0, 0, 0], [0, 0, 0]),
        ([2, 0, -1, 2, 0], [1, 4, 0, 3, 2], [0, 2, 2], [2, 0, 2]),
        ([1], [0], [0, 0, 1], [0, 1, 0]),
    ],
)
def test_meta_groups_tokens_by_slot(slots, order, start, count):
    meta = lora_kernel_meta(torch.tensor(slots, dtype=torch.int32), num_slots=3)
    assert meta.token_order.tolist() == order
    assert meta.slot_start.tolist() == start
    assert meta.slot_count.tolist() == count


@pytest.mark.parametrize(("num_tokens", "num_slots"), [(1, 1), (5, 3), (150, 5)])
def test_triton_meta_matches_torch(num_tokens, num_slots):
    from loraplex.kernels.lora.triton_meta import kernel_meta_triton

    slots = torch.randint(-1, num_slots, (num_tokens,), dtype=torch.int32)
    expected = lora_kernel_meta(slots, num_slots)
    meta = lora_kernel_meta(torch.zeros_like(slots), num_slots)
    meta = type(meta)(slots, torch.full_like(slots, -7), meta.slot_start, meta.slot_count)
    kernel_meta_triton(meta, num_slots)
    assert torch.equal(meta.token_order, expected.token_order)
    assert torch.equal(meta.slot_start, expected.slot_start)
    assert torch.equal(meta.slot_count, expected.slot_count)


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "slice_sizes", "num_slots", "max_rank"),
    [(1, 7, (5,), 1, 3), (13, 33, (19, 4, 4), 3, 8), (40, 24, (50, 7), 4, 16)],
)
def test_reference_matches_dense_formula(num_tokens, in_features, slice_sizes, num_slots, max_rank):
    lora = _stack(in_features, slice_sizes, num_slots, max_rank, 0, first=2)
    x, slots = _inputs(num_tokens, in_features, num_slots, 0)
    meta = lora_kernel_meta(slots, num_slots)
    base = torch.randn(num_tokens, lora.b_t.shape[2] + 1)
    out = base.clone()
    add_lora(x, out, lora, meta, torch.zeros(num_tokens, len(slice_sizes) * max_rank))
    expected = _dense_delta(x, lora, slots, out.shape[1])
    torch.testing.assert_close((out - base).double(), expected, rtol=1e-4, atol=1e-4)
    lo, hi = lora.slice_offsets[0], lora.slice_offsets[-1]
    assert torch.equal(out[:, :lo], base[:, :lo]) and torch.equal(out[:, hi:], base[:, hi:])


@pytest.mark.parametrize("device_regime", ["reference", "token", "group"])
def test_shrink_then_expand_apart_equal_add_lora(device_regime):
    """The two halves the engine runs on two streams give `add_lora`'s output exactly (the
    reference on the CPU; each Triton regime under the interpreter)."""
    lora = _stack(33, (19, 4, 4), 3, 8, 2, first=1)
    x, slots = _inputs(13, 33, 3, 2)
    meta = lora_kernel_meta(slots, 3)
    base = torch.randn(13, lora.b_t.shape[2])
    expected, apart = base.clone(), base.clone()
    if device_regime == "reference":
        add_lora(x, expected, lora, meta, torch.zeros(13, 24))
        workspace = torch.zeros(13, 24)
        splits = shrink_lora(x, lora, meta, workspace)
        expand_lora(workspace, splits, apart, lora, meta)
    else:
        from loraplex.kernels.lora.ops import _expand_triton, _shrink_triton

        config = _config(device_regime)
        lora_triton(x, expected, lora, meta, torch.zeros(64 * 13, 24), config)
        workspace = torch.zeros(64 * 13, 24)
        splits = _shrink_triton(x, lora, meta, workspace, config)
        assert splits > 1  # odd sizes over tiny tiles: a split reduction
        _expand_triton(workspace, splits, apart, lora, meta, config)
    assert torch.equal(apart, expected)
    assert not torch.equal(apart, base)
    with pytest.raises(ValueError, match="rows"):
        expand_lora(workspace, 1, torch.zeros(12, lora.b_t.shape[2]), lora, meta)


@pytest.mark.parametrize(("num_slots", "wide"), [(1, True), (8, False)], ids=["1-slot", "8-slots"])
def test_grouped_shrink_splits_as_wide_as_the_steps_blocks_fill(num_slots, wide):
    """The grouped shrink splits its reduction over the programs the step's real blocks leave
    (found on the device): 64 tokens of one adapter (4 blocks) split 8 ways over the 32
    programs a 64-token grid has, 64 tokens over 8 adapters (8-16 blocks) fewer; either way the
    expand sums exactly the partials written (NaN elsewhere) and equals the reference."""
    from loraplex.kernels.lora.ops import _expand_triton, _shrink_triton

    config = _config("group", target_programs=32, max_splits=8)
    lora = _stack(256, (24, 8), num_slots, 4, 11)
    x, _ = _inputs(64, 256, num_slots, 11)
    slots = torch.arange(64, dtype=torch.int32) % num_slots
    meta = lora_kernel_meta(slots, num_slots)
    workspace = torch.full((8 * 64, 8), float("nan"))
    splits = _shrink_triton(x, lora, meta, workspace, config)
    written = [not torch.isnan(workspace[p * 64 : (p + 1) * 64]).all() for p in range(8)]
    used = sum(written)
    assert written == [True] * used + [False] * (8 - used) and splits == 8
    assert (used == 8) if wide else (1 < used < 8)
    out = torch.zeros(64, lora.b_t.shape[2])
    _expand_triton(workspace, splits, out, lora, meta, config)
    expected = _dense_delta(x, lora, slots, out.shape[1])
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_mismatched_shapes_are_refused():
    lora = _stack(5, (6, 2), 2, 4, 1)
    x, slots = _inputs(3, 5, 2, 1)
    meta = lora_kernel_meta(slots, 2)
    with pytest.raises(ValueError, match="outside"):
        add_lora(x, torch.zeros(3, 7), lora, meta, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="workspace"):
        add_lora(x, torch.zeros(3, 8), lora, meta, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="do not fit"):
        LoRAStack(lora.a[:, :6], lora.b_t, lora.ranks, lora.scaling, lora.slice_offsets)


@pytest.mark.parametrize(
    ("expand_programs", "expand_max_tiles"),
    [(1024, 16), (1, 3)],
    ids=["tile-per-program", "3-tile-chunks"],
)
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "slice_sizes", "num_slots", "max_rank", "max_splits"),
    [
        (1, 9, (11,), 2, 5, 1),
        (21, 70, (37, 9, 9), 3, 20, 1),
        (21, 70, (37, 9, 9), 3, 20, 4),
        (5, 117, (130, 16), 2, 16, 32),
    ],
)
def test_triton_matches_reference(
    regime, num_tokens, in_features, slice_sizes, num_slots, max_rank, max_splits,
    expand_programs, expand_max_tiles,
):  # fmt: skip
    """Every regime's kernels, at odd sizes with mixed ranks (0 included) and base rows, equal
    the reference, with one column tile per expand program or chunks of three that end inside a
    slice; rows past the split shrink's partials hold NaN, which must not be read."""
    config = _config(regime, max_splits=max_splits,
                     expand_programs=expand_programs, expand_max_tiles=expand_max_tiles)  # fmt: skip
    lora = _stack(in_features, slice_sizes, num_slots, max_rank, 7, first=3)
    x, slots = _inputs(num_tokens, in_features, num_slots, 7)
    slots[0] = 0
    meta = lora_kernel_meta(slots, num_slots)
    workspace = torch.full((64 * num_tokens, len(slice_sizes) * max_rank), float("nan"))
    base = torch.randn(num_tokens, lora.b_t.shape[2])
    out_ref, out_tri = base.clone(), base.clone()
    add_lora(x, out_ref, lora, meta, workspace.clone())
    counters = new_counters("cpu")
    lora_triton(x, out_tri, lora, meta, workspace, config, counters)
    torch.testing.assert_close(out_tri, out_ref, rtol=1e-4, atol=1e-4)
    expected = base.double() + _dense_delta(x, lora, slots, base.shape[1])
    torch.testing.assert_close(out_tri.double(), expected, rtol=1e-4, atol=1e-4)
    base_rows = slots < 0
    assert torch.equal(out_tri[base_rows], base[base_rows])
    assert not torch.equal(out_tri[0], base[0])  # the adapter acted
    assert counters.tolist() == [0, 0, 0, 0]  # ready for the next launch


def test_decode_kernel_relaunches_on_the_same_counters():
    """The one-launch kernel leaves its counters at zero, so launches in turn (a CUDA graph's
    replays) see new slots and inputs each time; a wider input splits into several items."""
    config = _config("decode")
    lora = _stack(70, (37, 9, 9), 3, 8, 9)
    counters = new_counters("cpu")
    workspace = torch.zeros(64, 24)
    for seed in (1, 2, 3):
        x, slots = _inputs(4, 70, 3, seed)
        meta = lora_kernel_meta(slots, 3)
        out = torch.zeros(4, lora.b_t.shape[2])
        lora_triton(x, out, lora, meta, workspace, config, counters)
        expected = _dense_delta(x, lora, slots, out.shape[1])
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
        assert counters.tolist() == [0, 0, 0, 0]


def test_decode_regime_needs_counters():
    """Without counters a decode-sized batch runs the pair; bad counters are refused."""
    config = _config("decode")
    assert config.regime(3, has_counters=False) == "token"
    lora = _stack(9, (11,), 2, 5, 1)
    x, slots = _inputs(3, 9, 2, 1)
    meta = lora_kernel_meta(slots, 2)
    with pytest.raises(ValueError, match="counters"):
        lora_triton(x, torch.zeros(3, 14), lora, meta, torch.zeros(64, 5), config,
                    torch.zeros(4, dtype=torch.int64))  # fmt: skip


def test_default_regimes_by_token_count():
    """One launch for one token (with counters), the per-token pair to 128, the grouped pair
    from there at every size; bad tiles are refused."""
    config = LoRAKernelConfig()
    cases = {1: "decode", 2: "token", 16: "token", 128: "token", 129: "group", 4096: "group",
             8192: "group"}  # fmt: skip
    assert {n: config.regime(n, has_counters=True) for n in cases} == cases
    assert config.regime(1, has_counters=False) == "token"
    with pytest.raises(ValueError, match="power of two"):
        LoRAKernelConfig(decode_block_n=96)
    with pytest.raises(ValueError, match="decode_k_per_split"):
        LoRAKernelConfig(decode_block_k=256, decode_k_per_split=384)


def test_few_adapters_take_the_grouped_pair_below_its_token_count():
    """From 96 tokens on, a step with at least 12 tokens per distinct adapter takes the grouped
    pair where many adapters (or an unknown count) keep the per-token one; decode steps and
    steps past 128 tokens do not depend on the count."""
    config = LoRAKernelConfig()
    cases = {(64, 1): "token", (64, 8): "token", (96, 8): "group", (96, 9): "token",
             (128, 8): "group", (128, 10): "group", (128, 11): "token", (128, 64): "token",
             (128, None): "token", (1, 1): "decode", (256, 64): "group"}  # fmt: skip
    assert {c: config.regime(c[0], True, c[1]) for c in cases} == cases
    assert [config.few_adapters(96, 8), config.few_adapters(96, None)] == [True, False]
    with pytest.raises(ValueError, match="group_tokens_per_adapter"):
        LoRAKernelConfig(group_tokens_per_adapter=0)


def test_the_step_s_adapter_count_picks_the_kernels(monkeypatch):
    """`lora_triton` reads the regime off the step's metadata: 96 tokens on 4 adapters run the
    grouped pair, the same tokens with the count unknown the per-token pair, both equal to the
    reference (Triton interpreter)."""
    import loraplex.kernels.lora.triton_grouped as triton_grouped

    config = LoRAKernelConfig(**{**TINY, "group_min_tokens": 64, "token_kernels_max_tokens": 96})
    lora = _stack(24, (16, 8), 4, 4, 13)
    x, _ = _inputs(96, 24, 4, 13)
    slots = torch.arange(96, dtype=torch.int32) % 4
    grouped: list[int] = []
    real = triton_grouped.shrink_grouped
    monkeypatch.setattr(triton_grouped, "shrink_grouped",
                        lambda *a: grouped.append(1) or real(*a))  # fmt: skip
    expected = _dense_delta(x, lora, slots, lora.b_t.shape[2])
    for count, calls in ((4, 1), (None, 1)):
        meta = replace(lora_kernel_meta(slots, 4), num_adapters=count)
        out = torch.zeros(96, lora.b_t.shape[2])
        lora_triton(x, out, lora, meta, torch.zeros(2048, 8), config)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
        assert len(grouped) == calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 40, 300, 700])  # decode, token, group (x2)
def test_triton_bf16_on_gpu_replays_in_a_cuda_graph(num_tokens):
    lora = _stack(4096, (1024, 256, 256), 8, 16, 3, torch.bfloat16)
    lora = LoRAStack(
        lora.a.cuda() / 8, lora.b_t.cuda() / 8, lora.ranks.cuda(), lora.scaling.cuda(),
        lora.slice_offsets,
    )  # fmt: skip
    x, slots = _inputs(num_tokens, 4096, 8, 3, torch.bfloat16)
    x = x.cuda()
    meta = lora_kernel_meta(slots.cuda(), 8)
    out = torch.zeros(num_tokens, lora.b_t.shape[2], dtype=torch.bfloat16, device="cuda")
    workspace = torch.zeros(4096 + num_tokens, 48, device="cuda")
    counters = new_counters("cuda")
    add_lora(x, out, lora, meta, workspace, counters=counters)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(x, out, lora, meta, workspace, counters=counters)
    cpu = LoRAStack(lora.a.cpu(), lora.b_t.cpu(), lora.ranks.cpu(), lora.scaling.cpu(),
                    lora.slice_offsets)  # fmt: skip
    for seed in (4, 5):  # new slots written in place, same graph
        _, new_slots = _inputs(num_tokens, 4096, 8, seed)
        fresh = lora_kernel_meta(new_slots.cuda(), 8)
        for name in ("lora_slots", "token_order", "slot_start", "slot_count"):
            getattr(meta, name).copy_(getattr(fresh, name))
        out.zero_()
        graph.replay()
        expected = _dense_delta(x.cpu(), cpu, new_slots, out.shape[1])
        # NOTE: past 64 tokens the grouped path feeds the shrink result to the tensor cores in
        # bf16 (as Punica does): ~2^-8 relative error on the rank-16 intermediate.
        atol = 2e-2 if num_tokens <= 64 else 8e-2
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=atol)
        assert counters.tolist() == [0, 0, 0, 0]


def _with_dora(lora: LoRAStack, seed: int, bias: bool) -> LoRAStack:
    """`lora` with a DoRA column scale on every other slot (slot 0 among them; the others
    1.0, plain LoRA) and optionally a base bias."""

    g = torch.Generator().manual_seed(seed + 2)
    num_slots, width = lora.a.shape[0], lora.b_t.shape[2]
    scale = torch.ones(num_slots, width)
    scale[::2] = 0.5 + torch.rand(len(range(0, num_slots, 2)), width, generator=g)
    base_bias = torch.randn(width, generator=g) if bias else None
    return replace(lora, dora_scale=scale, base_bias=base_bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "slice_sizes", "num_slots", "max_rank"),
    [(1, 9, (11,), 2, 5), (21, 70, (37, 9, 9), 3, 20)],
)
def test_dora_rescales_base_and_delta_per_slot(
    bias, num_tokens, in_features, slice_sizes, num_slots, max_rank
):
    """out = g * (base - bias + delta) + bias on DoRA slots, base + delta elsewhere, in the
    reference and in every Triton regime."""
    lora = _with_dora(_stack(in_features, slice_sizes, num_slots, max_rank, 5, first=2), 5, bias)
    x, slots = _inputs(num_tokens, in_features, num_slots, 5)
    slots[0] = 0  # a DoRA token in every case
    meta = lora_kernel_meta(slots, num_slots)
    base = torch.randn(num_tokens, lora.b_t.shape[2])
    width = len(slice_sizes) * max_rank
    out_ref, out_tri = base.clone(), base.clone()
    add_lora(x, out_ref, lora, meta, torch.zeros(num_tokens, width))
    delta = _dense_delta(x, lora, slots, base.shape[1])
    b = lora.base_bias.double() if lora.base_bias is not None else 0.0
    expected = base.double() + delta
    for i, slot in enumerate(slots.tolist()):
        for s in range(lora.num_slices):
            lo, hi = lora.slice_offsets[s], lora.slice_offsets[s + 1]
            if slot < 0 or int(lora.ranks[s, slot]) == 0 or slot % 2:
                continue
            g = lora.dora_scale[slot, lo:hi].double()
            bias_s = b[lo:hi] if isinstance(b, torch.Tensor) else b
            expected[i, lo:hi] = g * (base[i, lo:hi].double() - bias_s + delta[i, lo:hi]) + bias_s
    torch.testing.assert_close(out_ref.double(), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out_ref.double(), base.double() + delta, atol=1e-3)  # DoRA acted
    for regime in REGIMES:
        out_tri = base.clone()
        lora_triton(x, out_tri, lora, meta, torch.zeros(64 * num_tokens, width), _config(regime),
                    new_counters("cpu"))  # fmt: skip
        torch.testing.assert_close(out_tri, out_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("slot", "k"), [(0, 70), (1, 64), (-1, 70)])
def test_gemv_with_lora_in_one_launch_equals_gemv_then_lora(slot, k, bias, dora, block_n):
    """One token: the fused GEMV's output equals the base product (+ bias) followed by the
    reference delta (DoRA: the rescaled column), for an adapter slot, one of rank 0 on a slice,
    and the base model; columns past the slices get the base product only."""
    from loraplex.kernels.gemv import GemvConfig
    from loraplex.kernels.lora.triton_gemv_lora import gemv_lora

    lora = _stack(k, (37, 9, 9), 3, 20, 11)  # slices at columns 0..55 of 58
    lora.ranks[1, 1] = 0
    if dora:
        lora = _with_dora(lora, 11, bias)
    g = torch.Generator().manual_seed(12)
    n = lora.b_t.shape[2]
    weight = torch.randn(n, k, generator=g)
    base_bias = lora.base_bias if dora else None
    if bias and base_bias is None:
        base_bias = torch.randn(n, generator=g)
    x = torch.randn(1, k, generator=g)
    slots = torch.tensor([slot], dtype=torch.int32)
    meta = lora_kernel_meta(slots, 3)
    expected = x @ weight.T + (base_bias if base_bias is not None else 0.0)
    add_lora(x, expected, lora, meta, torch.zeros(1, 60))
    counter = torch.zeros(1, dtype=torch.int32)
    out = gemv_lora(x, weight, base_bias, lora, meta, torch.full((8, 60), float("nan")), counter,
                    GemvConfig(block_n, 32, 4, 1))  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    base = x @ weight.T + (base_bias if base_bias is not None else 0.0)
    torch.testing.assert_close(out[:, 55:], base[:, 55:], rtol=1e-4, atol=1e-4)
    assert torch.allclose(out, base, atol=1e-4) == (slot < 0)  # the adapter acted, or none
    assert counter.item() == -(-60 // block_n)  # every shrink program (block_n of t's 60 columns)


def test_fused_gemv_lora_serves_one_token_on_cuda_only():
    """Off CUDA the fused path declines (None), so the caller runs the base product and the
    reference delta apart (the GPU test above covers the path it serves)."""
    lora = _stack(9, (11,), 2, 5, 1)
    x, slots = _inputs(1, 9, 2, 1)
    meta = lora_kernel_meta(slots, 2)
    args = (lora, meta, torch.zeros(4, 5), torch.zeros(1, dtype=torch.int32))
    assert fused_gemv_lora(x, torch.randn(14, 9), None, *args) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("sizes", "k"), [((4096, 1024, 1024), 4096), ((14336, 14336), 4096),
                                          ((4096,), 14336)])  # fmt: skip
def test_fused_gemv_lora_on_gpu_replays_in_a_cuda_graph(sizes, k):
    """The 8B projections at one token: the fused GEMV with the adapter, captured once and
    replayed with new slots (an adapter, another, the base model), equals the base product plus
    the reference delta."""
    stack = _stack(k, sizes, 8, 16, 3, torch.bfloat16)
    lora = LoRAStack(stack.a.cuda() / 8, stack.b_t.cuda() / 8, stack.ranks.cuda(),
                     stack.scaling.cuda(), stack.slice_offsets)  # fmt: skip
    n = lora.slice_offsets[-1]
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    meta = lora_kernel_meta(torch.tensor([0], dtype=torch.int32, device="cuda"), 8)
    workspace, counter = (
        torch.zeros(64, 48, device="cuda"),
        torch.zeros(1, dtype=torch.int32, device="cuda"),
    )
    args = (x, weight, None, lora, meta, workspace, counter)
    assert fused_gemv_lora(*args) is not None  # compiled outside the capture
    counter.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_gemv_lora(*args)
    cpu = LoRAStack(lora.a.cpu(), lora.b_t.cpu(), lora.ranks.cpu(), lora.scaling.cpu(),
                    lora.slice_offsets)  # fmt: skip
    base = (x.float() @ weight.float().T).cpu().double()
    for slot in (3, 0, -1):
        meta.lora_slots.fill_(slot)
        counter.zero_()  # as LoRABatchMeta.set does every step
        graph.replay()
        slots = torch.tensor([slot], dtype=torch.int32)
        expected = base + _dense_delta(x.cpu(), cpu, slots, n)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2)
