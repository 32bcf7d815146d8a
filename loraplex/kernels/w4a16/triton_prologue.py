"""The prologue every W4A16 / W8A16 kernel shares: from a tile of packed words in the layout of
`types` to dequantization-ready values in registers."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unshuffle_halves(q, BLOCK_N: tl.constexpr, HALVES: tl.constexpr, LANES: tl.constexpr):
    """[BLOCK_N, HALVES] 16-bit halves of words in slot order -> operand order (the halves of
    word kw = slot % per_lane * LANES + slot // per_lane at columns 2 * kw, 2 * kw + 1; see
    `types.tile_features`). Only renames registers: each thread keeps the halves it loaded."""
    q = tl.reshape(q, (BLOCK_N, LANES, HALVES // (2 * LANES), 2))
    return tl.reshape(tl.permute(q, (0, 2, 1, 3)), (BLOCK_N, HALVES))


@triton.jit
def pair_operand(
    q, z, s, P: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, USE_ASM: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """v - z of position pair P (times s when SCALED) as [BLOCK_N, HALVES] of z's dtype:
    q [BLOCK_N, HALVES] int16, the halves of the words (half h of word kw holds position
    P + h * pack / 2 at bits [P * BITS, (P + 1) * BITS)); z [BLOCK_N] the zero points plus
    OFFSET; s [BLOCK_N] the scales in z's dtype (read only when SCALED).

    MAGIC (16-bit pattern) > 0: a value OR-ed into its mantissa reads as OFFSET + v, exact, and
    so is the difference to OFFSET + z; the scale rounds the product once, as a dense weight of
    that dtype would. USE_ASM (GPU, MAGIC only): per word one shift, one LOP3 and one packed
    subtract (and multiply) make the two-value register of the MMA operand."""
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    dtype = z.dtype
    if USE_ASM:
        PAIR_MASK: tl.constexpr = VALUE_MASK | (VALUE_MASK << 16)
        TYPE: tl.constexpr = "bf16x2" if dtype == tl.bfloat16 else "f16x2"
        SHIFT: tl.constexpr = P * BITS
        SCALE: tl.constexpr = f"mul.rn.{TYPE} $0, t, $3;" if SCALED else "mov.b32 $0, t;"
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t, m;
            mov.b32 m, {MAGIC | (MAGIC << 16)};
            shr.u32 t, $1, {SHIFT};
            lop3.b32 t, t, {PAIR_MASK}, m, 0xEA;
            sub.rn.{TYPE} t, t, $2;
            {SCALE}
            }}""",
            constraints="=r,r,r,r",
            args=[q, tl.broadcast_to(z[:, None], q.shape), tl.broadcast_to(s[:, None], q.shape)],
            dtype=dtype,
            is_pure=True,
            pack=2,
        )
    v = (q >> (P * BITS)) & VALUE_MASK if P > 0 else q & VALUE_MASK
    if MAGIC > 0:
        w = (v | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    else:
        w = v.to(dtype)
    w = w - z[:, None]
    if SCALED:
        w = w * s[:, None]
    return w


@triton.jit
def group_of(k0, K, GROUP_SIZE: tl.constexpr):
    """The group of feature k0; the padding past K reads the last group (its x is zero)."""
    return tl.minimum(k0, K - 1) // GROUP_SIZE
