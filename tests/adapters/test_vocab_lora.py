"""The embedding and lm_head LoRA hooks against their dense formulas, per token by slot, with
the torch references and with the Triton kernels (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.lora_layer import LoRABatchMeta, LoRAModelState
from loraplex.adapters.peft_format import EMBED_KEY, LM_HEAD_KEY, LoRAModuleWeights, LoRAWeights
from loraplex.adapters.slot_memory import SlotMemory
from loraplex.adapters.vocab_lora import EmbeddingLoRA, LMHeadLoRA
from loraplex.kernels.lora import LoRAKernelConfig, lora_triton

VOCAB, HIDDEN, MAX_RANK, SLOTS = 50, 24, 8, 3


def _adapter(seed: int, rank: int) -> LoRAWeights:
    gen = torch.Generator().manual_seed(seed)
    embed = LoRAModuleWeights(torch.randn(rank, VOCAB, generator=gen),
                              torch.randn(HIDDEN, rank, generator=gen), 0.5 * seed)  # fmt: skip
    head = LoRAModuleWeights(torch.randn(rank, HIDDEN, generator=gen),
                             torch.randn(VOCAB, rank, generator=gen), 2.0)  # fmt: skip
    return LoRAWeights(f"a{seed}", f"d{seed}", {EMBED_KEY: embed, LM_HEAD_KEY: head})


@pytest.fixture
def hooks():
    cpu = torch.device("cpu")
    meta = LoRABatchMeta(SLOTS, MAX_RANK, 32, cpu)
    shapes = [kind.slot_shapes(VOCAB, HIDDEN, MAX_RANK) for kind in (EmbeddingLoRA, LMHeadLoRA)]
    memory = SlotMemory(SLOTS, shapes, torch.float32, cpu)
    embed = EmbeddingLoRA(meta, VOCAB, HIDDEN, MAX_RANK, torch.float32, cpu, memory)
    head = LMHeadLoRA(meta, VOCAB, HIDDEN, MAX_RANK, torch.float32, cpu, memory)
    state = LoRAModelState(meta, memory, (), (embed, head))
    adapters = {0: _adapter(1, 8), 2: _adapter(2, 3)}  # slot 1 stays empty (rank 0)
    for slot, weights in adapters.items():
        state.load_slot(slot, weights)
    return meta, embed, head, adapters


def _expected(adapters, slots, ids, hidden, logits):
    embed_out, logits_out = hidden.clone(), logits.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot in adapters:
            e, h = adapters[slot].modules[EMBED_KEY], adapters[slot].modules[LM_HEAD_KEY]
            embed_out[i] += e.scaling * e.a[:, ids[i]] @ e.b.T
            logits_out[i] += h.scaling * (hidden[i] @ h.a.T) @ h.b.T
    return embed_out, logits_out


@pytest.mark.parametrize("regime", [None, "decode", "token", "group"])
def test_hooks_add_each_tokens_adapter_delta(hooks, monkeypatch, regime):
    meta, embed, head, adapters = hooks
    if regime is not None:  # the CUDA path's kernels, interpreted, in one regime
        config = LoRAKernelConfig(
            decode_max_tokens=64 if regime == "decode" else 0,
            token_kernels_max_tokens=64 if regime == "token" else 0,
            decode_block_k=16, decode_k_per_split=16, decode_block_n=16, shrink_block_k=16,
            expand_block_n=16, group_block_m=16, group_block_n=16,
        )  # fmt: skip

        def run(x, out, lora, kernel_meta, workspace, config_=None, counters=None):
            lora_triton(x, out, lora, kernel_meta, workspace, config, counters)

        monkeypatch.setattr("loraplex.adapters.vocab_lora.add_lora", run)
    gen = torch.Generator().manual_seed(9)
    slots = torch.tensor([0, -1, 2, 1, 0, 2, -1, 0], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (len(slots),), generator=gen)
    hidden = torch.randn(len(slots), HIDDEN, generator=gen)
    logits = torch.randn(len(slots), VOCAB, generator=gen)
    meta.set(slots)
    embed_out, logits_out = hidden.clone(), logits.clone()
    embed(ids, embed_out)
    head(hidden, logits_out, None)
    want_embed, want_logits = _expected(adapters, slots, ids, hidden, logits)
    torch.testing.assert_close(embed_out, want_embed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits_out, want_logits, rtol=1e-4, atol=1e-4)
    # rows of a subset of the tokens (sampled rows) read their own tokens' slots
    rows = torch.tensor([5, 1, 0])
    sub = logits[rows].clone()
    head(hidden[rows], sub, rows)
    torch.testing.assert_close(sub, want_logits[rows], rtol=1e-4, atol=1e-4)


def test_no_adapter_token_leaves_embeddings_and_logits_alone(hooks):
    meta, embed, head, _ = hooks
    meta.set(torch.full((4,), -1, dtype=torch.int32))
    hidden, logits = torch.randn(4, HIDDEN), torch.randn(4, VOCAB)
    before = hidden.clone(), logits.clone()
    embed(torch.arange(4), hidden)
    head(hidden, logits, None)
    assert torch.equal(hidden, before[0]) and torch.equal(logits, before[1])
