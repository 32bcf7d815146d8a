"""What the runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt, then sampled tokens
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_blocks: int  # blocks held, in the runner's block-table row `row`
    row: int
    num_computed_tokens: int
    lora_slot: int
    banned_until_min: tuple[int, ...]  # EOS and stop ids, masked until min_tokens
    plain_greedy: bool  # argmax of the raw logits is all its sampling needs
    # Tokens sampled on the device whose values are not in `token_ids` yet (async scheduling):
    # the latest one is the next step's input, read from the device.
    num_pending: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens
