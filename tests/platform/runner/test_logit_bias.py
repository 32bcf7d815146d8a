"""OpenAI's logit_bias on the device sampler: a sparse (row, token, value) list gathered by the
InputBatch for the rows that have one, added to the logits before sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import SamplingParams
from loraplex.platform.core.scheduler_output import NewRequestData
from loraplex.platform.runner.input_batch import InputBatch
from loraplex.platform.runner.sampler import Sampler
from loraplex.platform.runner.sampling_metadata import build_sampling_metadata

VOCAB = 40


def _new(req_id: str, **kw) -> NewRequestData:
    return NewRequestData(req_id, [1, 2], [], SamplingParams(seed=1, **kw), [0], 0)


def test_bias_moves_greedy_and_sampled_rows_only_where_set():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    top = logits.argmax(-1)
    bias = [(0, 7, 100.0), (1, int(top[1]), -100.0)]
    for temperature in (0.0, 1.0):
        meta = build_sampling_metadata(3, VOCAB, temperature=temperature, logit_bias=bias)
        out = Sampler()(logits, meta).token_ids
        assert out[0] == 7 and out[1] != top[1]
        if temperature == 0.0:
            assert out[2] == top[2]  # row 2 has no bias
    assert torch.equal(logits.argmax(-1), top)  # the caller's logits are not modified


def test_input_batch_gathers_biases_of_the_sampled_rows_in_logits_order():
    ib = InputBatch(4, 32, 8, VOCAB, torch.device("cpu"))
    ib.add([_new("a", temperature=0.0), _new("b", temperature=0.0, logit_bias={5: 3.0, 99: 1.0})])
    assert not ib.plain_greedy  # a biased greedy row needs the sampler
    meta = ib.sampling_metadata(np.array([1, 0]), torch.tensor([1, 0]))
    bias = meta.logit_bias
    assert bias is not None  # id 99 is past the vocabulary: left out
    assert bias.rows.tolist() == [0] and bias.token_ids.tolist() == [5]
    assert bias.values.tolist() == [3.0]
    ib.remove("b")
    ib.condense()
    assert ib.plain_greedy and ib.sampling_metadata(np.arange(1), None).logit_bias is None


def test_sampling_params_check_logit_bias():
    assert SamplingParams(logit_bias={3: 1.5}).logit_bias == ((3, 1.5),)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
