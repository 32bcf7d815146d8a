"""fp32 linears on CPU through oneDNN, with each weight packed once: y = x @ weight^T (+ bias).

torch's `F.linear` in fp32 goes to MKL's SGEMM, which on the AMD hosts we measured runs well
below the core's AVX-512 peak and re-packs the weight on every call: on one Zen 5 thread the
embedded model's 30 decoder layers took 41 ms at 8 rows (the few-row C kernel this replaced) /
48 ms (F.linear) and 70 / 104 ms at 32 rows, against 21 and 44 ms through oneDNN's matmul on a
weight packed into its own blocked layout ahead of time; a 256-row prefill chunk 574 ms against
253. The same packed weight serves every row count, one row included.

The packed copy is cached on the weight tensor itself, keyed by the tensor's version counter, so
a weight changed in place after loading (a test's, an adapter merge's) is packed again before
its next use rather than read stale. It costs a second copy of each fp32 weight in memory.
Where torch was built without oneDNN, or for other dtypes, `wanted` says no and the caller
keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch

#: The attribute of a weight tensor that holds (its version when packed, the packed weight).
_PACKED = "_loraplex_onednn_packed"


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-weight linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed form of `weight` ([N, K] fp32 on CPU), packed on first use and again
    after any in-place change."""
    cached = getattr(weight, _PACKED, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    setattr(weight, _PACKED, (weight._version, packed))
    return packed


def prepack(weight: torch.Tensor) -> None:
    """Pack `weight` now if `linear_cpu` would take it ([N, K] fp32 on CPU, no autograd), so
    the first request does not pay for it."""
    if (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and not weight.requires_grad
        and available()
    ):
        packed_weight(weight)


def linear_cpu(
    x: torch.Tensor,  # [M, K] fp32 on CPU
    weight: torch.Tensor,  # [N, K] fp32 on CPU
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [M, N] fp32
    """x @ weight^T (+ bias) through oneDNN on the packed weight."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), packed_weight(weight), bias, "none", [], ""
    )


def wanted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear_cpu` runs this call: CPU fp32 tensors, x of 2 dimensions, no autograd,
    and a torch built with oneDNN."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not (x.requires_grad or weight.requires_grad)
        and available()
    )
