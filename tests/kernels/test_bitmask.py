"""The bitmask kernel family: allowed tokens keep their logits, every other one becomes -inf
(the torch reference, the Triton kernel, the checking entry and its warm-up)."""

from __future__ import annotations

import pytest
import torch

from loraplex.grammar.bitmask import allocate_token_bitmask
from loraplex.kernels.bitmask import apply_token_bitmask_
from loraplex.kernels.bitmask.reference import apply_token_bitmask_ref
from loraplex.kernels.bitmask.types import bitmask_words


def _random_case(rows: int, vocab: int, seed: int, mask_vocab: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < 0.3  # [rows, vocab]
    mask_vocab = mask_vocab or vocab
    allowed[:, mask_vocab:] = False
    bitmask = torch.zeros(rows, bitmask_words(mask_vocab), dtype=torch.int32)
    for row in range(rows):
        for token in allowed[row, :mask_vocab].nonzero().flatten().tolist():
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    logits = torch.randn(rows, vocab, generator=generator)
    return logits, bitmask, allowed


def _expected(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 31), (2, 32), (4, 33), (5, 1000)])
def test_reference_masks_exactly_the_disallowed_tokens(rows, vocab) -> None:
    logits, bitmask, allowed = _random_case(rows, vocab, seed=rows * vocab)
    expected = _expected(logits, allowed)
    apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(logits, expected)


def test_logits_wider_than_the_mask_are_masked() -> None:
    logits, bitmask, allowed = _random_case(2, 100, seed=1, mask_vocab=70)
    expected = _expected(logits, allowed)
    apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[:, 70:]).all()


def test_rows_index_masks_only_the_constrained_rows() -> None:
    logits, bitmask, allowed = _random_case(2, 77, seed=2)
    batch = torch.randn(5, 77)
    batch[[4, 1]] = logits
    untouched = batch[[0, 2, 3]].clone()
    apply_token_bitmask_(batch, bitmask, torch.tensor([4, 1]))
    assert torch.equal(batch[[4, 1]], _expected(logits, allowed))
    assert torch.equal(batch[[0, 2, 3]], untouched)


def test_all_ones_bitmask_changes_nothing() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    apply_token_bitmask_(logits, allocate_token_bitmask(3, 50))
    assert torch.equal(logits, before)


def test_shape_mismatches_raise() -> None:
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.randn(2, 64), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize(
    ("rows", "vocab", "use_rows"), [(1, 5, False), (3, 70, True), (2, 1030, False)]
)
def test_triton_kernel_matches_reference(rows, vocab, use_rows) -> None:
    from loraplex.kernels.bitmask.triton_bitmask import apply_token_bitmask_triton

    logits, bitmask, _ = _random_case(rows, vocab, seed=vocab)
    rows_index = torch.arange(rows - 1, -1, -1) if use_rows else None
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows_index)
    apply_token_bitmask_triton(logits, bitmask, rows_index)
    assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_reference(dtype) -> None:
    logits, bitmask, _ = _random_case(6, 49152 + 64, seed=3, mask_vocab=49152)
    logits = logits.to(dtype)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, torch.tensor([5, 0, 2, 1, 3, 4]))
    logits, bitmask = logits.cuda(), bitmask.cuda()
    apply_token_bitmask_(logits, bitmask, torch.tensor([5, 0, 2, 1, 3, 4], device="cuda"))
    assert torch.equal(logits.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_compiles_the_kernel_the_sampler_launches() -> None:
    """After the warm-up, a sampler-shaped call (rows index, fp32, a 49k vocabulary) finds
    its kernel compiled: the first grammar request of a server compiled it (1-2 s)."""
    from loraplex.kernels.bitmask import warm_up
    from loraplex.kernels.bitmask.triton_bitmask import _apply_bitmask_kernel

    device = torch.device("cuda")
    assert warm_up(49152, device) == 1
    compiled = sum(len(c[0]) for c in _apply_bitmask_kernel.device_caches.values())
    logits, bitmask, rows = _random_case(8, 49152, seed=5, mask_vocab=49152)
    logits, bitmask = logits.float().cuda(), bitmask[:3].cuda()
    apply_token_bitmask_(logits, bitmask, torch.tensor([7, 0, 4], device=device))
    assert sum(len(c[0]) for c in _apply_bitmask_kernel.device_caches.values()) == compiled


def test_warm_up_is_a_no_op_off_cuda() -> None:
    from loraplex.kernels.bitmask import warm_up

    assert warm_up(49152, torch.device("cpu")) == 0
