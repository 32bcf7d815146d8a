"""Exact acceptance of proposed tokens (speculative sampling, Leviathan et al. / Chen et al.).

Row i verifies `draft_lens[i]` = k_i drafts d_0..d_{k_i-1}; the target computed its sampling
distribution p_j at each of the k_i + 1 positions (the full pipeline: penalties, bans,
temperature, top-k / top-p / min-p). Position j accepts d_j with probability
min(1, p_j(d_j) / q_j(d_j)); the first rejection emits a token drawn from
normalise(max(0, p_j - q_j)) and ends the row; a row that accepts all k_i drafts emits a
bonus token drawn from p_{k_i}. Every emitted token is then distributed exactly as
non-speculative sampling would draw it.

A proposer without a distribution (n-gram) proposes point masses q_j = 1[d_j]: accept with
probability p_j(d_j), on rejection draw from p_j with d_j removed. That is what comparing d_j
with the target's own draw y_j ~ p_j does (`verify_point_drafts`): P(y_j = d_j) = p_j(d_j),
and y_j given y_j != d_j is p_j without d_j, renormalised. Drawing y_j with the same
counter-based noise (seed, step + j) as a non-speculative step makes a seeded request emit the
very tokens it would emit without speculation; greedy rows are the argmax case of the same rule.
"""

from __future__ import annotations

import torch

from loraplex.kernels.sampling import draw, truncation_thresholds
from loraplex.kernels.sampling.reference import philox4x32_ref, uniform_from_word
from loraplex.platform.runner.sampling_metadata import SamplingMetadata

_M32 = 0xFFFFFFFF
_ACCEPT_STREAM = 1  # Philox's fourth counter word: the draw's noise uses 0


def acceptance_uniforms(
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64, the step of each row's first draft
    num_positions: int,
) -> torch.Tensor:
    """Counter-based uniforms in (0, 1) for the accept tests of positions 0..K-1, keyed by
    (seed, step + j) on a stream of their own (independent of the draw's noise). -> [n, K]"""
    offsets = torch.arange(num_positions, device=seeds.device)
    s = steps[:, None] + offsets[None, :]  # [n, K]
    key = seeds[:, None].expand_as(s)
    zero = torch.zeros_like(s)
    word, _, _, _ = philox4x32_ref(
        zero, s & _M32, (s >> 32) & _M32, zero + _ACCEPT_STREAM, key & _M32, (key >> 32) & _M32
    )
    return uniform_from_word(word)


def emit_tokens(
    accept: torch.Tensor,  # [n, K] bool, whether position j's draft passed its test
    drafts: torch.Tensor,  # [n, K] int64 (padding ignored)
    recovered: torch.Tensor,  # [n, K] int64, the token emitted if position j rejects
    bonus_source: torch.Tensor,  # [n, K + 1] int64, the target's draw at each position
    draft_lens: torch.Tensor,  # [n] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row emits: its accepted prefix of drafts, then the recovered token of
    its first rejection, or the bonus (the draw at position k_i) when all pass.
    -> (tokens [n, K + 1] int64, valid up to num_emitted, num_emitted [n] int64 in 1..k_i+1)"""
    n, k = drafts.shape
    pos = torch.arange(k + 1, device=drafts.device)[None, :]  # [1, K + 1]
    valid = pos[:, :k] < draft_lens[:, None]  # [n, K]
    num_accepted = torch.cumprod((accept & valid).to(torch.int64), dim=1).sum(dim=1)  # [n]
    pad = torch.zeros((n, 1), dtype=torch.int64, device=drafts.device)
    tokens = torch.where(
        pos < num_accepted[:, None],
        torch.cat([drafts, pad], dim=1),
        torch.where(pos < draft_lens[:, None], torch.cat([recovered, pad], dim=1), bonus_source),
    )
    return tokens, num_accepted + 1


def verify_point_drafts(
    targets: torch.Tensor,  # [n, K + 1] int64, the target's draw (or argmax) per position
    drafts: torch.Tensor,  # [n, K] int64
    draft_lens: torch.Tensor,  # [n] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Point-mass proposals (n-gram, or a greedy draft for a greedy row): accept d_j iff the
    target's own draw at j is d_j; the first mismatch emits that draw. -> `emit_tokens`'"""
    return emit_tokens(targets[:, :-1] == drafts, drafts, targets[:, :-1], targets, draft_lens)


def verify_sampled_drafts(
    targets: torch.Tensor,  # [n, K + 1] int64, the target's draw per position
    drafts: torch.Tensor,  # [n, K] int64
    draft_lens: torch.Tensor,  # [n] int64
    target_probs: torch.Tensor,  # [n, K, vocab] fp32, p_j
    draft_probs: torch.Tensor,  # [n, K, vocab] fp32, q_j (d_j was drawn from it)
    greedy: torch.Tensor,  # [n] bool: these rows use the point-mass rule
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64, the step of position 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts drawn from distributions q_j: accept with min(1, p/q), recover from
    max(0, p - q). -> `emit_tokens`'"""
    n, k = drafts.shape
    d = drafts.clamp(min=0)[..., None]  # [n, K, 1]
    p_x = target_probs.gather(2, d).squeeze(2)  # [n, K]
    q_x = draft_probs.gather(2, d).squeeze(2)  # [n, K]
    u = acceptance_uniforms(seeds, steps, k)  # [n, K]
    accept = u * q_x < p_x  # NOTE: u < p / q without dividing by a zero q
    residual = (target_probs - draft_probs).clamp(min=0.0)  # [n, K, vocab]
    flat_steps = (steps[:, None] + torch.arange(k, device=steps.device)[None, :]).reshape(-1)
    recovered = draw(
        torch.log(residual.reshape(n * k, -1)),
        torch.ones(n * k, device=drafts.device),
        None,
        seeds.repeat_interleave(k),
        flat_steps,
    ).view(n, k)
    accept = torch.where(greedy[:, None], targets[:, :-1] == drafts, accept)
    recovered = torch.where(greedy[:, None], targets[:, :-1], recovered)
    return emit_tokens(accept, drafts, recovered, targets, draft_lens)


def sampling_probs(
    logits: torch.Tensor,  # [n, vocab] fp32, processed (penalties, bans, masks applied)
    metadata: SamplingMetadata,
) -> torch.Tensor:
    """The distribution a non-greedy row samples from: softmax(logits / T) over the tokens
    top-k, top-p and min-p keep. -> [n, vocab] fp32 (greedy rows: unused values)"""
    t = torch.where(metadata.temperature < 1e-5, 1.0, metadata.temperature)  # [n]
    scaled = logits / t[:, None]
    if metadata.any_top_k_top_p or metadata.any_min_p:
        tau = truncation_thresholds(
            logits, metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p,
            metadata.any_top_k_top_p, metadata.any_top_k_and_top_p,
        )  # fmt: skip
        scaled = scaled.masked_fill(logits < tau[:, None], float("-inf"))
    return torch.softmax(scaled, dim=-1)
