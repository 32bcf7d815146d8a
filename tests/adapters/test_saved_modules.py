"""Full embed_tokens / lm_head copies applied by slot: each token's embedding row and each row's
logits come from its adapter's copy, base rows and other adapters' rows are untouched, and the
CUDA-graph path (every copy slot, masked) gives the same as the eager one."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.lora_layer import LoRABatchMeta
from loraplex.adapters.peft_format import LoRAModuleWeights, LoRAWeights
from loraplex.adapters.peft_saved import TrainedTokens
from loraplex.adapters.saved_modules import SavedModules

VOCAB, HIDDEN = 40, 8


def _adapter(gen: torch.Generator, **extras) -> LoRAWeights:
    module = LoRAModuleWeights(torch.zeros(2, HIDDEN), torch.zeros(HIDDEN, 2), 1.0)
    return LoRAWeights("a", "a", {(0, "q_proj"): module}, **extras)


@pytest.mark.parametrize("as_in_a_graph", [False, True])
def test_each_row_uses_its_adapters_copy(monkeypatch, as_in_a_graph):
    if as_in_a_graph:
        monkeypatch.setattr(SavedModules, "_capturing", staticmethod(lambda device: True))
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    meta = LoRABatchMeta(num_slots=4, max_rank=2, max_num_tokens=16, device=torch.device("cpu"))
    saved = SavedModules(meta, 2, embed, head, VOCAB)
    head_copy = torch.randn(VOCAB, HIDDEN, generator=gen)
    embed_copy = torch.randn(VOCAB, HIDDEN, generator=gen)
    rows = TrainedTokens(torch.tensor([3, 7]), torch.randn(2, HIDDEN, generator=gen))
    saved.load_slot(0, _adapter(gen, saved={"lm_head": head_copy, "embed_tokens": embed_copy}))
    saved.load_slot(1, _adapter(gen, tokens={"embed_tokens": rows}))
    saved.load_slot(2, _adapter(gen))  # plain LoRA beyond the copy slots
    with pytest.raises(ValueError, match="holds no lm_head copy"):
        saved.load_slot(3, _adapter(gen, saved={"lm_head": head_copy}))

    slots = torch.tensor([0, 1, -1, 2, 1, 0, 3], dtype=torch.int32)
    input_ids = torch.tensor([3, 3, 3, 3, 7, 5, 9])
    meta.set(slots)
    hidden = embed[input_ids].clone()
    saved.embed(input_ids, hidden)
    token_table = embed.clone()
    token_table[rows.indices] = rows.values
    expected = embed[input_ids].clone()
    expected[0], expected[5] = embed_copy[3], embed_copy[5]
    expected[1], expected[4] = token_table[3], token_table[7]
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)

    h = torch.randn(7, HIDDEN, generator=gen)
    logits = h @ head.T
    base_logits = logits.clone()
    saved.logits(h, logits, None)
    torch.testing.assert_close(logits[[0, 5]], h[[0, 5]] @ head_copy.T)
    torch.testing.assert_close(logits[[1, 2, 3, 4, 6]], base_logits[[1, 2, 3, 4, 6]])
    # rows scored apart (sampled rows, prompt logprobs): each row's slot comes from its token
    picked = torch.tensor([5, 2])
    logits = h[picked] @ head.T
    saved.logits(h[picked], logits, picked)
    torch.testing.assert_close(logits[0], h[5] @ head_copy.T)
    torch.testing.assert_close(logits[1], h[2] @ head.T)

    saved.load_slot(0, _adapter(gen))  # a plain adapter replaces the one with copies
    logits = h @ head.T
    saved.logits(h, logits, None)
    torch.testing.assert_close(logits, base_logits)
