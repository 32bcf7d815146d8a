"""Speculative decoding (issue 22): acceptance and TPOT with the n-gram proposer on the embedded
SmolLM2-135M-Instruct, and on the Llama-3.1-8B shape (random weights) the cost of verifying k
drafts in one step against a plain decode step, the expected TPOT it gives, and where
speculation stops paying (the batch size for `disable_by_batch_size`).

    python -m benchmarks.speculative [--part all|smol|8b] [--out h200_speculative.json]

Every case runs greedy, at temperature 1.0 (the `openai` SDK's default) and as a mixed batch
(greedy, t=1.0, t=0.7 with top-p 0.9, t=1.0 with top-k 50, in turn).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.gpu_path import bench_llm, cuda_timed
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.runner.sampling_metadata import build_sampling_metadata
from loraplex.platform.spec.verifier import verify

_TEXT = (
    "The comittee met on tuesday to discus the budjet for the next fiscal year. Members "
    "agreed that the library needs new computers, that the park benches should be repaired "
    "before summer, and that the town website is out of date. The treasurer reported that "
    "revenue from parking fees rose by twelve percent, while spending on road maintenance "
    "stayed flat. A vote on the new bike lanes was postponed until the next meeting, when "
    "the traffic study will be ready."
)
_CODE = """def total(items):
    t = 0
    for i in range(len(items)):
        t = t + items[i]["price"] * items[i]["qty"]
    return t


def average(items):
    t = 0
    for i in range(len(items)):
        t = t + items[i]["price"]
    return t / len(items)
"""
COPY_PROMPTS = [
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{_TEXT}",
    f"Rewrite this code with clearer variable names, keeping its behaviour; return the full "
    f"code:\n\n```python\n{_CODE}```",
    f"Repeat the following text word for word:\n\n{_TEXT}",
    f"Add a docstring to each function and return the full code:\n\n```python\n{_CODE}```",
]
CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy while working from home?",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me ideas for a weekend trip in the mountains.",
]
MODES = {
    "greedy": [dict(temperature=0.0)],
    "t1": [dict(temperature=1.0)],
    "mixed": [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=50),
    ],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
_KV_BLOCKS_8B = 4096  # 8 GiB each at 8B: room for two engines and batch 64 x 520 tokens


def record_pair(key: str, plain: dict, spec: dict, metrics: dict) -> None:
    """One workload's `run_batch` results without and with speculation, as metrics and a line."""
    for name in ("tpot_ms", "tokens_per_s"):
        metrics[f"{key}_plain_{name}"] = plain[name]
        metrics[f"{key}_spec_{name}"] = spec[name]
    metrics[f"{key}_tpot_speedup"] = plain["tpot_ms"] / spec["tpot_ms"]
    metrics[f"{key}_acceptance_rate"] = spec["acceptance_rate"]
    metrics[f"{key}_mean_acceptance_length"] = spec["mean_acceptance_length"]
    print(
        f"{key}: tpot {plain['tpot_ms']:.2f} -> {spec['tpot_ms']:.2f} ms "
        f"({metrics[f'{key}_tpot_speedup']:.2f}x), {plain['tokens_per_s']:.0f} -> "
        f"{spec['tokens_per_s']:.0f} tok/s, acceptance length "
        f"{spec['mean_acceptance_length']:.2f}"
    )


def run_batch(
    llm: LLM,
    prompts: list[str] | list[list[int]],
    mode: str,
    max_tokens: int,
    outputs: dict[int, list[int]] | None = None,
    **options: bool,
) -> dict[str, float]:
    """Generate the `prompts` at once (chat messages, or token ids sent as they are); mean
    per-request TPOT (decode time after the first token over the tokens after it), tokens,
    output tokens a second, and the speculation counters' change. `outputs` collects each
    prompt's output tokens by its index; `options`: more SamplingParams fields (ignore_eos
    for random weights)."""
    engine = llm.engine
    tok = engine.tokenizer
    before = engine.stats().spec_decoding
    ids = {}
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        sampling = MODES[mode][i % len(MODES[mode])]
        params = SamplingParams(max_tokens=max_tokens, seed=1000 + i, **sampling, **options)
        if isinstance(prompt, str):
            token_ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        else:
            token_ids = prompt
        ids[engine.add_request(None, "", params, prompt_token_ids=token_ids)] = i
    tpots, tokens = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                n = len(out.outputs[0].token_ids)
                tokens += n
                if outputs is not None:
                    outputs[ids[out.request_id]] = list(out.outputs[0].token_ids)
                first = out.metrics.first_token_time
                if n > 1 and first is not None:
                    tpots.append((time.monotonic() - first) / (n - 1))
    wall = time.monotonic() - start
    result = {
        "tpot_ms": statistics.mean(tpots) * 1e3,
        "tokens": float(tokens),
        "tokens_per_s": tokens / wall,
    }
    after = engine.stats().spec_decoding
    if after is not None:
        drafts = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        steps = after.num_drafts - (before.num_drafts if before else 0)
        result["acceptance_rate"] = accepted / drafts if drafts else 0.0
        result["mean_acceptance_length"] = 1 + accepted / steps if steps else 1.0
    return result


def smol_part(max_tokens: int, batch_sizes: list[int]) -> dict[str, float]:
    """(a) n-gram speculation on the embedded model against the same engine without it."""
    # NOTE: fixed KV pools: the second engine's memory budget would count the first's.
    base = LLM(None, enable_lora=False, num_kv_blocks=4096, seed=0)
    spec = LLM(None, enable_lora=False, num_kv_blocks=4096, seed=0, speculative_config=NGRAM)
    metrics: dict[str, float] = {}
    for llm in (base, spec):  # warm-up: CUDA graphs, sampler and attention kernels
        run_batch(llm, COPY_PROMPTS[:2], "mixed", 16)
    for workload, pool in (("copy", COPY_PROMPTS), ("chat", CHAT_PROMPTS)):
        for bs in batch_sizes:
            prompts = [pool[i % len(pool)] for i in range(bs)]
            for mode in MODES:
                b = run_batch(base, prompts, mode, max_tokens)
                s = run_batch(spec, prompts, mode, max_tokens)
                record_pair(f"smol_{workload}_bs{bs}_{mode}", b, s, metrics)
    del base, spec
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return metrics


def forward_cost(
    llm: LLM, bs: int, num_new: int, context: int, iters: int, graphed: bool = False
) -> float:
    """Seconds of one target forward (and logits of every new token) for `bs` sequences of
    `context` cached tokens each verifying `num_new` new ones: eager, or replayed from a CUDA
    graph (`graphed`; NaN if the shape cannot be captured)."""
    runner = llm.engine.runner
    dev, block = runner.device, runner.block_size
    total = context + num_new
    width = -(-total // block)
    if bs * width > runner.num_blocks:
        raise ValueError(f"batch {bs} x {total} tokens does not fit {runner.num_blocks} blocks")
    tables = torch.arange(bs * width, dtype=torch.int32, device=dev).view(bs, width)
    pos = torch.arange(context, total, device=dev).repeat(bs)  # [bs * num_new]
    seq = torch.arange(bs, device=dev).repeat_interleave(num_new)
    slots = tables[seq, pos // block].long() * block + pos % block
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev) * num_new,
        seq_lens=torch.full((bs,), total, dtype=torch.int32, device=dev),
        block_tables=tables,
        max_query_len=num_new,
        max_seq_len=total,
    )
    ids = torch.randint(100, runner.arch.vocab_size - 100, (bs * num_new,), device=dev)

    def step() -> None:
        with torch.inference_mode():
            runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta))

    step()
    eager = min(cuda_timed(lambda: [step() for _ in range(iters)]) for _ in range(3)) / iters
    if not graphed or not torch.cuda.is_available():
        return eager
    # NOTE: the step replayed from a CUDA graph, as plain decode runs: the cost that capturing
    # the verification shapes would give (eager steps are bound by kernel launches).
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
    except RuntimeError as e:  # a shape whose kernels cannot be captured: say so, keep eager
        print(f"graph capture failed for bs {bs} x {num_new}: {e}")
        return float("nan")
    return min(cuda_timed(lambda: [graph.replay() for _ in range(iters)]) for _ in range(3)) / iters


def verify_cost(vocab: int, bs: int, k: int, mode: str, dev: torch.device, iters: int) -> float:
    """Seconds of the acceptance of k drafts per row over [bs * (k + 1), vocab] logits."""
    n = bs * (k + 1)
    logits = torch.randn(n, vocab, device=dev)
    temps = [MODES[mode][i % len(MODES[mode])].get("temperature", 1.0) for i in range(bs)]
    top_p = [MODES[mode][i % len(MODES[mode])].get("top_p", 1.0) for i in range(bs)]
    top_k = [MODES[mode][i % len(MODES[mode])].get("top_k", 0) for i in range(bs)]
    meta = build_sampling_metadata(bs, vocab, dev, temperature=temps, top_p=top_p, top_k=top_k)
    lens = np.full(bs, k, dtype=np.int64)
    drafts = np.random.default_rng(0).integers(0, vocab, (bs, k))
    sampling = None if mode == "greedy" else meta

    def run() -> None:
        verify(logits, lens, drafts, sampling, None)

    run()
    return min(cuda_timed(lambda: [run() for _ in range(iters)]) for _ in range(3)) / iters


def expected_speedup(plain: float, step: float, k: int, alpha: float) -> float:
    """TPOT of plain decode over that of speculation with k drafts accepted each with
    probability alpha (independently): a step emits (1 - alpha^(k+1)) / (1 - alpha) tokens."""
    return plain / (step / sum(alpha**i for i in range(k + 1)))


def alpha_for_length(k: int, length: float) -> float:
    """The per-token acceptance probability at which k drafts give `length` tokens a step."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def eight_b_part(
    model: str, batch_sizes: list[int], max_k: int, context: int, graphed: bool, engine: bool
) -> dict:
    """(b) The 8B shape: forward + acceptance cost of k = 1..max_k drafts against a plain
    decode step (graph replay + sampling), and the expected TPOT speed-up from them."""
    llm = bench_llm(model, max_num_seqs=max(batch_sizes), num_kv_blocks=_KV_BLOCKS_8B)
    runner = llm.engine.runner
    vocab, dev = runner.arch.vocab_size, runner.device
    metrics: dict[str, float] = {}
    disable_at: int | None = None
    for bs in batch_sizes:
        iters = 10 if bs <= 8 else 5
        plain_fwd = forward_cost(llm, bs, 1, context, iters)
        replay = None
        if runner.graphs is not None and bs in runner.graphs.graphs:
            # NOTE: the captured graph attends to its capture-time context (none): a plain
            # step at its cheapest, so the speed-ups below are conservative.
            graph, n = runner.graphs.graphs[bs], iters
            replay = min(cuda_timed(lambda g=graph, n=n: [g.replay() for _ in range(n)])
                         for _ in range(3)) / iters  # fmt: skip
        plain = replay if replay is not None else plain_fwd
        metrics[f"bs{bs}_decode_eager_ms"] = plain_fwd * 1e3
        if replay is not None:
            metrics[f"bs{bs}_decode_graph_ms"] = replay * 1e3
        forwards = {k: forward_cost(llm, bs, k + 1, context, iters) for k in range(1, max_k + 1)}
        for k, fwd in forwards.items():
            metrics[f"bs{bs}_k{k}_forward_ms"] = fwd * 1e3
        if graphed:
            plain_graph = forward_cost(llm, bs, 1, context, iters, graphed=True)
            metrics[f"bs{bs}_decode_graph_context_ms"] = plain_graph * 1e3
            if plain_graph == plain_graph:  # NOTE: the same context as the verify shapes
                plain = plain_graph
            for k in forwards:
                fwd = forward_cost(llm, bs, k + 1, context, iters, graphed=True)
                metrics[f"bs{bs}_k{k}_forward_graph_ms"] = fwd * 1e3
                if fwd == fwd:
                    forwards[k] = fwd
        for mode in MODES:
            plain_step = plain + verify_cost(vocab, bs, 0, mode, dev, iters)
            metrics[f"bs{bs}_{mode}_plain_step_ms"] = plain_step * 1e3
            best = 0.0
            for k, fwd in forwards.items():
                step = fwd + verify_cost(vocab, bs, k, mode, dev, iters)
                metrics[f"bs{bs}_{mode}_k{k}_step_ms"] = step * 1e3
                metrics[f"bs{bs}_{mode}_k{k}_cost_vs_decode"] = step / plain_step
                if k >= 2:  # length 3 needs at least 2 drafts
                    speedup = expected_speedup(plain_step, step, k, alpha_for_length(k, 3.0))
                    metrics[f"bs{bs}_{mode}_k{k}_expected_speedup_len3"] = speedup
                    best = max(best, speedup)
            metrics[f"bs{bs}_{mode}_best_expected_speedup_len3"] = best
            print(f"bs {bs} {mode}: plain step {plain_step * 1e3:.2f} ms, best expected "
                  f"speed-up at length 3: {best:.2f}x")  # fmt: skip
            if mode == "mixed" and best < 1.0 and disable_at is None:
                disable_at = bs
    metrics["suggested_disable_by_batch_size"] = float(disable_at or 0)
    return {"metrics": metrics, "engine": engine_8b(llm, model) if engine else {}}


def engine_8b(llm: LLM, model: str) -> dict[str, float]:
    """End to end at batch 1 on the 8B shape: random weights fall into loops that prompt
    lookup predicts, so this measures the engine's real TPOT at the acceptance it gets."""
    out: dict[str, float] = {}
    prompt = [[100 + (i * 7) % 50 for i in range(64)]]
    spec = bench_llm(model, num_kv_blocks=_KV_BLOCKS_8B, max_num_seqs=8, speculative_config=NGRAM)
    for name, engine in (("plain", llm), ("ngram", spec)):
        for mode in ("greedy", "t1"):
            params = SamplingParams(max_tokens=129, ignore_eos=True, seed=7, **MODES[mode][0])
            engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            short = SamplingParams(max_tokens=1, ignore_eos=True, seed=7, **MODES[mode][0])
            before = engine.stats().spec_decoding
            t = cuda_timed(lambda e=engine, p=params: e.generate(prompt, p))
            t0 = cuda_timed(lambda e=engine, p=short: e.generate(prompt, p))
            out[f"engine_bs1_{mode}_{name}_tpot_ms"] = (t - t0) / 128 * 1e3
            after = engine.stats().spec_decoding
            if after is not None and before is not None:
                steps = after.num_drafts - before.num_drafts
                acc = after.num_accepted_tokens - before.num_accepted_tokens
                out[f"engine_bs1_{mode}_{name}_mean_acceptance_length"] = (
                    1 + acc / steps if steps else 1.0
                )
    for mode in ("greedy", "t1"):
        out[f"engine_bs1_{mode}_speedup"] = (
            out[f"engine_bs1_{mode}_plain_tpot_ms"] / out[f"engine_bs1_{mode}_ngram_tpot_ms"]
        )
    print(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=("all", "smol", "8b"), default="all")
    parser.add_argument("--model", default="configs/models/llama-3.1-8b.json")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--verify-batch-sizes", default="1,8,64")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", default="h200_speculative.json")
    parser.add_argument(
        "--graphed", action="store_true", help="8B costs of forwards replayed from CUDA graphs"
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the 8B engine runs")
    args = parser.parse_args()
    metrics: dict[str, float] = {}
    extra: dict = {}
    if args.part in ("all", "smol"):
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        metrics.update(smol_part(args.max_tokens, sizes))
    if args.part in ("all", "8b"):
        sizes = [int(b) for b in args.verify_batch_sizes.split(",")]
        result = eight_b_part(
            args.model, sizes, args.max_k, args.context, args.graphed, not args.no_engine
        )
        metrics.update(result["metrics"])
        metrics.update(result["engine"])
    extra["workload"] = {
        "proposer": NGRAM,
        "modes": MODES,
        "max_tokens": args.max_tokens,
        "context": args.context,
        "expected_speedup": "plain step / (verify step / 3): acceptance length 3",
    }
    write_result(
        args.out, "speculative", metrics, {"same engine without speculative_config": True},
        **extra,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
