"""The options of `loraplex quantize`, checked and completed for one model before any work.

Defaults follow the model: the group size is the largest one the format loads that divides the
input size of every layer to quantize (SmolLM2-135M's 576 and 1536 take 64), AWQ is asymmetric
(its "gemm" layout stores zero points) and GPTQ symmetric. An option the method cannot honour is
a ValueError naming it, never silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loraplex.quant.awq import AWQ_GROUP_SIZES
from loraplex.quant.packing import pack_factor
from loraplex.quant.wna16 import check_output_sizes, resolve_group_size

logger = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "fp8")
FP8_SCHEMES = ("per_channel", "per_tensor", "block")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Group sizes tried, largest first, when none is given: AWQ loads 32/64/128; GPTQ any multiple
# of 16. When none divides every input size, one group spans the whole input (-1).
GROUP_SIZE_CANDIDATES = {"awq": tuple(g for g in AWQ_GROUP_SIZES if g > 0)[::-1],
                         "gptq": (128, 64, 32, 16)}  # fmt: skip


@dataclass(frozen=True)
class QuantizeOptions:
    """What one `quantize_model` run writes; every field is resolved (no None defaults left)."""

    method: str  # one of METHODS
    bits: int  # AWQ 4; GPTQ 4 or 8; FP8 8
    group_size: int  # AWQ/GPTQ input features per group, -1 = the whole input; FP8: 0 (unused)
    sym: bool  # GPTQ without zero points; AWQ always False, FP8 always True
    desc_act: bool  # GPTQ act-order
    fp8_scheme: str  # one of FP8_SCHEMES (FP8 only; "" otherwise)


def default_group_size(method: str, input_sizes: set[int]) -> int:
    """The largest candidate group size of `method` that divides every size, else -1."""
    for size in GROUP_SIZE_CANDIDATES[method]:
        if all(k % size == 0 for k in input_sizes):
            return size
    return -1


def _refuse_foreign(method: str, given: dict[str, bool]) -> None:
    """A ValueError for an option that was given but does not apply to `method`."""
    for flag, was_given in given.items():
        if was_given:
            raise ValueError(f"{flag} does not apply to {method.upper()}; leave it out")


def resolve_options(
    method: str,
    shapes: dict[str, tuple[int, int]],
    *,
    bits: int | None = None,
    group_size: int | None = None,
    sym: bool | None = None,
    desc_act: bool = False,
    fp8_scheme: str | None = None,
) -> QuantizeOptions:
    """Check the options against `method` and the weights `shapes` ({module: (N, K)}) and fill
    in the defaults. None means "not given": the default that works for these shapes is used."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not shapes:
        raise ValueError(f"the model has no {'/'.join(PROJECTIONS)} weights to quantize")
    if method == "fp8":
        _refuse_foreign(method, {f"bits={bits} (--bits {bits})": bits not in (None, 8),
                                 "group_size (--group-size)": group_size is not None,
                                 "sym=False (--no-sym)": sym is False,
                                 "desc_act (--desc-act)": desc_act})  # fmt: skip
        scheme = "per_channel" if fp8_scheme is None else fp8_scheme
        if scheme not in FP8_SCHEMES:
            raise ValueError(f"fp8_scheme must be one of {FP8_SCHEMES}, got {scheme!r}")
        return QuantizeOptions("fp8", 8, 0, True, False, scheme)
    _refuse_foreign(method, {"fp8_scheme (--fp8-scheme)": fp8_scheme is not None})
    if method == "awq":
        _refuse_foreign(method, {"desc_act (--desc-act)": desc_act})
        if bits not in (None, 4):
            raise ValueError(f"AWQ is 4-bit: bits={bits} (--bits {bits}) is not possible")
        if sym:
            raise ValueError(
                "AWQ is asymmetric by definition (its layout stores zero points): sym=True "
                "(--sym) is not possible; leave it out"
            )
    bits = 4 if bits is None else bits
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    input_sizes = {k for _, k in shapes.values()}
    if group_size is not None and group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size must be positive or -1 (the whole input), got {group_size}")
    if group_size is None:
        group_size = default_group_size(method, input_sizes)
        why = (
            "the largest of %s that divides"
            if group_size > 0
            else "one group per input: none of %s divides"
        )
        logger.info(
            "%s group size %d (%s every quantized input size %s)", method.upper(), group_size,
            why % (GROUP_SIZE_CANDIDATES[method],), sorted(input_sizes),
        )  # fmt: skip
    pack = pack_factor(bits)
    for module, (n, k) in shapes.items():
        name = method.upper()
        check_output_sizes(module, name, [n], 8 if method == "awq" else pack)
        resolve_group_size(module, name, group_size, k)
        if method == "gptq" and k % pack:
            raise ValueError(
                f"{module}: GPTQ packs {pack} inputs per int32 word, but the input size is {k}"
            )
    return QuantizeOptions(
        method, bits, group_size, method == "gptq" and sym is not False, desc_act, ""
    )
