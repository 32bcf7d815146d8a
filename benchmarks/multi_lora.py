"""Multi-LoRA serving: output tokens/s with 8 and 64 adapters on 64 GPU slots and
256 adapters churning through them, against base-only serving of the same requests; the same
requests with no adapter on the LoRA engine against an engine without LoRA; TPOT at batch 1 with
an adapter against without; and the time from an adapter's registration to its first token while
256 other sequences decode, with those sequences' ITL p99 meanwhile. On the bf16 base and, with
`--base awq` (or `bf16,awq`), on the AWQ base against the AWQ base without LoRA.

    python -m benchmarks.multi_lora                         # H200: Llama-3.1-8B shape, bf16
    python -m benchmarks.multi_lora --base awq --adapters 8,64 --no-registration
    python -m benchmarks.multi_lora --device cpu            # tiny run, embedded model

Workload (cuda): 256 requests (`--num-prompts`), input and output lengths uniform in [128, 512]
and [64, 256], ignore_eos, greedy, again at temperature 1.0 (the openai SDK's default; metrics
with a `_t1` suffix) and as a mixed-sampling batch (request i takes mix i mod 9 of
`benchmarks.sampling`: penalties, top-k/p, min-p, seeds, logprobs; `_mixed` suffix;
`--samplings` picks a subset). With 8 and 64 adapters request i runs adapter i mod k; with 256
adapters on 64 slots each request draws its adapter from a Zipf (s = 1) popularity over the 256,
as tenants' traffic is: hot adapters stay resident while the tail churns through the slots (one
request per adapter would cap the batch at the slot count, 64 of 256 sequences, whatever the
engine did). Adapters are random, rank 16 on all seven projections, written as PEFT folders
(kept in `--adapter-dir` between runs and bases) and registered like the API does (`AddAdapter`
with their content digest). The base model is measured in the same run, on an engine with LoRA
disabled. Before each timed run every adapter of the run is read into the host cache
(`max_cpu_loras` holds them all), so the 256-adapter run measures slot churn (host -> GPU copies
on the side stream, requests waiting in the queue for their slot), not disk.

Registration to first token (skipped with `--no-registration`): 256 sequences on 63 adapters
(one of the 64 slots left idle) decode long outputs; after a few steps a fresh adapter (written
beforehand, never read) is registered and one request on it added at once; we step until its
first token. Step times are the other sequences' inter-token latency (each decodes one token a
step): their p99 during the load is recorded beside the p99 of as many steps before it.

Metrics (awq_-prefixed on the AWQ base): ratio_vs_base_8, ratio_vs_base_64,
ratio_vs_base_256_on_64_slots and ratio_lora_engine_no_adapters (greedy) with their `_t1` and
`_mixed` twins, tpot_bs1_lora_over_base, registration_to_first_token_s, itl_p99_during_load_ms,
itl_p99_before_load_ms, the engine thread's time per slot write from the first load on
(slot_write_host_us_mean / _p99, slot_writes), and the tok/s and TPOT figures behind them.
Each adapter run also records its engine steps (lora_<k>_steps, the base's as base_steps) and
step_ratio_<k>: the base's steps over its own, the ratio the admission alone allows were every
step to cost the same. Past the slots it falls below 1: a request whose adapter has no slot
waits, and the batch thins while the tail of the adapters drains through the slots.

Adapter forms, `--forms dora,lm_head`: one LoRA engine holds 64 plain adapters and 64
of each form (rank 16 on all seven projections; DoRA adds a magnitude per projection, set near
the base rows' norms as DoRA's initialisation does; lm_head adds rank-16 LoRA on the output
head), every adapter resident (one slot each). The same requests run on the plain adapters and
on each form's (request i on adapter i mod 64), greedy, at temperature 1.0 (`_t1`) and as the
mixed-sampling batch above (`_mixed`). Metrics: forms_<form>_out_tok_s<suffix> and
ratio_<form>_vs_plain<suffix> (target >= 0.9); the baseline is the plain adapters' tok/s.

    python -m benchmarks.multi_lora --forms dora,lm_head --adapter-dir /tmp/ml21_adapters
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks.common.engine import LLAMA_8B, bench_llm
from benchmarks.common.prompts import mix_params, random_prompts
from benchmarks.common.random_adapter import write_random_adapter
from benchmarks.common.sampling_mixes import GREEDY, MIXED, T1
from benchmarks.common.stats import quantile
from benchmarks.common.timing import wall_seconds
from benchmarks.record import write_result
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, content_digest
from loraplex.platform.core.commands import AddAdapter, GetAdapterStats
from loraplex.platform.engine.engine import Engine

SAMPLINGS = ("", "_t1", "_mixed")  # metric suffixes: greedy, temperature 1.0, mixed
ZIPF_S = 1.0
RANK = 16
FORMS = ("dora", "lm_head")
FORM_ADAPTERS = 64  # adapters of each form (and plain ones) in a `--forms` run


def settings(cpu: bool) -> dict:
    if cpu:
        return dict(num_requests=12, input_len=(8, 24), output_len=(4, 12), adapters=[2, 4, 8],
                    slots=4, running=12, tpot_steps=8, prompt_len=8)  # fmt: skip
    return dict(num_requests=256, input_len=(128, 512), output_len=(64, 256),
                adapters=[8, 64, 256], slots=64, running=256, tpot_steps=128, prompt_len=32)  # fmt: skip


def build_engine(args, enable_lora: bool) -> LLM:
    start = time.perf_counter()
    lora = dict(enable_lora=enable_lora, max_loras=args.slots, max_lora_rank=RANK,
                max_cpu_loras=max(*args.adapters, args.slots) + 8)  # fmt: skip
    if args.device == "cpu":
        llm = LLM(args.model, device="cpu", dtype="float32", seed=0, num_kv_blocks=256,
                  max_model_len=512, max_num_seqs=args.running + 4, async_scheduling=True,
                  **lora)  # fmt: skip
    else:
        llm = bench_llm(args.model, dtype=args.dtype, max_model_len=2048,
                        max_num_batched_tokens=8192, max_num_seqs=args.running + 8,
                        gpu_memory_utilization=0.7, **lora)  # fmt: skip
    print(f"engine (lora={enable_lora}) ready in {time.perf_counter() - start:.1f} s")
    return llm


def request_lengths(rng: random.Random, num_requests: int, input_len, output_len):
    """(input, output) length of each request, drawn in turn from `rng`."""
    return [(rng.randint(*input_len), rng.randint(*output_len)) for _ in range(num_requests)]


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(2)
    lens = request_lengths(rng, args.num_requests, args.input_len, args.output_len)
    return random_prompts(rng, vocab, [i for i, _ in lens]), [o for _, o in lens]


def sampling_params(suffix: str, outputs: list[int]) -> list[SamplingParams]:
    """Each request's parameters for the sampling mode of metric suffix `suffix`."""
    if suffix == "_mixed":
        return mix_params(MIXED, outputs)
    fields = T1 if suffix == "_t1" else GREEDY
    return [SamplingParams(max_tokens=o, **fields) for o in outputs]


def zipf_choices(k: int, n: int, seed: int = 3) -> list[int]:
    """n adapter indices in [0, k), index j drawn with weight 1 / (j + 1) ** ZIPF_S."""
    weights = [1.0 / (j + 1) ** ZIPF_S for j in range(k)]
    return random.Random(seed).choices(range(k), weights=weights, k=n)


class Served(NamedTuple):
    tok_s: float  # output tokens/s
    steps: int  # engine steps it took


def serve(llm: LLM, prompts, outputs, loras=None, suffix: str = "") -> Served:
    """Output tokens/s and engine steps of one `generate` over all requests, from an empty
    prefix cache."""
    params = sampling_params(suffix, outputs)
    engine = llm.engine
    engine.scheduler.kv.reset_prefix_cache()
    step, count = engine.step, [0]

    def counted():
        count[0] += 1
        return step()

    engine.step = counted  # NOTE: an instance attribute over the method, removed after
    try:
        seconds = wall_seconds(lambda: llm.generate(prompts, params, lora_request=loras))
    finally:
        del engine.step
    return Served(sum(outputs) / seconds, count[0])


def tpot(llm: LLM, steps: int, prompt_len: int, lora: LoRARequest | None) -> float:
    """Seconds per output token at batch 1 (greedy): (time of steps + 1 tokens - time of 1)
    / steps, median of 3."""
    vocab = llm.engine.runner.arch.vocab_size
    rng = random.Random(5)

    def one(n: int) -> float:
        prompt = random_prompts(rng, vocab, [prompt_len])
        params = SamplingParams(max_tokens=n, **GREEDY)
        return wall_seconds(lambda: llm.generate(prompt, params, lora_request=lora))

    one(8)
    return statistics.median((one(steps + 1) - one(1)) / steps for _ in range(3))


def write_adapters(args, llm: LLM, folder: Path, count: int) -> list[AddAdapter]:
    """`count` random adapters (kept in `folder` across runs) as the API registers them."""
    arch, device = llm.engine.runner.arch, llm.engine.runner.device
    start = time.perf_counter()
    commands = []
    for i in range(count):
        path = folder / f"a{i}"
        if not (path / WEIGHTS_FILE).is_file():
            write_random_adapter(path, arch, rank=RANK, seed=i, device=device)
        commands.append(_add_command(f"a{i}", path))
    print(f"{count} adapters ready in {time.perf_counter() - start:.1f} s")
    return commands


def _workload(args) -> dict:
    """What every record of this benchmark says about its requests."""
    return {"model": args.model, "num_requests": args.num_requests,
            "input_uniform": list(args.input_len), "output_uniform": list(args.output_len),
            "rank": RANK}  # fmt: skip


def _add_command(name: str, path: Path) -> AddAdapter:
    digest = content_digest((path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes())
    return AddAdapter(name, str(path), digest)


def warm_host_cache(engine: Engine, commands: list[AddAdapter]) -> None:
    """Register the adapters and read each into the host cache (off the clock)."""
    start = time.perf_counter()
    manager = engine.lora_manager
    keys = [engine.handle_command(c).key for c in commands]
    for key in keys:
        manager.admission.prefetch(key)
    while any(not manager.pool.has_host(k) and manager.pool.slot_of(k) is None for k in keys):
        manager.wait_for_loads(0.05)
        manager.poll()
        if manager.take_failures():
            raise RuntimeError("an adapter failed to load")
    print(f"{len(keys)} adapters in the host cache in {time.perf_counter() - start:.1f} s")


class TimedSlotWriter:
    """Stands in for the slot pool's writer and records the engine thread's time per slot
    write (the host side of issuing the copies, not the copies themselves)."""

    def __init__(self, writer) -> None:
        self._writer = writer
        self.seconds: list[float] = []

    def write_slot(self, slot: int, image) -> None:
        start = time.perf_counter()
        self._writer.write_slot(slot, image)
        self.seconds.append(time.perf_counter() - start)


def registration_to_first_token(args, llm: LLM, commands: list[AddAdapter], fresh: AddAdapter):
    """(seconds from AddAdapter to the new adapter's first token, ITL p99 during the load in
    ms, ITL p99 of as many steps before it in ms) while `args.running` sequences decode."""
    engine = llm.engine
    vocab = engine.runner.arch.vocab_size
    rng = random.Random(9)
    long = SamplingParams(max_tokens=engine.max_model_len - 64, **GREEDY)
    # NOTE: the running sequences use all slots but one: with every slot held by a running
    # request, a new adapter would wait for one to drain (see SlotAdmission), a different figure.
    num_adapters = min(args.slots - 1, len(commands))
    for i in range(args.running):
        name = commands[i % num_adapters].name
        engine.add_request(f"bg-{i}", random_prompts(rng, vocab, [16])[0], long,
                           lora_request=LoRARequest(name, "/registered"))  # fmt: skip
    while engine.scheduler.num_waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    before = []
    for _ in range(32):
        t0 = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t0)
    start = time.perf_counter()
    engine.handle_command(fresh)
    engine.add_request("fresh", random_prompts(rng, vocab, [16])[0],
                       SamplingParams(max_tokens=4, **GREEDY),
                       lora_request=LoRARequest(fresh.name, "/registered"))  # fmt: skip
    during = []
    first = None
    while first is None:
        t0 = time.perf_counter()
        outputs = engine.step()
        during.append(time.perf_counter() - t0)
        if any(o.request_id == "fresh" and o.outputs[0].token_ids for o in outputs):
            first = time.perf_counter() - start
        if time.perf_counter() - start > 120:
            raise TimeoutError("the fresh adapter produced no token within 120 s")
    for i in range(args.running):
        engine.abort_request(f"bg-{i}")
    engine.abort_request("fresh")
    engine.generate_blocking(deadline_s=60)
    return (
        first,
        quantile(during, 0.99) * 1e3,
        quantile(before[-len(during) :] or before, 0.99) * 1e3,
    )


def base_row_norms(llm: LLM) -> dict[tuple[int, str], torch.Tensor]:
    """`||W_i||` of every output row of every projection, keyed by (layer, module): the
    magnitude DoRA starts training from (on the device)."""
    norms = {}
    for module in llm.engine.runner.model.modules():
        shards, prefix = getattr(module, "shard_names", None), getattr(module, "prefix", "")
        if shards is None or ".layers." not in prefix:
            continue
        layer = int(prefix.split(".layers.")[1].split(".")[0])
        rows = module.method.dequantized_weight(module).float().norm(dim=1)  # [out]
        offsets = module.shard_offsets()
        for name, lo, hi in zip(shards, offsets, offsets[1:]):
            norms[(layer, name)] = rows[lo:hi]
    return norms


def write_form_adapters(llm: LLM, folder: Path, form: str, count: int) -> list[AddAdapter]:
    """`count` random adapters of `form` ("plain", "dora", "lm_head"), kept in `folder`."""
    arch, device = llm.engine.runner.arch, llm.engine.runner.device
    norms = base_row_norms(llm) if form == "dora" else {}
    start = time.perf_counter()
    commands = []
    for i in range(count):
        path = folder / f"{form}{i}"
        if not (path / WEIGHTS_FILE).is_file():
            gen = torch.Generator(device=device).manual_seed(10_000 + i)

            def magnitude(layer: int, module: str, gen=gen) -> torch.Tensor:
                base = norms[(layer, module)]
                return base * (1 + 0.1 * torch.randn(base.shape, generator=gen, device=device))

            write_random_adapter(path, arch, rank=RANK, seed=i, device=device,
                                 dora_magnitude=magnitude if form == "dora" else None,
                                 lm_head=form == "lm_head")  # fmt: skip
        commands.append(_add_command(f"{form}{i}", path))
    print(f"{count} {form} adapters ready in {time.perf_counter() - start:.1f} s")
    return commands


def run_forms(args, folder: Path) -> int:
    """The `--forms` run: each form's adapters against plain ones on one engine."""
    forms = [f for f in args.forms.split(",") if f]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise SystemExit(f"--forms: unknown {unknown}; choose from {list(FORMS)}")
    count = args.form_adapters
    args.slots = count * (1 + len(forms))
    args.adapters = [args.slots]
    llm = build_engine(args, enable_lora=True)
    prompts, outputs = workload(args, llm.engine.runner.arch.vocab_size)
    groups = {form: write_form_adapters(llm, folder, form, count) for form in ["plain", *forms]}
    warm_host_cache(llm.engine, [c for commands in groups.values() for c in commands])
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    short = [max(4, o // 4) for o in outputs]
    for form, commands in groups.items():
        loras = [LoRARequest(c.name, "/registered") for c in commands]
        mix = [loras[i % count] for i in range(len(prompts))]
        # NOTE: every prompt, short outputs: this form's slots and every shape the timed runs
        # meet (a first timed run that paid them ran at half the speed of the others)
        serve(llm, prompts, short, mix)
        for suffix in SAMPLINGS:
            tok_s = serve(llm, prompts, outputs, mix, suffix)
            if form == "plain":
                baseline[f"forms_plain_out_tok_s{suffix}"] = tok_s
            else:
                metrics[f"forms_{form}_out_tok_s{suffix}"] = tok_s
                metrics[f"ratio_{form}_vs_plain{suffix}"] = (
                    tok_s / baseline[f"forms_plain_out_tok_s{suffix}"]
                )
            print(f"{form}{suffix or '_greedy'}: {tok_s:.0f} tok/s")
    stats = llm.engine.handle_command(GetAdapterStats())
    metrics["gpu_evictions"] = sum(a.evictions for a in stats.adapters)
    write_result(
        args.out or ("cpu_multi_lora_forms.json" if args.device == "cpu"
                     else "h200_multi_lora_forms.json"),
        "multi_lora_forms",
        metrics,
        baseline,
        workload={
            **_workload(args),
            "target_modules": "q,k,v,o,gate,up,down (+ lm_head for lm_head)",
            "adapters_per_form": count,
            "forms": ["plain", *forms],
            "gpu_slots": args.slots,
        },
    )  # fmt: skip
    return 0


BASES = {  # name: (model config, dtype) on CUDA; metric prefix "<name>_" except bf16
    "bf16": (LLAMA_8B, "bfloat16"),
    "awq": ("configs/models/llama-3.1-8b-awq.json", "auto"),
}


def run_base(args, folder: Path, base: str) -> tuple[dict[str, float], dict[str, float]]:
    """One base model's figures: base-only serving on an engine without LoRA, then on a LoRA
    engine the same requests with no adapter and on k adapters, batch-1 TPOT, and (unless
    `--no-registration`) registration to first token; names prefixed `<base>_` but for bf16."""
    cpu, pre = args.device == "cpu", "" if base == "bf16" else f"{base}_"
    if not cpu:
        args.model, args.dtype = BASES[base]
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    k_max, slots = max(args.adapters), args.slots

    llm = build_engine(args, enable_lora=False)
    prompts, outputs = workload(args, llm.engine.runner.arch.vocab_size)
    # NOTE: warm-ups run every prompt (short outputs): each prefill shape and batch size the
    # timed runs meet, so no timed run pays a first-time cost the others do not.
    short = [max(4, o // 4) for o in outputs]
    serve(llm, prompts, short)
    for suffix in args.samplings:
        run = serve(llm, prompts, outputs, suffix=suffix)
        baseline[f"{pre}base_out_tok_s{suffix}"] = run.tok_s
        baseline[f"{pre}base_steps{suffix}"] = run.steps
    baseline[f"{pre}tpot_bs1_base_s"] = tpot(llm, args.tpot_steps, args.prompt_len, None)
    print(f"{base} base (LoRA disabled): {baseline}")
    del llm
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()

    llm = build_engine(args, enable_lora=True)
    # NOTE: the same requests on the LoRA engine with no adapter: the graphs without LoRA
    # kernels and the eager steps that skip LoRA (target >= 0.99x)
    serve(llm, prompts, short)
    for suffix in args.samplings:
        tok_s = serve(llm, prompts, outputs, suffix=suffix).tok_s
        metrics[f"{pre}lora_engine_no_adapters_out_tok_s{suffix}"] = tok_s
        metrics[f"{pre}ratio_lora_engine_no_adapters{suffix}"] = (
            tok_s / baseline[f"{pre}base_out_tok_s{suffix}"]
        )
    commands = write_adapters(args, llm, folder, k_max + 1)
    fresh = _add_command("fresh", Path(commands[-1].path))
    commands = commands[:-1]
    pool = llm.engine.lora_manager.pool
    timed = pool._writer = TimedSlotWriter(pool._writer)
    warm_host_cache(llm.engine, commands)
    loras = [LoRARequest(c.name, "/registered") for c in commands]
    serve(llm, prompts, short, [loras[i % min(slots, k_max)] for i in range(len(prompts))])
    for k in args.adapters:
        label = f"{k}" if k <= slots else f"{k}_on_{slots}_slots"
        if k <= slots:
            mix = [loras[i % k] for i in range(len(prompts))]
        else:
            mix = [loras[j] for j in zipf_choices(k, len(prompts))]
        for suffix in args.samplings:
            run = serve(llm, prompts, outputs, mix, suffix)
            metrics[f"{pre}lora_{label}_out_tok_s{suffix}"] = run.tok_s
            metrics[f"{pre}ratio_vs_base_{label}{suffix}"] = (
                run.tok_s / baseline[f"{pre}base_out_tok_s{suffix}"]
            )
            # NOTE: the base's steps over these: the ratio the admission alone allows were every
            # step to cost the same (adapters past the slots wait for one, and the batch thins)
            metrics[f"{pre}lora_{label}_steps{suffix}"] = run.steps
            metrics[f"{pre}step_ratio_{label}{suffix}"] = (
                baseline[f"{pre}base_steps{suffix}"] / run.steps
            )
        stats = llm.engine.handle_command(GetAdapterStats())
        evictions = sum(a.evictions for a in stats.adapters)
        figures = ", ".join(f"{metrics[f'{pre}lora_{label}_out_tok_s{x}']:.0f} {x or '_greedy'}"
                            for x in args.samplings)  # fmt: skip
        print(f"{base}: {k} adapters on {slots} slots: {figures} tok/s; {evictions} evictions")
    if timed.seconds:
        metrics[f"{pre}slot_writes"] = len(timed.seconds)
        metrics[f"{pre}slot_write_host_us_mean"] = statistics.mean(timed.seconds) * 1e6
        metrics[f"{pre}slot_write_host_us_p99"] = quantile(timed.seconds, 0.99) * 1e6
    tpot_lora = tpot(llm, args.tpot_steps, args.prompt_len, loras[0])
    metrics[f"{pre}tpot_bs1_lora_s"] = tpot_lora
    metrics[f"{pre}tpot_bs1_lora_over_base"] = tpot_lora / baseline[f"{pre}tpot_bs1_base_s"]
    if not args.no_registration:
        first, during, before = registration_to_first_token(args, llm, commands, fresh)
        metrics[f"{pre}registration_to_first_token_s"] = first
        metrics[f"{pre}itl_p99_during_load_ms"] = during
        metrics[f"{pre}itl_p99_before_load_ms"] = before
        print(f"registration -> first token {first:.3f} s under {args.running} sequences; ITL "
              f"p99 {during:.1f} ms during the load, {before:.1f} ms before")  # fmt: skip
    del llm
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    return metrics, baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default=None, help="cpu only (default: the embedded model); "
                        "on cuda --base picks the Llama-3.1-8B config")  # fmt: skip
    parser.add_argument("--base", default="bf16",
                        help=f"comma list of {list(BASES)} (cuda): each base's figures, the "
                        "awq ones prefixed awq_ (against the AWQ base without LoRA)")  # fmt: skip
    parser.add_argument("--adapter-dir", default=None, help="where adapters are kept")
    parser.add_argument("--out", default=None, help="h200_multi_lora.json / cpu_multi_lora.json")
    parser.add_argument(
        "--forms",
        default="",
        help=f"comma list of {list(FORMS)}: measure "
        "those adapter forms against plain LoRA instead (see the module doc)",
    )
    parser.add_argument(
        "--form-adapters",
        type=int,
        default=None,
        help=f"adapters per form (default {FORM_ADAPTERS}; 4 on cpu)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per run")
    parser.add_argument(
        "--adapters",
        dest="adapter_counts",
        default=None,
        help="comma list of adapter counts (default 8,64,256 on cuda; counts beyond the slots "
        "churn through them)",
    )
    parser.add_argument("--samplings", default="greedy,t1,mixed",
                        help="comma list of greedy, t1, mixed")  # fmt: skip
    parser.add_argument("--no-registration", action="store_true",
                        help="skip registration-to-first-token under load")  # fmt: skip
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("benchmarks.multi_lora needs a CUDA GPU (or --device cpu); skipped")
        return 0
    for name, value in settings(cpu).items():
        setattr(args, name, value)
    if args.num_prompts is not None:
        args.num_requests = args.num_prompts
    if args.adapter_counts is not None:
        args.adapters = [int(k) for k in args.adapter_counts.split(",") if k]
        if not args.adapters or min(args.adapters) < 1:
            raise SystemExit("--adapters: a comma list of positive counts")
    names = {"greedy": "", "t1": "_t1", "mixed": "_mixed"}
    samplings = [x for x in args.samplings.split(",") if x]
    if not samplings or set(samplings) - set(names):
        raise SystemExit(f"--samplings: a comma list of {list(names)}")
    args.samplings = [names[x] for x in samplings]
    bases = [b for b in args.base.split(",") if b]
    if not bases or set(bases) - set(BASES) or (cpu and bases != ["bf16"]):
        raise SystemExit(f"--base: a comma list of {list(BASES)} (cpu: bf16 only)")
    if args.form_adapters is None:
        args.form_adapters = 4 if cpu else FORM_ADAPTERS
    args.dtype = "bfloat16"
    if args.model is None:
        if cpu:
            from loraplex.platform.models.model_store import ensure_default_model

            args.model = str(ensure_default_model(progress=False))
        else:
            args.model = BASES["bf16"][0]
    folder = Path(args.adapter_dir or tempfile.mkdtemp(prefix="loraplex-multi-lora-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.forms:
        return run_forms(args, folder)
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    for base in bases:
        base_metrics, base_baseline = run_base(args, folder, base)
        metrics.update(base_metrics)
        baseline.update(base_baseline)
    write_result(
        args.out or ("cpu_multi_lora.json" if cpu else "h200_multi_lora.json"),
        "multi_lora",
        metrics,
        baseline,
        workload={
            **_workload(args),
            "bases": {b: BASES[b] for b in bases} if not cpu else {"bf16": args.model},
            "target_modules": "q,k,v,o,gate,up,down",
            "adapters": args.adapters,
            "adapter_choice": f"i mod k for k <= slots; Zipf(s={ZIPF_S}) over k beyond",
            "gpu_slots": args.slots,
            "samplings": samplings,
            "running_sequences_for_registration": args.running,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
