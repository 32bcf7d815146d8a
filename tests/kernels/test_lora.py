"""Multi-LoRA shrink/expand: references against a per-token dense formula, Triton against both."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora import (
    lora_expand,
    lora_expand_ref,
    lora_kernel_meta,
    lora_shrink,
    lora_shrink_ref,
)


def _dense_delta(x, a, b_t, slots, ranks, scaling):
    """Token by token: scaling * x @ A[:r]^T @ B^T[:r], zero for base tokens and rank 0."""
    out = torch.zeros(x.shape[0], b_t.shape[2], dtype=torch.float64)
    for i, s in enumerate(slots.tolist()):
        if s < 0 or ranks[s] == 0:
            continue
        r = int(ranks[s])
        t = x[i].double() @ a[s, :r].double().T
        out[i] = float(scaling[s]) * (t @ b_t[s, :r].double())
    return out


def _case(num_tokens, in_features, n, num_slots, max_rank, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=g).to(dtype)
    a = torch.randn(num_slots, max_rank, in_features, generator=g).to(dtype)
    b_t = torch.randn(num_slots, max_rank, n, generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    ranks = torch.randint(0, max_rank + 1, (num_slots,), generator=g, dtype=torch.int32)
    ranks[0] = max_rank  # at least one full-rank slot
    scaling = torch.rand(num_slots, generator=g) * 2
    return x, a, b_t, slots, ranks, scaling


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


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "n", "num_slots", "max_rank"),
    [(1, 7, 5, 1, 3), (13, 33, 19, 3, 8), (40, 24, 50, 4, 16)],
)
def test_reference_matches_dense_formula(num_tokens, in_features, n, num_slots, max_rank):
    x, a, b_t, slots, ranks, scaling = _case(num_tokens, in_features, n, num_slots, max_rank, 0)
    meta = lora_kernel_meta(slots, num_slots)
    t = torch.zeros(num_tokens, max_rank)
    base = torch.randn(num_tokens, n + 9)
    out = base.clone()
    lora_shrink(x, a, t, meta, ranks)
    lora_expand(t, b_t, out, 4, meta, ranks, scaling)
    expected = _dense_delta(x, a, b_t, slots, ranks, scaling)
    torch.testing.assert_close((out - base)[:, 4 : 4 + n].double(), expected, rtol=1e-4, atol=1e-4)
    untouched = torch.cat([out[:, :4], out[:, 4 + n :]], 1)
    assert torch.equal(untouched, torch.cat([base[:, :4], base[:, 4 + n :]], 1))


def test_expand_rejects_columns_outside_output():
    x, a, b_t, slots, ranks, scaling = _case(3, 5, 6, 2, 4, 1)
    meta = lora_kernel_meta(slots, 2)
    with pytest.raises(ValueError, match="outside"):
        lora_expand_ref(torch.zeros(3, 4), b_t, torch.zeros(3, 8), 4, meta, ranks, scaling)


@pytest.mark.parametrize(
    ("num_tokens", "in_features", "n", "num_slots", "max_rank", "split_k"),
    [(1, 9, 11, 2, 5, 1), (21, 70, 37, 3, 20, 1), (21, 70, 37, 3, 20, 4), (5, 17, 130, 2, 16, 2)],
)
def test_triton_matches_reference(num_tokens, in_features, n, num_slots, max_rank, split_k):
    from loraplex.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    x, a, b_t, slots, ranks, scaling = _case(num_tokens, in_features, n, num_slots, max_rank, 7)
    meta = lora_kernel_meta(slots, num_slots)
    t_ref = torch.zeros(num_tokens, max_rank)
    t_tri = torch.zeros(num_tokens, max_rank)
    lora_shrink_ref(x, a, t_ref, meta, ranks)
    lora_shrink_triton(x, a, t_tri, meta, ranks, split_k=split_k)
    for i, s in enumerate(slots.tolist()):
        r = int(ranks[s]) if s >= 0 else 0
        torch.testing.assert_close(t_tri[i, :r], t_ref[i, :r], rtol=1e-4, atol=1e-4)

    base = torch.randn(num_tokens, n + 3)
    out_ref, out_tri = base.clone(), base.clone()
    lora_expand_ref(t_ref, b_t, out_ref, 3, meta, ranks, scaling)
    lora_expand_triton(t_ref, b_t, out_tri, 3, meta, ranks, scaling)
    torch.testing.assert_close(out_tri, out_ref, rtol=1e-4, atol=1e-4)
    base_rows = (slots < 0) | (ranks[slots.clamp(min=0).long()] == 0)
    assert torch.equal(out_tri[base_rows], base[base_rows])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_triton_bf16_on_gpu(num_tokens):
    x, a, b_t, slots, ranks, scaling = _case(num_tokens, 4096, 1024, 8, 16, 3, torch.bfloat16)
    x, a, b_t = x.cuda() / 8, a.cuda() / 8, b_t.cuda() / 8
    meta = lora_kernel_meta(slots.cuda(), 8)
    ranks, scaling = ranks.cuda(), scaling.cuda()
    out = torch.zeros(num_tokens, 1024, dtype=torch.bfloat16, device="cuda")
    t = torch.zeros(num_tokens, 16, device="cuda")
    lora_shrink(x, a, t, meta, ranks)
    lora_expand(t, b_t, out, 0, meta, ranks, scaling)
    expected = _dense_delta(x.cpu(), a.cpu(), b_t.cpu(), slots, ranks.cpu(), scaling.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2)
