"""The persistent InputBatch: rows stay compact, parameters land in their device columns, and
penalty counts follow the sampled tokens on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import SamplingParams
from loraplex.platform.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from loraplex.platform.runner.batch import PENDING, build_batch
from loraplex.platform.runner.input_batch import InputBatch, seed_as_int64

VOCAB = 50
BLOCK = 4


def _batch(max_seqs: int = 8) -> InputBatch:
    ib = InputBatch(max_seqs, 64, 16, VOCAB, torch.device("cpu"))
    ib.eos_token_ids = (2,)
    return ib


def _new(req_id: str, prompt: list[int], out: list[int] = (), computed: int = 0, **kw):
    params = SamplingParams(**{"seed": 1, "max_tokens": 32, **kw})
    n = len(prompt) + len(out)
    return NewRequestData(
        req_id, list(prompt), list(out), params, list(range(-(-n // BLOCK) + 1)), computed
    )


def _apply(ib: InputBatch, finished=(), new=(), cached=()) -> None:
    for r in finished:
        ib.remove(r)
    ib.condense()
    ib.add(list(new))
    ib.update(cached)


def _step(req_counts: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], [], dict(req_counts), sum(req_counts.values()))


def test_columns_hold_each_requests_parameters():
    ib = _batch()
    _apply(
        ib,
        new=[
            _new("a", [5, 6, 7], temperature=0.0),
            _new("b", [8, 9], temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=2**64 + 3),
            _new("c", [10], temperature=1.0, presence_penalty=0.5, logprobs=3, min_tokens=2,
                 stop_token_ids=[11, 12]),
        ],
    )  # fmt: skip
    rows = np.arange(3)
    meta = ib.sampling_metadata(rows, None)
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert meta.top_k.tolist() == [0, 5, 0]
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert meta.presence_penalty.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert meta.seeds.tolist() == [1, 3, 1]
    assert meta.steps.tolist() == [0, 0, 0]
    assert meta.min_tokens.tolist() == [0, 0, 2]
    assert meta.banned_token_ids is not None
    assert meta.banned_token_ids[2, :3].tolist() == [2, 11, 12]
    assert (meta.banned_token_ids[:2] == -1).all()
    assert meta.max_num_logprobs == 3
    assert meta.num_logprobs is not None and meta.num_logprobs.tolist() == [-1, -1, 3]
    assert not meta.all_greedy and meta.any_top_k_top_p and meta.any_min_p
    assert meta.any_top_k_and_top_p  # b has both
    assert meta.any_penalties and meta.output_counts is not None
    assert meta.prompt_mask is None  # no repetition penalty in the batch
    assert not ib.plain_greedy


def test_seed_wraps_to_int64():
    assert seed_as_int64(5) == 5
    assert seed_as_int64(-5) == -5
    assert seed_as_int64(2**63) == -(2**63)
    assert seed_as_int64(2**64 + 7) == 7


def test_freed_rows_are_filled_by_the_last_rows():
    ib = _batch()
    _apply(ib, new=[_new(r, [i + 1] * (i + 1), temperature=0.1 * i) for i, r in enumerate("abcde")])
    assert ib.req_ids[:5] == list("abcde")
    _apply(ib, finished=["b", "d"], new=[_new("f", [9, 9], temperature=1.5)])
    # e fills b's row, the row count shrinks to 3 live, and f is appended after them.
    assert ib.req_ids[:4] == ["a", "e", "c", "f"] and ib.num_reqs == 4
    assert ib.req_index == {"a": 0, "e": 1, "c": 2, "f": 3}
    assert ib.token_ids[1, :5].tolist() == [5] * 5 and ib.num_tokens[1] == 5
    meta = ib.sampling_metadata(np.arange(4), None)
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.4, 0.2, 1.5])


def test_penalty_counts_follow_sampled_tokens_and_moves():
    ib = _batch()
    _apply(
        ib,
        new=[
            _new("x", [1, 2], temperature=1.0),
            _new("p", [3, 3, 4], [7, 7], temperature=1.0, repetition_penalty=1.2),
        ],
    )
    assert ib.output_counts is not None and ib.prompt_mask is not None
    assert ib.output_counts[1, 7].item() == 2 and ib.output_counts[1].sum().item() == 2
    assert ib.prompt_mask[1].nonzero().flatten().tolist() == [3, 4]
    meta = ib.sampling_metadata(np.arange(2), None)
    assert meta.steps.tolist() == [0, 2]
    # One step samples both rows (no index: rows 0..1), then only row 1 (with an index).
    ib.record_sampled(torch.tensor([9, 8]), np.arange(2), None)
    ib.record_sampled(torch.tensor([8]), np.array([1]), torch.tensor([1]))
    assert ib.output_counts[1, 8].item() == 2 and ib.output_counts[1, 7].item() == 2
    assert ib.last_token[:2].tolist() == [9, 8]
    assert ib.sampling_metadata(np.arange(2), None).steps.tolist() == [1, 4]
    # x finishes: p moves to row 0 with its counts, prompt mask, step and latest token.
    _apply(ib, finished=["x"])
    assert ib.req_index == {"p": 0}
    assert ib.output_counts[0, 8].item() == 2 and ib.output_counts[0, 7].item() == 2
    assert ib.prompt_mask[0].nonzero().flatten().tolist() == [3, 4]
    assert ib.last_token[0].item() == 8
    meta = ib.sampling_metadata(np.arange(1), None)
    assert meta.steps.tolist() == [4] and meta.repetition_penalty.tolist() == pytest.approx([1.2])
    # Re-added after a preemption: counts rebuilt from the tokens the scheduler knows.
    _apply(ib, finished=["p"], new=[_new("p", [3, 3, 4], [7, 7, 8], repetition_penalty=1.2)])
    assert ib.output_counts[0].tolist().count(0) == VOCAB - 2
    assert ib.output_counts[0, 7].item() == 2 and ib.output_counts[0, 8].item() == 1


def test_host_flags_follow_adds_and_removes():
    ib = _batch()
    _apply(ib, new=[_new("g", [1], temperature=0.0)])
    assert ib.plain_greedy and ib.sampling_metadata(np.arange(1), None).all_greedy
    _apply(ib, new=[_new("s", [1], temperature=0.8, top_k=3, logprobs=2)])
    meta = ib.sampling_metadata(np.arange(2), None)
    assert not ib.plain_greedy and not meta.all_greedy and meta.max_num_logprobs == 2
    _apply(ib, finished=["s"])
    meta = ib.sampling_metadata(np.arange(1), None)
    assert ib.plain_greedy and meta.all_greedy and not meta.any_top_k_top_p
    assert not meta.any_top_k_and_top_p
    assert meta.max_num_logprobs is None and meta.output_counts is None


def test_min_tokens_ban_lifts_once_reached():
    ib = _batch()
    _apply(ib, new=[_new("m", [1, 2], min_tokens=2)])
    assert ib.sampling_metadata(np.arange(1), None).banned_token_ids is not None
    for token in (5, 6):
        ib.record_sampled(torch.tensor([token]), np.arange(1), None)
        ib.receive(["m"], ib.generations(np.arange(1)), [token])
    assert ib.sampling_metadata(np.arange(1), None).banned_token_ids is None


def test_receive_skips_a_request_re_added_since():
    ib = _batch()
    _apply(ib, new=[_new("r", [1, 2])])
    gens = ib.generations(np.arange(1))
    ib.record_sampled(torch.tensor([4]), np.arange(1), None)
    _apply(ib, finished=["r"], new=[_new("r", [1, 2])])  # preempted, then re-added
    assert ib.receive(["r"], gens, [4]) == {"r": 4}
    assert ib.num_tokens[0] == 2 and ib.num_pending[0] == 0


def test_decode_batch_of_a_compact_batch_needs_no_index():
    ib = _batch()
    _apply(ib, new=[_new("a", [1, 2, 3], temperature=0.5), _new("b", [4, 5], temperature=0.5)])
    # Prefill both (b first in the scheduler's order: the batch runs in row order).
    so = _step({"b": 2, "a": 3})
    batch = build_batch(ib, so, BLOCK, set(), need_sampler=False)
    assert batch.sample_req_ids == ["a", "b"]
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert batch.logits_indices.tolist() == [2, 4]
    assert batch.sample_index is None and batch.sampling is not None
    ib.record_sampled(torch.tensor([7, 8]), batch.sample_rows, batch.sample_index)
    _apply(ib, cached=[CachedRequestData("a", [], 3), CachedRequestData("b", [], 2)])
    # Async: the next step is built before the tokens are read back: both inputs pending.
    decode = build_batch(ib, _step({"a": 1, "b": 1}), BLOCK, set(), need_sampler=False)
    assert decode.is_decode and decode.input_ids.tolist() == [PENDING, PENDING]
    assert decode.pending_index is None and decode.sample_index is None
    assert decode.positions.tolist() == [3, 2] and decode.seq_lens.tolist() == [4, 3]
    ids = torch.full((2,), -5, dtype=torch.long)
    from loraplex.platform.runner.batch import fill_pending

    fill_pending(ids, decode, ib.last_token)
    assert ids.tolist() == [7, 8]


def test_partial_steps_upload_one_index():
    ib = _batch()
    _apply(ib, new=[_new(r, [1, 2, 3, 4, 5, 6], temperature=0.5) for r in "abc"])
    for r in "abc":
        ib.update([CachedRequestData(r, [], 5)])
    # Only b and c run; c finishes its prompt and samples, b has its last token pending.
    ib.num_tokens[1], ib.num_pending[1] = 5, 1
    batch = build_batch(ib, _step({"c": 1, "b": 1}), BLOCK, set(), need_sampler=False)
    assert batch.sample_rows.tolist() == [1, 2]
    assert batch.sample_index is not None and batch.sample_index.tolist() == [1, 2]
    assert batch.pending_index is not None
    assert [t.tolist() for t in batch.pending_index] == [[0], [1]]
    assert batch.sampling is not None and batch.sampling.temperature.shape == (2,)
