"""Multi-LoRA kernels per decoder layer against the layer's base GEMMs and bytes, on one GPU.

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 KV heads), bf16, rank 16 on
all seven projections, 64 slots; the LoRA weights of 32 layers are cycled as in a forward, so
they come from HBM rather than L2. For each case (tokens, distinct adapters; token i runs adapter
i mod adapters):

1. every kernel variant (each regime of `LoRAKernelConfig` forced, the default dispatch, and
   the default pair with its shrink on a side stream beside the base GEMM, as the engine's
   layers run a step of two or more tokens) against the fp32 torch reference on the first
   layer; a variant that misses is dropped from the case (`--variants` picks a subset);
2. each variant's LoRA time per layer (qkv, o, gate-up and down), replayed from a CUDA graph,
   and eagerly for the default (and for every variant of the prefill cases, which run eager);
3. the layer's four base GEMMs (cuBLAS) alone and interleaved with each variant's LoRA, in a
   graph (prefill cases: eagerly, the default and the side stream): the difference is the time
   LoRA adds in place, where a programmatic dependent launch (`decode_pdl`) or the side stream
   can hide work behind the GEMM;
4. the bytes LoRA must move per layer (each distinct adapter's A and B once, x read, the output
   read and written) over the copy bandwidth measured in the run: the floor.

Then the device time of each kernel of the default at a few cases (torch profiler). The record
is rewritten after every case, so a run cut short keeps what it measured (`--budget-s` stops
starting new cases past that many seconds).

    python -m benchmarks.lora_kernels [--out h200_lora_kernels.json] [--budget-s 270]
    python -m benchmarks.lora_kernels --variants default,group_x4096 --cases 64x8,256x64 \
        --profile-variants group_x4096 --profile-cases 256x64
    python -m benchmarks.lora_kernels --smoke   # CPU, Triton interpreter, tiny shapes

(from the repository root, so that `loraplex` imports from the working tree). `--smoke` walks
every step on the CPU (no graphs, no streams, no profiler) and writes nothing: a check that a
GPU run will not fail on the way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.record import write_result
from loraplex.kernels.lora import (
    DEFAULT_KERNEL_CONFIG,
    LoRAKernelConfig,
    LoRAKernelMeta,
    LoRAStack,
    add_lora,
    fill_kernel_meta,
    lora_expand_ref,
    lora_shrink_ref,
    lora_triton,
    new_counters,
)

RANK = 16
_D = DEFAULT_KERNEL_CONFIG
_ALWAYS = 1 << 20
_TOKEN = dataclasses.replace(_D, decode_max_tokens=0, token_kernels_max_tokens=_ALWAYS)
_GROUP = dataclasses.replace(_D, decode_max_tokens=0, token_kernels_max_tokens=0)
#: Each regime forced, and its expand with one column tile per program (`_x0`, the kernels
#: before chunked expands) or aiming at fewer or more programs (`_x256`, `_x4096`).
VARIANTS = {
    "default": _D,
    "decode": dataclasses.replace(_D, decode_max_tokens=_ALWAYS),
    "token": _TOKEN,
    "token_x0": dataclasses.replace(_TOKEN, expand_programs=0),
    "token_x256": dataclasses.replace(_TOKEN, expand_programs=256),
    "group": _GROUP,
    "group_x0": dataclasses.replace(_GROUP, expand_programs=0),
    "group_x256": dataclasses.replace(_GROUP, expand_programs=256),
    "group_x4096": dataclasses.replace(_GROUP, expand_programs=4096),
}
PREFILL_VARIANTS = ["default", "group_x0", "group_x256", "group_x4096"]
SIDE_STREAM = "side_stream"  # the default pair, its shrink on a second stream beside the GEMM
TOLERANCE = 3e-2  # max |error| / max |reference| in bf16


@dataclass(frozen=True)
class Setup:
    """The shapes and cases of one run."""

    hidden: int
    intermediate: int
    q_size: int
    kv_size: int
    num_layers: int
    num_slots: int
    decode_cases: tuple[tuple[int, int], ...]
    prefill_cases: tuple[tuple[int, int], ...]
    profile_cases: tuple[tuple[int, int], ...]
    graph_iters: int
    eager_iters: int

    @property
    def projections(self) -> dict[str, tuple[int, tuple[str, ...], list[int]]]:
        """name: (input size, shard names, shard output sizes)"""
        h, i, q, kv = self.hidden, self.intermediate, self.q_size, self.kv_size
        return {
            "qkv_proj": (h, ("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
            "o_proj": (q, ("o_proj",), [h]),
            "gate_up_proj": (h, ("gate_proj", "up_proj"), [i, i]),
            "down_proj": (i, ("down_proj",), [h]),
        }


H200 = Setup(
    4096, 14336, 4096, 1024, num_layers=32, num_slots=64,
    decode_cases=((1, 1), (8, 8), (64, 64), (128, 64), (256, 64), (64, 8), (128, 8), (256, 8),
                  (128, 1), (256, 1)),
    prefill_cases=((2048, 8), (8192, 64)),
    profile_cases=((64, 64), (256, 64), (8192, 64)),
    graph_iters=20, eager_iters=3,
)  # fmt: skip
SMOKE = Setup(
    64, 96, 64, 32, num_layers=2, num_slots=8,
    decode_cases=((1, 1), (5, 3)), prefill_cases=((40, 4),), profile_cases=(),
    graph_iters=1, eager_iters=1,
)  # fmt: skip


class _Batch:
    """The per-step buffers every LoRA layer of a forward shares (the engine's
    `LoRABatchMeta`): the tokens' slots grouped by slot, the shrink's workspace, the decode
    kernel's counters."""

    def __init__(self, num_slots: int, max_tokens: int, width: int, device: torch.device):
        self.num_slots = num_slots
        self._slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._order = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self._start = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self._count = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.workspace = torch.zeros(max(max_tokens, 4096), width, device=device)  # fp32
        self.counters = new_counters(device)
        self.kernel_meta = self._view(0)

    def _view(self, n: int) -> LoRAKernelMeta:
        return LoRAKernelMeta(self._slots[:n], self._order[:n], self._start, self._count)

    def set(self, slots: torch.Tensor) -> None:  # [num_tokens] int32 on the device
        self._slots[: slots.shape[0]].copy_(slots)
        self.kernel_meta = self._view(slots.shape[0])
        self.regroup()

    def regroup(self) -> None:
        fill_kernel_meta(self.kernel_meta, self.num_slots)


def _stack(in_size: int, sizes: list[int], num_slots: int, device, dtype) -> LoRAStack:
    """Random rank-RANK weights of one projection for every slot, scaling 2."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    s = len(sizes)
    a = torch.empty(num_slots, s * RANK, in_size, device=device, dtype=dtype)
    b_t = torch.empty(num_slots, RANK, offsets[-1], device=device, dtype=dtype)
    return LoRAStack(
        a=a.normal_(std=in_size**-0.5),
        b_t=b_t.normal_(std=RANK**-0.5),
        ranks=torch.full((s, num_slots), RANK, dtype=torch.int32, device=device),
        scaling=torch.full((s, num_slots), 2.0, device=device),
        slice_offsets=tuple(offsets),
    )


class Timer:
    """Mean microseconds per call: CUDA events around replays of a captured graph or eager
    calls; on the CPU (smoke) a host clock, no graph."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def us(self, fn: Callable[[], None], graph: bool, iters: int) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) * 1e6 / iters
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        run = fn
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
            run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / iters


class Bench:
    """The layers, their base weights and the step functions of one run."""

    def __init__(self, setup: Setup, device: torch.device, dtype: torch.dtype) -> None:
        self.setup, self.device, self.dtype = setup, device, dtype
        self.cuda = device.type == "cuda"
        self.timer = Timer(self.cuda)
        max_tokens = max(n for n, _ in setup.decode_cases + setup.prefill_cases)
        self.meta = _Batch(setup.num_slots, max_tokens, 3 * RANK, device)
        self.side_workspace = torch.zeros_like(self.meta.workspace)
        self.side = torch.cuda.Stream() if self.cuda else None
        self.only: list[str] = []  # the variants to run (all when empty)
        self.profile_cases = setup.profile_cases  # the cases `profile` times
        # NOTE: every layer's own adapter weights (from HBM, as in a forward); one layer's base
        # weights, [out, in] each
        self.layers = [
            [_stack(in_size, sizes, setup.num_slots, device, dtype)
             for in_size, _, sizes in setup.projections.values()]
            for _ in range(setup.num_layers)
        ]  # fmt: skip
        self.weights = [
            torch.randn(sum(sizes), in_size, device=device, dtype=dtype) * in_size**-0.5
            for in_size, _, sizes in setup.projections.values()
        ]

    def set_case(self, num_tokens: int, num_adapters: int) -> None:
        slots = (torch.arange(num_tokens) % num_adapters).to(torch.int32)
        self.meta.set(slots.to(self.device))
        self.xs = [torch.randn(num_tokens, w.shape[1], device=self.device, dtype=self.dtype)
                   for w in self.weights]  # fmt: skip
        self.outs = [torch.zeros(num_tokens, w.shape[0], device=self.device, dtype=self.dtype)
                     for w in self.weights]  # fmt: skip

    # -- one projection ------------------------------------------------------------------

    def lora(self, config: LoRAKernelConfig) -> Callable[[LoRAStack, torch.Tensor, torch.Tensor], None]:  # fmt: skip
        meta = self.meta
        # NOTE: off CUDA (smoke) add_lora would run the torch reference: the kernels, interpreted
        run = add_lora if self.cuda else lora_triton

        def apply(layer: LoRAStack, x: torch.Tensor, out: torch.Tensor) -> None:
            run(x, out, layer, meta.kernel_meta, meta.workspace, config, meta.counters)

        return apply

    def side_stream_pair(self, layer: LoRAStack, x, out, gemm: Callable[[], None]) -> None:
        """As the engine's `LoRALayer.begin` runs a two-launch step: the default regime's shrink
        on the side stream while `gemm` writes `out`, then the expand."""
        from loraplex.kernels.lora import expand_lora, shrink_lora

        kmeta, ws = self.meta.kernel_meta, self.side_workspace
        if self.side is None:
            splits = shrink_lora(x, layer, kmeta, ws)
            gemm()
        else:
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                splits = shrink_lora(x, layer, kmeta, ws)
            gemm()
            main.wait_stream(self.side)
        expand_lora(ws, splits, out, layer, kmeta)

    # -- whole steps (every layer) ---------------------------------------------------------

    def lora_step(self, variant: str) -> Callable[[], None]:
        apply = self.lora(VARIANTS[variant])

        def step() -> None:
            for per_layer in self.layers:
                for layer, x, out in zip(per_layer, self.xs, self.outs):
                    apply(layer, x, out)

        return step

    def base_step(self) -> None:
        for w, x, out in zip(self.weights, self.xs, self.outs):
            torch.matmul(x, w.T, out=out)

    def layer_step(self, variant: str | None) -> Callable[[], None]:
        """Every layer's base GEMMs, each followed by its LoRA (None: the base alone)."""
        apply = self.lora(VARIANTS[variant]) if variant in VARIANTS else None

        def step() -> None:
            for per_layer in self.layers:
                for layer, w, x, out in zip(per_layer, self.weights, self.xs, self.outs):

                    def gemm(x=x, w=w, out=out) -> None:
                        torch.matmul(x, w.T, out=out)

                    if variant == SIDE_STREAM:
                        self.side_stream_pair(layer, x, out, gemm)
                        continue
                    gemm()
                    if apply is not None:
                        apply(layer, x, out)

        return step

    # -- checks ---------------------------------------------------------------------------

    def reference(self, w: LoRAStack, x: torch.Tensor) -> torch.Tensor:
        """The fp32 torch reference of one projection's delta."""
        w32 = LoRAStack(w.a.float(), w.b_t.float(), w.ranks, w.scaling, w.slice_offsets)
        t = torch.zeros(x.shape[0], w.num_slices * RANK, device=x.device)
        ref = torch.zeros(x.shape[0], w.slice_offsets[-1], device=x.device)
        lora_shrink_ref(x.float(), w32, t, self.meta.kernel_meta)
        lora_expand_ref(t, w32, ref, self.meta.kernel_meta)
        return ref

    def error(self, variant: str) -> float:
        """Worst relative error of the variant's delta on the first layer's projections; the
        decode kernel's counters must be back at zero."""
        worst = 0.0
        for layer, x in zip(self.layers[0], self.xs):
            out = torch.zeros(x.shape[0], layer.slice_offsets[-1], dtype=x.dtype, device=x.device)
            if variant == SIDE_STREAM:
                self.side_stream_pair(layer, x, out, out.zero_)
            else:
                self.lora(VARIANTS[variant])(layer, x, out)
            ref = self.reference(layer, x)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            worst = max(worst, err if err == err else float("inf"))  # NaN fails
        if self.meta.counters.tolist() != [0, 0, 0, 0]:
            return float("inf")
        return worst


def layer_bytes(setup: Setup, num_tokens: int, num_adapters: int) -> int:
    """The fewest bytes LoRA moves per layer (bf16): each distinct adapter's A and B once, every
    token's input read and its output read and written."""
    total = 0
    for in_size, shards, sizes in setup.projections.values():
        adapter = len(shards) * RANK * in_size + RANK * sum(sizes)
        total += 2 * (num_adapters * adapter + num_tokens * (in_size + 2 * sum(sizes)))
    return total


def copy_bandwidth_gbs(cuda: bool) -> float:
    """Device-to-device copy, bytes read plus written per second (GB/s); 0 off CUDA."""
    if not cuda:
        return 0.0
    buffers = torch.empty(2, 1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    us = Timer(True).us(lambda: buffers[1].copy_(buffers[0]), graph=False, iters=10)
    return 2 * (1 << 30) / us / 1e3


def measure_case(
    bench: Bench, num_tokens: int, num_adapters: int, prefill: bool, bandwidth: float
) -> dict[str, float | str]:
    setup, timer = bench.setup, bench.timer
    bench.set_case(num_tokens, num_adapters)
    row: dict[str, float | str] = {}
    variants = [*(PREFILL_VARIANTS if prefill else VARIANTS), SIDE_STREAM]
    if num_tokens == 1:  # NOTE: one token runs the one-launch kernel, no pair to overlap
        variants.remove(SIDE_STREAM)
    if bench.only:
        variants = [v for v in variants if v in bench.only]
    ok = []
    for name in variants:
        try:
            err = bench.error(name)
        except Exception as exc:  # a variant that cannot run here (e.g. no PDL) is reported
            row[f"{name}_failed"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        row[f"{name}_max_rel_error"] = err
        if err <= TOLERANCE:
            ok.append(name)
        else:
            row[f"{name}_failed"] = "error above tolerance"
    graph = not prefill
    iters = setup.eager_iters if prefill else setup.graph_iters
    row["base_gemm_us"] = timer.us(bench.base_step, graph=graph, iters=iters)
    if not prefill:
        row["base_gemm_us_eager"] = timer.us(bench.base_step, graph=False, iters=iters)
        row["regroup_us_graph"] = timer.us(bench.meta.regroup, graph=True, iters=iters)
    layers = setup.num_layers
    for name in ok:
        try:
            if name != SIDE_STREAM:
                row[f"{name}_lora_us"] = timer.us(bench.lora_step(name), graph, iters) / layers
            if prefill and name not in ("default", SIDE_STREAM):
                continue
            if name == "default" and not prefill:
                us = timer.us(bench.lora_step(name), graph=False, iters=setup.eager_iters)
                row["default_lora_us_eager"] = us / layers
            combined = timer.us(bench.layer_step(name), graph=graph, iters=iters) / layers
            row[f"{name}_layer_us"] = combined
        except Exception as exc:  # e.g. a launch a graph cannot capture: reported, not fatal
            row[f"{name}_failed"] = f"timing: {type(exc).__name__}: {exc}"[:300]
    if num_tokens == 1 and bench.cuda:
        row.update(measure_fused_gemv(bench, iters))
    if ok:
        base_layer = timer.us(bench.layer_step(None), graph=graph, iters=iters) / layers
        row["base_layer_us"] = base_layer
        for name in ok:
            if f"{name}_layer_us" in row:
                row[f"{name}_added_us"] = row[f"{name}_layer_us"] - base_layer
    nbytes = layer_bytes(setup, num_tokens, num_adapters)
    row["lora_bytes_per_layer"] = nbytes
    if bandwidth:
        row["lora_floor_us"] = nbytes / bandwidth / 1e3
    timed = [n for n in ok if f"{n}_lora_us" in row]
    if timed:
        best = min(timed, key=lambda n: row[f"{n}_lora_us"])
        row["best_variant"] = best
        row["best_lora_us"] = row[f"{best}_lora_us"]
        row["default_over_base"] = row.get("default_lora_us", float("nan")) / row["base_gemm_us"]
        if bandwidth:
            row["default_over_floor"] = (
                row.get("default_lora_us", float("nan")) / row["lora_floor_us"]
            )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def measure_fused_gemv(bench: Bench, iters: int) -> dict[str, float]:
    """One token as the engine runs it: the base projections through `kernels.gemv.linear` (the
    tuned Triton GEMV), alone, followed by the default LoRA, and as the fused GEMV that carries
    the adapter (`fused_gemv_lora`, a counter per projection zeroed once a step as the engine
    does), per layer in a graph; the fused output checked first."""
    from loraplex.kernels.gemv import linear
    from loraplex.kernels.lora import fused_gemv_lora

    meta, layers = bench.meta, bench.setup.num_layers
    apply = bench.lora(DEFAULT_KERNEL_CONFIG)
    counts = torch.zeros(layers, len(bench.weights), 1, dtype=torch.int32, device=bench.device)
    row: dict[str, float] = {}
    for p, (layer, w, x) in enumerate(zip(bench.layers[0], bench.weights, bench.xs)):
        expected = linear(x, w, None)
        apply(layer, x, expected)
        fused = fused_gemv_lora(x, w, None, layer, meta.kernel_meta, meta.workspace, counts[0, p])
        if fused is None:
            return {"fused_gemv_failed": 1.0}
        err = (fused.float() - expected.float()).abs().max() / expected.float().abs().max()
        row["fused_gemv_max_rel_error"] = max(row.get("fused_gemv_max_rel_error", 0.0), err.item())

    def steps(mode: str) -> Callable[[], None]:
        def step() -> None:
            counts.zero_()
            for i, per_layer in enumerate(bench.layers):
                for p, (layer, w, x) in enumerate(zip(per_layer, bench.weights, bench.xs)):
                    if mode == "fused":
                        fused_gemv_lora(x, w, None, layer, meta.kernel_meta, meta.workspace,
                                        counts[i, p])  # fmt: skip
                        continue
                    y = linear(x, w, None)
                    if mode == "gemv_then_lora":
                        apply(layer, x, y)

        return step

    for mode in ("gemv", "gemv_then_lora", "fused"):
        row[f"{mode}_layer_us"] = bench.timer.us(steps(mode), graph=True, iters=iters) / layers
    row["gemv_then_lora_added_us"] = row["gemv_then_lora_layer_us"] - row["gemv_layer_us"]
    row["fused_added_us"] = row["fused_layer_us"] - row["gemv_layer_us"]
    return row


def profile(bench: Bench, variant: str = "default") -> dict[str, float]:
    """Device time per layer of each kernel of a variant (the default unless named in the keys),
    by case and projection (eager, under the torch profiler: kernel durations without launch
    gaps)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out: dict[str, float] = {}
    apply = bench.lora(VARIANTS[variant])
    prefix = "profile" if variant == "default" else f"profile_{variant}"
    for num_tokens, num_adapters in bench.profile_cases:
        bench.set_case(num_tokens, num_adapters)
        for p, name in enumerate(bench.setup.projections):
            x, y = bench.xs[p], bench.outs[p]
            for per_layer in bench.layers:  # compile and warm
                apply(per_layer[p], x, y)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for per_layer in bench.layers:
                    apply(per_layer[p], x, y)
                torch.cuda.synchronize()
            for event in prof.key_averages():
                us = event.self_device_time_total / bench.setup.num_layers
                if us > 0:
                    key = f"{prefix}_t{num_tokens}_a{num_adapters}_{name}_{event.key[:40]}_us"
                    out[key] = round(us, 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_lora_kernels.json",
                        help="file name in benchmarks/results/, or a path")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="start no new case after this many seconds")  # fmt: skip
    parser.add_argument("--variants", default="",
                        help="comma-separated variants to run (default: all), e.g. "
                             "default,side_stream")  # fmt: skip
    parser.add_argument("--cases", default="",
                        help="comma-separated TOKENSxADAPTERS cases to run (default: all), "
                             "e.g. 64x8,256x64; one the setup does not list runs as a decode "
                             "case")  # fmt: skip
    parser.add_argument("--profile-variants", default="default",
                        help="comma-separated variants whose kernels the profile times")  # fmt: skip
    parser.add_argument("--profile-cases", default="",
                        help="TOKENSxADAPTERS cases to profile (default: the setup's)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreter, tiny shapes; writes nothing")  # fmt: skip
    args = parser.parse_args()
    named = [v for v in f"{args.variants},{args.profile_variants}".split(",") if v]
    unknown = sorted(set(named) - set(VARIANTS) - {SIDE_STREAM})
    if unknown or SIDE_STREAM in args.profile_variants.split(","):
        parser.error(f"unknown variants {unknown or [SIDE_STREAM]} (profile: {sorted(VARIANTS)})")
    only_cases = set(_cases(parser, args.cases)) if args.cases else None
    profile_cases = _cases(parser, args.profile_cases) if args.profile_cases else None
    start = time.monotonic()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        setup, device, dtype = SMOKE, torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("lora_kernels: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    else:
        setup, device, dtype = H200, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_gbs(device.type == "cuda")
    bench = Bench(setup, device, dtype)
    bench.only = [v for v in args.variants.split(",") if v]
    metrics: dict[str, float | str] = {"copy_gbs": round(bandwidth, 1)}
    cases = [(c, False) for c in setup.decode_cases] + [(c, True) for c in setup.prefill_cases]
    if only_cases is not None:
        known = {c for c, _ in cases}
        # NOTE: a case the setup does not list runs as a decode case (the regime sweeps)
        cases = [(c, prefill) for c, prefill in cases if c in only_cases]
        cases += [(c, False) for c in _cases(parser, args.cases) if c not in known]
    for (num_tokens, num_adapters), prefill in cases:
        if time.monotonic() - start > args.budget_s:
            metrics.setdefault("skipped_cases", "")
            metrics["skipped_cases"] = f"{metrics['skipped_cases']} t{num_tokens}_a{num_adapters}"
            continue
        row = measure_case(bench, num_tokens, num_adapters, prefill, bandwidth)
        metrics.update({f"t{num_tokens}_a{num_adapters}_{k}": v for k, v in row.items()})
        summary = {k: v for k, v in row.items() if k.endswith(("lora_us", "added_us", "floor_us",
                   "base_gemm_us", "failed", "best_variant"))}  # fmt: skip
        print(f"t{num_tokens} a{num_adapters} ({time.monotonic() - start:.0f} s): {summary}",
              flush=True)  # fmt: skip
        if not args.smoke:
            _write(args.out, metrics, setup)
    if profile_cases is not None:
        bench.profile_cases = profile_cases
    if not args.smoke and time.monotonic() - start < args.budget_s + 20:
        for variant in args.profile_variants.split(","):
            metrics.update(profile(bench, variant))
        _write(args.out, metrics, setup)
    print(json.dumps({k: v for k, v in metrics.items() if "best" in k or "floor" in k}, indent=1))
    return 0


def _cases(parser: argparse.ArgumentParser, text: str) -> tuple[tuple[int, int], ...]:
    """`64x8,256x64` -> ((64, 8), (256, 64)); a malformed case stops with a usage error."""
    try:
        cases = tuple(tuple(int(n) for n in c.split("x")) for c in text.split(","))
    except ValueError:
        cases = ()
    if not cases or any(len(c) != 2 for c in cases):
        parser.error(f"cases are TOKENSxADAPTERS, comma-separated: {text!r}")
    return cases  # type: ignore[return-value]


def _triton_version() -> str:
    import triton

    return triton.__version__


def _write(out: str, metrics: dict, setup: Setup) -> Path:
    return write_result(
        out, "lora_kernels", metrics,
        {"previous": "h200_lora_kernels.json at b945ecd (the pair of two launches per "
                     "projection): 26.6 / 60.2 / 80.6 / 89.2 / 182.9 us per layer in a graph at "
                     "t1_a1 / t64_a1 / t64_a64 / t256_a4 / t256_a64"},
        config={"shapes": "Llama-3.1-8B", "dtype": "bfloat16", "rank": RANK,
                "max_loras": setup.num_slots, "lora_layers_cycled": setup.num_layers,
                "variants": {name: dataclasses.asdict(c) for name, c in VARIANTS.items()},
                "side_stream": "the default pair, its shrink on a second stream beside the GEMM",
                "torch": torch.__version__, "triton": _triton_version()},
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
