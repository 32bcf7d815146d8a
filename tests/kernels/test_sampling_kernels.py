"""Sampling kernels: the Triton draw against its torch reference (greedy rows, thresholds,
masked tokens, rows split over programs), and truncation thresholds on known rows."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels.sampling.reference import (
    apply_penalties_ref,
    draw_ref,
    logprobs_ref,
    truncation_thresholds_ref,
)

INF = float("inf")
# The Triton kernels run compiled on a GPU, else in the interpreter (tests/kernels/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(n: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[0, vocab // 2 :] = -INF  # a grammar-masked tail
    temperature = torch.rand(n, generator=gen) * 1.5 + 0.1
    temperature[1 % n] = 0.0  # greedy
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    steps = torch.randint(0, 2**40, (n,), generator=gen)
    top_k = torch.randint(0, 40, (n,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.1
    min_p = torch.rand(n, generator=gen) * 0.2
    columns = (logits, temperature, seeds, steps, top_k, top_p, min_p)
    return tuple(c.to(DEVICE) for c in columns)


@pytest.mark.parametrize("n,vocab,chunks", [(1, 1, 1), (5, 1000, 1), (4, 3001, 2), (3, 4099, 4)])
def test_triton_draw_matches_reference(n: int, vocab: int, chunks: int) -> None:
    from loraplex.kernels.sampling.triton_sampling import draw_triton

    logits, temperature, seeds, steps, top_k, top_p, min_p = _rows(n, vocab, vocab)
    thresholds = truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)
    for tau in (None, thresholds):
        ref = draw_ref(logits, temperature, tau, seeds, steps)
        out = draw_triton(logits, temperature, tau, seeds, steps, num_chunks=chunks)
        assert torch.equal(out, ref)
        if tau is not None:
            kept = logits.gather(1, out[:, None]).squeeze(1) >= tau
            assert bool(kept[temperature > 0].all())


@pytest.mark.parametrize("n,vocab,chunks", [(1, 5, 1), (6, 1000, 1), (5, 3001, 3), (4, 77, 2)])
def test_triton_thresholds_match_reference(n: int, vocab: int, chunks: int) -> None:
    from loraplex.kernels.sampling.triton_truncation import truncation_thresholds_triton

    logits, temperature, _, _, top_k, top_p, min_p = _rows(n, vocab, vocab + 1)
    top_k[2 % n] = 0  # top-p alone
    top_p[3 % n] = 1.0  # top-k alone
    ref = truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)
    out = truncation_thresholds_triton(logits, temperature, top_k, top_p, min_p, num_chunks=chunks)
    # top-k / top-p thresholds are logits of the row, exactly; min-p's log may differ in an ulp
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    # one phase of passes is enough when no row has both top-k and top-p
    top_p = torch.where(top_k > 0, 1.0, top_p)
    one_phase = truncation_thresholds_triton(
        logits, temperature, top_k, top_p, min_p, both=False, num_chunks=chunks
    )
    ref = truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(one_phase, ref, rtol=1e-6, atol=0)
    no_search = truncation_thresholds_triton(
        logits, temperature, top_k, top_p, min_p, search=False, num_chunks=chunks
    )
    off = torch.zeros_like(top_k)
    min_p_only = truncation_thresholds_ref(logits, temperature, off, torch.ones_like(top_p), min_p)
    torch.testing.assert_close(no_search, min_p_only, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n,vocab,with_prompt", [(1, 7, True), (3, 2049, True), (4, 300, False)])
def test_triton_penalties_match_reference(n: int, vocab: int, with_prompt: bool) -> None:
    from loraplex.kernels.sampling.triton_sampling import apply_penalties_triton

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=gen) * 3
    counts = torch.randint(0, 4, (n, vocab), generator=gen, dtype=torch.int32)
    prompt = torch.rand(n, vocab, generator=gen) < 0.3 if with_prompt else None
    rep = torch.rand(n, generator=gen) + 0.5
    presence, freq = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    args = [logits, counts, prompt, rep, presence, freq]
    ref = apply_penalties_ref(*args)
    out = apply_penalties_triton(*[a if a is None else a.to(DEVICE) for a in args])
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,vocab,k", [(3, 5000, 5), (2, 77, 0), (1, 3000, 20), (4, 2500, 3)])
def test_triton_logprobs_match_reference(n: int, vocab: int, k: int) -> None:
    from loraplex.kernels.sampling.triton_logprobs import logprobs_triton

    gen = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(n, vocab, generator=gen) * 3
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    ref = logprobs_ref(logits, tokens, k)
    out = logprobs_triton(logits.to(DEVICE), tokens.to(DEVICE), k)
    token_lp, ranks, top_ids, top_lp = (t.cpu() for t in out)
    torch.testing.assert_close(token_lp, ref[0], rtol=0, atol=1e-5)
    assert torch.equal(ranks, ref[1])
    assert torch.equal(top_ids, ref[2])
    torch.testing.assert_close(top_lp, ref[3], rtol=0, atol=1e-5)


def test_greedy_draw_breaks_ties_like_argmax() -> None:
    from loraplex.kernels.sampling.triton_sampling import draw_triton

    logits = torch.zeros(3, 2500)
    logits[0, [7, 1500, 2400]] = 5.0
    logits[1] = -INF  # fully masked row: token 0, as torch.argmax
    logits[2, [2047, 2048]] = 1.0  # a tie across two programs
    temperature = torch.zeros(3, device=DEVICE)
    zeros = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    out = draw_triton(logits.to(DEVICE), temperature, None, zeros, zeros, num_chunks=2)
    assert out.tolist() == logits.argmax(dim=-1).tolist() == [7, 0, 2047]


def test_thresholds_of_known_rows() -> None:
    ln2 = math.log(2.0)
    # softmax = [1/2, 1/4, 1/8, 1/16, 1/16] exactly
    row = torch.tensor([0.0, -ln2, -2 * ln2, -3 * ln2, -3 * ln2])
    logits = row.repeat(6, 1)
    temperature = torch.ones(6)
    top_k = torch.tensor([2, 0, 0, 0, 4, 5], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.75, 0.7500001, 0.5, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2])
    tau = truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)
    kept = (logits >= tau[:, None]).sum(dim=-1).tolist()
    from loraplex.kernels.sampling.triton_truncation import truncation_thresholds_triton

    args = (logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE))
    assert torch.equal(truncation_thresholds_triton(*args, min_p.to(DEVICE)).cpu(), tau)
    # top-k 2; top-p exactly on the 3/4 boundary keeps 2; just past it 3; 1/2 keeps 1;
    # top-k 4 keeps the tie at the 4th place (5); top-k = vocab is off; min-p 0.2 of 1/2
    # keeps p >= 0.1 (3 tokens)
    assert kept == [2, 2, 3, 1, 5, 3]


def test_warm_up_is_a_no_op_off_cuda() -> None:
    from loraplex.kernels.sampling import warm_up

    assert warm_up(1000, torch.device("cpu"), 8) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles CUDA kernels")
def test_no_batch_size_compiles_a_kernel_after_warm_up(monkeypatch) -> None:
    """A served batch of any size, with any sampling parameters, reuses the kernels that the
    start-up warm-up compiled: a compile would stall the engine for ~0.1 s."""
    from triton.runtime.jit import JITFunction

    from loraplex.kernels.sampling import (
        apply_penalties,
        compute_logprobs,
        draw,
        truncation_thresholds,
        warm_up,
    )

    vocab, max_rows, dev = 32000, 96, torch.device("cuda")
    warm_up(vocab, dev, max_rows)
    compiled: list[str] = []
    original = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    # Parameter columns sliced out of one block, as the input batch holds them (odd offsets).
    block = torch.rand(8, max_rows + 3, device=dev)
    for n in (1, 2, 3, 16, 17, 33, 64, 95, 96):
        logits = torch.randn(n, vocab, device=dev) * 3
        temperature = block[1, 3 : 3 + n] + 0.5
        top_k = (block[2, :n] * 100).int()
        top_p, min_p = block[3, 1 : 1 + n], block[4, :n] * 0.1
        seeds = torch.randint(0, 2**62, (n,), device=dev)
        steps = torch.randint(0, 2**20, (n,), device=dev)
        for search, both in ((True, True), (True, False), (False, False)):
            tau = truncation_thresholds(logits, temperature, top_k, top_p, min_p, search, both)
        tokens = draw(logits, temperature, tau, seeds, steps)
        draw(logits, temperature, None, seeds, steps)
        counts = torch.randint(0, 3, (n, vocab), dtype=torch.int32, device=dev)
        apply_penalties(logits, counts, counts > 1, block[5, :n], block[6, :n], block[7, :n])
        for k in (0, 1, 3, 5, 20):
            compute_logprobs(logits, tokens, k)
    torch.cuda.synchronize()
    assert compiled == []
