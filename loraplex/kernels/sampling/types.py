"""The sampling family's constants, shared by its entry, its torch reference, its Triton
kernels and its C twin (each imports them from here, never from another).

Noise is Philox4x32-10 keyed by a request's seed and counted by (step, token); the draw of
token t at step s of a request seeded with `seed` is

    x = philox4x32_10(counter=(t // 4, s_lo, s_hi, 0), key=(seed_lo, seed_hi))[t % 4]
    u = (x >> 9) * 2**-23 + 2**-24                   # in [2**-24, 1 - 2**-24], exactly
    gumbel = -log(-log(u))

so a seed gives the same noise whatever row it sits in and whatever else shares the batch.
"""

from __future__ import annotations

GREEDY_TEMPERATURE = 1e-5  # a row below it is greedy

#: Philox4x32's multipliers and Weyl key increments (Salmon et al., SC'11; Random123).
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
# NOTE: 23 random bits, so that (2m + 1) * 2**-24 is exact in fp32: with 24 bits the sum
# m * 2**-24 + 2**-25 rounds to 1.0 for the top value, and -log(1) = 0 would make an infinite
# exponential-race score.
UNIFORM_SHIFT = 9
UNIFORM_SCALE = 2.0**-23
UNIFORM_OFFSET = 2.0**-24

# NOTE: the most programs the Triton kernels split a row over. Kernels that combine a row's
# chunks read a fixed MAX_CHUNKS-wide block (masked), so no constexpr depends on the batch
# size: a batch of a size not seen before launches the kernels already compiled (a compile
# stalls the engine for ~0.1 s; `warm_up` compiles every variant at start-up).
MAX_CHUNKS = 64
# The Triton threshold search's pivots per pass by the batch's logits size (n * vocab), the
# first bucket that fits; 8 above. NOTE: measured on the H200
# (benchmarks/results/h200_sampler.json): a full batch is compute-bound (8 pivots: 11 passes a
# phase); a small one is bound by launches. The only constexpr that depends on the batch:
# `warm_up` compiles one batch size per bucket.
NUM_PIVOTS_BY_SIZE = ((2**20, 64), (2**23, 16))
