"""HF transformers on the very same weights as a loraplex engine: the baseline we compare to."""

from __future__ import annotations

import torch

from benchmarks.common.timing import wall_seconds
from loraplex.platform.models.dummy_weights import hf_state_dict


def hf_model_from_engine(llm, dtype: torch.dtype):
    """A transformers LlamaForCausalLM holding copies of the engine's weights."""
    import transformers

    arch = llm.engine.runner.arch
    config = transformers.AutoConfig.for_model(**arch.raw)
    device = llm.engine.runner.device
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = model.load_state_dict(
        hf_state_dict(llm.engine.runner.model), strict=False
    )
    tied = arch.tie_word_embeddings
    real_missing = [
        m for m in missing if "rotary" not in m and not (tied and m == "lm_head.weight")
    ]
    if real_missing or unexpected:
        raise RuntimeError(
            f"weights did not map onto HF: missing {real_missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model.eval()


@torch.inference_mode()
def hf_generate_static(
    model, prompts: list[list[int]], max_new: list[int], pad_id: int = 0, **generate_kwargs
) -> tuple[float, int]:
    """One left-padded static batch generating max(max_new) tokens for everyone; returns
    (seconds, useful output tokens = sum(max_new))."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    n = max(max_new)
    seconds = wall_seconds(
        lambda: model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
            **generate_kwargs,
        )
    )
    return seconds, sum(max_new)
