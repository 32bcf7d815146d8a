"""Counter-based noise for sampling: Philox4x32-10 keyed by a request's seed, counted by
(step, token), in plain torch. `triton_philox` computes the same function on the GPU; the two
agree bit for bit on the uniforms.

The draw of token t at step s of a request seeded with `seed` is

    x = philox4x32_10(counter=(t // 4, s_lo, s_hi, 0), key=(seed_lo, seed_hi))[t % 4]
    u = (x >> 9) * 2**-23 + 2**-24                   # in [2**-24, 1 - 2**-24], exactly
    gumbel = -log(-log(u))

so a seed gives the same noise whatever row it sits in and whatever else shares the batch.
"""

from __future__ import annotations

import torch

#: Philox4x32's multipliers and Weyl key increments (Salmon et al., SC'11; Random123).
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF
# NOTE: 23 random bits, so that (2m + 1) * 2**-24 is exact in fp32: with 24 bits the sum
# m * 2**-24 + 2**-25 rounds to 1.0 for the top value, and -log(1) = 0 would make an infinite
# exponential-race score.
UNIFORM_SHIFT = 9
UNIFORM_SCALE = 2.0**-23
UNIFORM_OFFSET = 2.0**-24


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b, for a 32-bit constant a and b holding uint32 values in
    int64. NOTE: the product can pass 2**63; int64 multiplication wraps modulo 2**64 (two's
    complement) on CPU and CUDA, so its 64 bits are exact, and the masks drop the sign
    extension of the shift (the Random123 known answers in tests/kernels/test_philox.py
    check it)."""
    product = b * a
    return (product >> 32) & _M32, product & _M32


def philox4x32_ref(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
    k0: torch.Tensor, k1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Philox4x32-10 of counters (c0..c3) under keys (k0, k1): int64 tensors holding uint32
    values (broadcastable); returns the four output words the same way."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_uniform_ref(
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    vocab: int,
) -> torch.Tensor:
    """The uniforms of tokens 0..vocab-1 for each row's (seed, step). -> [n, vocab] fp32"""
    if seeds.dim() != 1 or seeds.shape != steps.shape:
        raise ValueError(f"seeds and steps must be [n], got {seeds.shape}, {steps.shape}")
    seeds, steps = seeds.long()[:, None], steps.long()[:, None]  # [n, 1]
    num_counters = (vocab + 3) // 4
    counter = torch.arange(num_counters, dtype=torch.int64, device=seeds.device)[None, :]
    words = philox4x32_ref(
        counter, steps & _M32, (steps >> 32) & _M32, torch.zeros_like(counter),
        seeds & _M32, (seeds >> 32) & _M32,
    )  # fmt: skip
    x = torch.stack(words, dim=-1).flatten(1)[:, :vocab]  # [n, vocab]: token t is word t % 4
    return (x >> UNIFORM_SHIFT).to(torch.float32) * UNIFORM_SCALE + UNIFORM_OFFSET


def gumbel_(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniforms in (0, 1): -log(-log(u)), in place (no new tensor).
    -> `uniform`, overwritten, fp32"""
    return uniform.log_().neg_().log_().neg_()
