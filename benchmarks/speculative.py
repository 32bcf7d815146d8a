"""Speculative decoding: acceptance and TPOT with the n-gram proposer on the embedded
SmolLM2-135M-Instruct, and on the Llama-3.1-8B shape (random weights) the cost of verifying k
drafts in one step against a plain decode step, the expected TPOT it gives, and where
speculation stops paying (the batch size for `disable_by_batch_size`).

    python -m benchmarks.speculative [--part all|smol|8b] [--out h200_speculative.json]

Every case runs greedy, at temperature 1.0 (the `openai` SDK's default) and as a mixed batch
(greedy, t=1.0, t=0.7 with top-p 0.9, t=1.0 with top-k 50, in turn).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.engine import LLAMA_8B, bench_llm
from benchmarks.common.spec_decode import (
    MODES,
    NGRAM,
    alpha_for_length,
    expected_speedup,
    record_pair,
    run_batch,
    verify_cost,
)
from benchmarks.common.timing import best_seconds_per_call, wall_seconds
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams
from loraplex.platform.models.attention_metadata import AttentionMetadata

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
_KV_BLOCKS_8B = 4096  # 8 GiB each at 8B: room for two engines and batch 64 x 520 tokens


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
    eager = best_seconds_per_call(step, iters)
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
    return best_seconds_per_call(graph.replay, iters)


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
            replay = best_seconds_per_call(runner.graphs.graphs[bs].replay, iters)
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
            t = wall_seconds(lambda e=engine, p=params: e.generate(prompt, p))
            t0 = wall_seconds(lambda e=engine, p=short: e.generate(prompt, p))
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
    parser.add_argument("--model", default=LLAMA_8B)
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
