"""fp32 linears on CPU through oneDNN, each weight packed once (one row in C): y = x @ w^T (+ b).

torch's `F.linear` in fp32 goes to MKL's SGEMM, which on the AMD hosts we measured runs well
below the core's AVX-512 peak and re-packs the weight on every call: on one Zen 5 thread the
embedded model's 30 decoder layers took 41 ms at 8 rows (the few-row C kernel this replaced) /
48 ms (F.linear) and 70 / 104 ms at 32 rows, against 21 and 44 ms through oneDNN's matmul on a
weight packed into its own blocked layout ahead of time; a 256-row prefill chunk 574 ms against
253. One row (a batch-1 decode step) goes to a C GEMV instead (`cpu_native`; four weight rows
streamed at a time): oneDNN's call costs ~17 us whatever its size, 121 calls a step, and the
embedded model's batch-1 step measured medians of 22.1 and 22.6 ms through the GEMV against
25.5 and 23.7 through oneDNN (two runs of six alternating pairs on one engine).

A loaded model's linear weights are held packed only (`pack` -> `PackedWeight`, `linear_packed`,
used by `quant.unquantized`): the one-row GEMV reads oneDNN's blocked layout itself
(`[ceil(N / 64)][K'][64]`, 64 output rows side by side per K step, K' >= K; where oneDNN picks
another layout for a weight, as for very small ones or on other CPUs, `pack` declines and the
caller keeps the plain weight). A model then costs one copy of its fp32 weights, not two, and
one row is no slower: the linears of the embedded model's batch-1 step measured medians of
13.4 and 14.9 ms read packed against 15.8 and 19.4 read plain (`benchmarks.cpu_step_profile`,
greedy and temperature 1, three alternating runs a side on one host). A few rows (2 to
`FEW_ROWS_MAX`) on one compute thread, a decode batch or a short prompt on the default 2-core
engine, go to a C kernel on the same layout: 6-row register tiles over each 64-column block (the
block streamed from memory once, then read from cache), prefetching the next block while it
computes, so the weight stream overlaps the arithmetic; about a tenth faster than oneDNN there
(see `FEW_ROWS_MAX`). The kernels are built for the host's vector width
(`cpu_native.vector_lanes`): AVX-512's 32 registers hold a tile of 6 rows by 64 columns; on AVX2
hosts (16 registers) the 8-lane build sums 16-column strips in chunks of k, its prefetch spread
over every pass, and beats oneDNN by more (a third at 8 rows; `FEW_ROWS_MAX`).

Any other weight (a test's, a layer built outside the model loader, an LM head that is also the
embedding) keeps its plain tensor and a packed copy cached on it (`packed_weight`), keyed by the
tensor's version counter, so a weight changed in place is packed again before its next use
rather than read stale; the copy in the blocked layout takes the same C kernels. Where torch was
built without oneDNN, or for other dtypes, `wanted` says no and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from loraplex.kernels.cpu_linear_source import GEMV_SIGNATURES, GEMV_SOURCE
from loraplex.kernels.cpu_native import load_library

#: The attribute of a weight tensor that holds (its version when packed, the packed weight).
_PACKED = "_loraplex_onednn_packed"


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-weight linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_BLOCK = 64  # output rows interleaved per K step in oneDNN's blocked fp32 weight layout


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A [N, K] fp32 weight held only in oneDNN's blocked layout (see the module doc)."""

    tensor: torch.Tensor  # oneDNN's (opaque) packed tensor, what its matmul takes
    n: int
    k: int
    k_padded: int  # K': the K steps stored per 64-row block (zeros past K)
    data_ptr: int  # where its [ceil(N / 64), K', 64] floats start

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def to_dense(self) -> torch.Tensor:
        """The weight as a plain [N, K] tensor (a new copy)."""
        return self.tensor.to_dense()


def _blocked(weight: torch.Tensor, k_padded: int) -> torch.Tensor:
    """`weight` [N, K] laid out as [ceil(N / 64), K', 64], zero-padded."""
    n, k = weight.shape
    n_padded = -(-n // _BLOCK) * _BLOCK
    padded = torch.zeros(n_padded, k_padded, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, _BLOCK, k_padded).transpose(1, 2).contiguous()


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` ([N, K] fp32 on CPU, no autograd) packed for oneDNN, for the caller to hold
    instead of it; None where `linear_cpu` would not take it or oneDNN's layout is not the
    blocked one the one-row GEMV reads (the caller then keeps the plain weight)."""
    if not (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and not weight.requires_grad
        and available()
    ):
        return None
    n, k = weight.shape
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    floats, n_padded = torch.ops.mkldnn._nbytes(packed) // 4, -(-n // _BLOCK) * _BLOCK
    k_padded = floats // n_padded
    if n == 0 or floats != n_padded * k_padded or k_padded < k:
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    # NOTE: every stored float compared with where the GEMV reads it, so a layout oneDNN
    # chose otherwise is never read as this one
    stored = torch.frombuffer((ctypes.c_float * floats).from_address(address), dtype=torch.float32)
    if not torch.equal(stored, _blocked(weight.detach(), k_padded).view(-1)):
        return None
    return PackedWeight(packed, n, k, k_padded, address)


def packed_weight(weight: torch.Tensor) -> PackedWeight | torch.Tensor:
    """The packed form of `weight` ([N, K] fp32 on CPU): a `PackedWeight` where oneDNN chose the
    blocked layout the C kernels read, else oneDNN's opaque tensor; packed on first use and
    again after any in-place change."""
    cached = getattr(weight, _PACKED, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed: PackedWeight | torch.Tensor | None = pack(weight)
    if packed is None:
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


#: Most rows the few-row C kernel takes on one compute thread; past that, or on more threads,
#: oneDNN. NOTE: on one thread of the 2-core AVX-512 host (Sapphire Rapids, one other process
#: busy), the embedded model's 120 decoder linears measured (medians of seven interleaved runs
#: a side against oneDNN or the 4-row kernel before this one) 50.6-61.3 against 59.9-71.5 ms at
#: 8 rows, 91.7-116.0 against 101.6-122.7 at 32 and 179-210 against 197-233 through oneDNN at
#: 64 (a prompt of 64 tokens); at 96 and 128 rows the two were within 3%. On the 2-core AVX2
#: Zen 3 host (the 8-lane build, weights from DRAM, medians of five): 28.3 against 30.2 ms at
#: one row, 37.3 / 52.5 at 8, 105.4 / 115.9 at 32, 191.5 / 195.6 at 64; the tied LM head
#: (49152 x 576) 10.3 / 13.0 at 8 rows and 50.4 / 51.4 at 64.
FEW_ROWS_MAX = 64


def _gemv_library() -> ctypes.CDLL | None:
    return load_library(
        "gemv", GEMV_SOURCE, (("-O3", "-pthread", "-D_GNU_SOURCE"),), GEMV_SIGNATURES
    )


@functools.cache
def few_rows_in_c() -> bool:
    """Whether products of 1 to `FEW_ROWS_MAX` rows take the C kernels on this host (else
    oneDNN takes every product): everywhere but x86-64 below AVX2, where the kernels' plain
    build was never measured against oneDNN's. On AVX2 they are the 8-lane build
    (`cpu_native.vector_lanes`); the 16-lane one ran 5-25x oneDNN's time there (GCC keeps
    16-float vectors on the stack)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


#: The fewest multiply-adds of a few-row product shared with lent threads (`lending`): below,
#: a share is too short to pay for handing it over (~1 us to a helper still spinning from the
#: last product, some tens of us to wake one).
SHARE_MIN_MACS = 1 << 17


class LentThreads:
    """Threads an engine on one compute thread borrows for some of its steps (`lending`): the
    few-row C kernels split a product's 64-column blocks between the calling thread and a team
    of C helper threads (each output is summed over k in order whoever computes it, so the
    product is the same to the bit as on one thread), and oneDNN's products run on `1 + count`
    OpenMP threads (its blocks of outputs shared out, K whole: equal to the bit on the embedded
    model's shapes on the 2-core AVX-512 host, which a test checks). A helper spins for its next
    share for a while (`SPIN_NS`, a fifth of a millisecond) after each one, so the ~120 products
    of a step each hand over in about a microsecond, then sleeps, leaving the core to others
    between steps."""

    def __init__(self, count: int, cores: tuple[int, ...] | None = None) -> None:
        """`count` threads, bound to `cores` where given (else placed by the OS)."""
        if count < 1:
            raise ValueError(f"LentThreads needs at least one thread, got {count}")
        self.count, self.cores = count, cores
        #: asked before each product that would share: whether the threads may be used now
        #: (None: always; `SpareCores` sets it to its idleness check)
        self.gate: Callable[[], bool] | None = None
        self.shared = 0  # products shared so far
        self._omp_started = False
        self._lib = _gemv_library()
        self._team: int | None = None
        if self._lib is not None:
            cpus = (ctypes.c_int32 * len(cores))(*cores) if cores else None
            self._team = self._lib.team_start(count, cpus, len(cores) if cores else 0) or None

    @contextmanager
    def parallel(self) -> Iterator[None]:
        """torch's intra-op threads raised by `count` within the block. NOTE: OpenMP starts its
        worker threads on the first parallel region and they keep the affinity of the thread
        that started them; an engine bound to its own core would have them share it, so they are
        started once with that thread's affinity widened to the lent cores."""
        self.shared += 1
        before = torch.get_num_threads()
        if not self._omp_started:
            self._omp_started = True
            self._start_omp(before)
        torch.set_num_threads(before + self.count)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _start_omp(self, threads: int) -> None:
        own = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        widen = own is not None and self.cores is not None and not set(self.cores) <= own
        if widen:
            os.sched_setaffinity(0, own | set(self.cores))  # type: ignore[arg-type, operator]
        try:
            torch.set_num_threads(threads + self.count)
            torch.ones(1 << 20).add_(1.0)  # NOTE: a parallel region: the workers start here
        finally:
            torch.set_num_threads(threads)
            if widen:
                os.sched_setaffinity(0, own)  # type: ignore[arg-type]

    def product(
        self, rows: torch.Tensor, weight: PackedWeight, bias: int | None, out: torch.Tensor
    ) -> bool:
        """The few-row product of contiguous `rows` into `out`, its column blocks shared with
        the helper team. -> False where there is no team (nothing written)."""
        if self._team is None:
            return False
        self.shared += 1
        self._lib.team_product(self._team, rows.data_ptr(), rows.shape[0], weight.data_ptr,
                               bias, out.data_ptr(), weight.n, weight.k, weight.k_padded)  # fmt: skip
        return True

    def close(self) -> None:
        if self._team is not None:
            self._lib.team_stop(self._team)
            self._team = None


def _share_with(m: int, weight: PackedWeight) -> LentThreads | None:
    """The lent threads this product shares its work with: those of `lending`, where the product
    is big enough to pay for the hand-off and their gate lets it."""
    lent = _LENT.get()
    if lent is None or weight.n <= 64 or m * weight.n * weight.k < SHARE_MIN_MACS:
        return None
    return lent if lent.gate is None or lent.gate() else None


_LENT: ContextVar[LentThreads | None] = ContextVar("loraplex_lent_threads", default=None)


@contextmanager
def lending(threads: LentThreads | None) -> Iterator[None]:
    """Within the block, on an engine of one compute thread, products of at least
    `SHARE_MIN_MACS` multiply-adds share their work with `threads`, through the C helper team
    (1 to `FEW_ROWS_MAX` rows) or oneDNN's OpenMP threads (more; None: none lent)."""
    token = _LENT.set(threads)
    try:
        yield
    finally:
        _LENT.reset(token)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """One row: x [1, K] @ weight [N, K]^T in C. -> [1, N], or None where it cannot build"""
    lib = _gemv_library()
    if lib is None or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    lib.gemv(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), weight.shape[0], weight.shape[1])  # fmt: skip
    return out


def linear_cpu(
    x: torch.Tensor,  # [M, K] fp32 on CPU
    weight: torch.Tensor,  # [N, K] fp32 on CPU
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [M, N] fp32
    """x @ weight^T (+ bias) on the cached packed copy: as `linear_packed` where oneDNN chose
    the blocked layout, else one row through the C GEMV on the plain weight, more through
    oneDNN."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    packed = packed_weight(weight)
    if isinstance(packed, PackedWeight):
        return linear_packed(x, packed, bias)
    if x.shape[0] == 1 and few_rows_in_c():
        out = _gemv(x, weight, bias)
        if out is not None:
            return out
    return _onednn(x.contiguous(), packed, bias)


def linear_packed(
    x: torch.Tensor,  # [..., K] fp32 on CPU
    weight: PackedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [..., N] fp32
    """x @ weight^T (+ bias) on the blocked layout: one row through the C GEMV, up to
    `FEW_ROWS_MAX` on one compute thread through the few-row C kernel, more through oneDNN."""
    if x.shape[-1] != weight.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"fp32 CPU x [..., {weight.k}] expected, got {x.dtype} {x.shape}")
    rows = x.reshape(-1, weight.k)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.n)
    m, lib = rows.shape[0], _gemv_library()
    one_thread = torch.get_num_threads() == 1
    few = few_rows_in_c() and (m == 1 or (m <= FEW_ROWS_MAX and one_thread))
    if few and lib is not None and (bias is None or bias.is_contiguous()):
        rows = rows.contiguous()
        out = torch.empty(m, weight.n, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        lent = _share_with(m, weight)
        if lent is not None and lent.product(rows, weight, b, out):
            pass
        elif m == 1:
            lib.gemv_blocked(rows.data_ptr(), weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded)  # fmt: skip
        else:
            lib.gemm_blocked(rows.data_ptr(), m, weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded, 0, weight.n)  # fmt: skip
    elif one_thread and (lent := _share_with(m, weight)) is not None:
        with lent.parallel():
            out = _onednn(rows.contiguous(), weight.tensor, bias)
    else:
        out = _onednn(rows.contiguous(), weight.tensor, bias)
    return out.view(*x.shape[:-1], weight.n)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
