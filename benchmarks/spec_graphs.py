"""Speculative verification replayed from CUDA graphs, on the Llama-3.1-8B shape with
random weights:

1. graphed verification computes what eager verification computes (the logits of the same
   real verification batches, against the gap between graphed and eager plain decode);
2. the cost of one verification forward (k = 4 drafts a row), eager and graphed, against a
   graphed plain decode step at the same batch size, and the TPOT speed-up it gives at an
   acceptance length of 3 (greedy, t=1.0 and mixed sampling: their acceptance costs differ);
3. the engine end to end, with and without n-gram speculation, on copy-heavy prompts (a
   random "document" and its beginning again) and on prompts with nothing to copy: TPOT,
   output tokens a second and acceptance, greedy, at t=1.0 and mixed. Random weights do not
   copy their prompt, so n-gram drafts are rarely accepted: this measures what speculation
   costs when it fails;
4. the engine end to end at a set acceptance length of 3: an oracle proposer drafts, at each
   step, the next two tokens the engine without speculation emitted for the same request
   (seeded sampling emits the same tokens with speculation) and two wrong ones, so each
   verification accepts two drafts while the outputs agree: the TPOT speculation is for
   (the target is >= 1.8x at batch 1), through the whole engine (lock step, graphs, acceptance).

    python -m benchmarks.spec_graphs [--model configs/models/llama-3.1-8b.json] \
        [--out h200_spec_graphs.json]

Both engines hold the same random weights (seed 0) and run without prefix caching, so the
timing of recorded batches (re-run after their requests finished) writes no cached block. Off
CUDA (a smoke run on a tiny model) the graphs are the runner's eager stand-ins and the timings
mean nothing.
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.common.engine import LLAMA_8B, bench_llm
from benchmarks.common.spec_decode import (
    MODES,
    NGRAM,
    NUM_DRAFTS,
    alpha_for_length,
    expected_speedup,
    record_pair,
    run_batch,
    verify_cost,
)
from benchmarks.common.timing import best_seconds_per_call
from benchmarks.record import write_result
from loraplex import LLM
from loraplex.platform.runner.batch import Batch
from loraplex.platform.runner.model_runner import ModelRunner
from loraplex.platform.spec.proposer import ProposalRequest, Proposals, Proposer

K = NUM_DRAFTS


def copy_prompts(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    """A random document of 128 tokens, a separator, then its first 32 again: prompt lookup
    drafts the document's continuation (what a copy or edit task emits)."""
    out = []
    for _ in range(n):
        doc = [rng.randrange(100, vocab - 100) for _ in range(128)]
        out.append(doc + [13, 13] + doc[:32])
    return out


def plain_prompts(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    """162 random tokens: nothing for prompt lookup to find but chance repeats."""
    return [[rng.randrange(100, vocab - 100) for _ in range(162)] for _ in range(n)]


class ForwardProbe:
    """Wraps a runner's forward pass: keeps the first batch of each (kind, num_seqs) that a
    graph can run ("decode" or "verify"), and runs the first `checks` of each kind eagerly
    too, comparing the logits with the graph's."""

    def __init__(self, runner: ModelRunner, checks: int) -> None:
        self.runner, self.checks = runner, checks
        self.forward = runner._forward
        self.batches: dict[tuple[str, int], Batch] = {}
        self.compared: dict[str, list[tuple[float, float, int]]] = {"decode": [], "verify": []}
        runner._forward = self  # type: ignore[method-assign]

    def kind(self, batch: Batch) -> str | None:
        graphs = self.runner.graphs
        if graphs is None:
            return None
        if graphs.verify_padded_size(batch) is not None:
            return "verify"
        if batch.is_decode and graphs.padded_size(batch.num_seqs) is not None:
            return "decode"
        return None

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        kind = self.kind(batch)
        if kind is None:
            return self.forward(batch)
        self.batches.setdefault((kind, batch.num_seqs), batch)
        if len(self.compared[kind]) >= self.checks:
            return self.forward(batch)
        eager = self.eager(batch).float()
        graphed, scores = self.forward(batch)  # NOTE: rewrites the same K/V, as the graph would
        self.compared[kind].append(compare(eager, graphed.float()))
        return graphed, scores

    def eager(self, batch: Batch) -> torch.Tensor:
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            return self.forward(batch)[0]
        finally:
            self.runner.graphs = graphs

    @torch.inference_mode()
    def time(self, batch: Batch, graphed: bool, iters: int) -> float:
        """Seconds of one forward of `batch` (graph replay or eager), staging included."""
        run = (lambda: self.forward(batch)) if graphed else (lambda: self.eager(batch))
        run()
        return best_seconds_per_call(run, iters)


def compare(eager: torch.Tensor, graphed: torch.Tensor) -> tuple[float, float, int]:
    """(largest |logprob difference| over each row's eager argmax token, fraction of rows
    whose argmax agrees, rows) of two [rows, vocab] logits."""
    top = eager.argmax(dim=-1, keepdim=True)
    lp_e = torch.log_softmax(eager, dim=-1).gather(1, top)
    lp_g = torch.log_softmax(graphed, dim=-1).gather(1, top)
    agree = (graphed.argmax(dim=-1, keepdim=True) == top).float().mean()
    return float((lp_e - lp_g).abs().max()), float(agree), eager.shape[0]


class OracleProposer(Proposer):
    """Drafts from known outputs (a benchmark instrument): the next `num_right` tokens each
    request emitted without speculation, then wrong ones (the known token + 1) up to k.
    `known`: a prompt's first 16 tokens -> (its length, its output tokens)."""

    def __init__(
        self,
        known: dict[tuple[int, ...], tuple[int, list[int]]],
        k: int,
        num_right: int,
        vocab: int,
    ) -> None:
        self.known, self.k, self.num_right, self.vocab = known, k, num_right, vocab

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out: dict[str, list[int]] = {}
        for req in requests:
            prompt_len, output = self.known[tuple(req.token_ids[:16].tolist())]
            pos = len(req.token_ids) - prompt_len
            nxt = output[pos : pos + min(self.k, req.max_tokens)]
            out[req.req_id] = [
                t if j < self.num_right else (t + 1) % self.vocab for j, t in enumerate(nxt)
            ]
        return Proposals(out)


def oracle_runs(
    plain: LLM, spec: LLM, batch_sizes: list[int], max_tokens: int, metrics: dict
) -> None:
    """(4): end to end at acceptance length 3 (two drafts of four right)."""
    runner = spec.engine.runner
    vocab, ngram = runner.arch.vocab_size, runner.proposer
    try:
        for bs in batch_sizes:
            for mode in MODES:
                prompts = plain_prompts(random.Random(100 + bs), vocab, bs)
                outputs: dict[int, list[int]] = {}
                b = run_batch(plain, prompts, mode, max_tokens, outputs, ignore_eos=True)
                known = {tuple(p[:16]): (len(p), outputs[i]) for i, p in enumerate(prompts)}
                runner.proposer = OracleProposer(known, K, 2, vocab)
                s = run_batch(spec, prompts, mode, max_tokens, ignore_eos=True)
                record_pair(f"oracle_len3_bs{bs}_{mode}", b, s, metrics)
    finally:
        runner.proposer = ngram


def engines(model: str, dtype: str, max_seqs: int) -> tuple[LLM, LLM]:
    options = dict(
        dtype=dtype, max_num_seqs=max_seqs, num_kv_blocks=2048, enable_prefix_caching=False
    )
    plain = bench_llm(model, **options)
    spec = bench_llm(model, speculative_config=NGRAM, **options)
    for llm in (plain, spec):
        runner = llm.engine.runner
        if runner.graphs is None and runner.device.type == "cpu":  # smoke run: stand-ins
            runner.graphs = runner.build_graph_runner()
            runner.graphs.capture()
    return plain, spec


def end_to_end(
    plain: LLM, spec: LLM, batch_sizes: list[int], max_tokens: int, metrics: dict
) -> None:
    vocab = plain.engine.runner.arch.vocab_size
    for llm in (plain, spec):  # warm-up: prefill shapes, sampler
        run_batch(llm, copy_prompts(random.Random(9), vocab, 2), "mixed", 8, ignore_eos=True)
    for workload, make in (("copy", copy_prompts), ("plain", plain_prompts)):
        for bs in batch_sizes:
            for mode in MODES:
                prompts = make(random.Random(bs), vocab, bs)
                b = run_batch(plain, prompts, mode, max_tokens, ignore_eos=True)
                s = run_batch(spec, prompts, mode, max_tokens, ignore_eos=True)
                record_pair(f"e2e_{workload}_bs{bs}_{mode}", b, s, metrics)


def checks(probes: dict[str, ForwardProbe], metrics: dict) -> bool:
    """(1): the graph-vs-eager gap of verification within that of plain decode (or 0.05)."""
    gaps = {}
    for kind, probe in (("decode", probes["plain"]), ("verify", probes["spec"])):
        seen = probe.compared[kind]
        if not seen:
            print(f"no {kind} batch ran from a graph: nothing compared")
            return False
        gaps[kind] = max(s[0] for s in seen)
        rows = sum(s[2] for s in seen)
        metrics[f"{kind}_graph_vs_eager_max_logprob_diff"] = gaps[kind]
        metrics[f"{kind}_graph_vs_eager_argmax_agreement"] = sum(s[1] * s[2] for s in seen) / rows
        metrics[f"{kind}_graph_vs_eager_rows_compared"] = float(rows)
    ok = gaps["verify"] <= max(2 * gaps["decode"], 0.05)
    metrics["verify_graph_check_passed"] = float(ok)
    print(f"graph vs eager, max logprob gap: decode {gaps['decode']:.4f}, verify "
          f"{gaps['verify']:.4f} -> {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return ok


def costs(probes: dict[str, ForwardProbe], batch_sizes: list[int], metrics: dict) -> None:
    """(2): forward costs of recorded batches, and the speed-up they give at length 3."""
    runner = probes["spec"].runner
    vocab, dev = runner.arch.vocab_size, runner.device
    alpha = alpha_for_length(K, 3.0)
    for bs in batch_sizes:
        decode = probes["plain"].batches.get(("decode", bs))
        verify = probes["spec"].batches.get(("verify", bs))
        if decode is None or verify is None:
            print(f"bs {bs}: no recorded {'decode' if decode is None else 'verify'} batch")
            continue
        iters = 20
        plain = probes["plain"].time(decode, True, iters)
        graphed = probes["spec"].time(verify, True, iters)
        eager = probes["spec"].time(verify, False, iters)
        assert verify.spec_lens is not None
        metrics[f"bs{bs}_decode_graph_ms"] = plain * 1e3
        metrics[f"bs{bs}_verify_graph_ms"] = graphed * 1e3
        metrics[f"bs{bs}_verify_eager_ms"] = eager * 1e3
        metrics[f"bs{bs}_verify_mean_drafts"] = float(verify.spec_lens.mean())
        metrics[f"bs{bs}_verify_graph_vs_decode"] = graphed / plain
        metrics[f"bs{bs}_verify_eager_vs_graph"] = eager / graphed
        print(f"bs {bs}: decode graph {plain * 1e3:.2f} ms, verify k={K} graph "
              f"{graphed * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms")  # fmt: skip
        for mode in MODES:
            plain_step = plain + verify_cost(vocab, bs, 0, mode, dev, iters)
            spec_step = graphed + verify_cost(vocab, bs, K, mode, dev, iters)
            speedup = expected_speedup(plain_step, spec_step, K, alpha)
            metrics[f"bs{bs}_{mode}_plain_step_ms"] = plain_step * 1e3
            metrics[f"bs{bs}_{mode}_verify_step_ms"] = spec_step * 1e3
            metrics[f"bs{bs}_{mode}_expected_speedup_len3"] = speedup
            print(f"bs {bs} {mode}: step {plain_step * 1e3:.2f} -> {spec_step * 1e3:.2f} ms, "
                  f"expected TPOT speed-up at acceptance length 3: {speedup:.2f}x")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=LLAMA_8B)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="h200_spec_graphs.json")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    plain, spec = engines(args.model, args.dtype, max(16, *sizes))
    probes = {
        "plain": ForwardProbe(plain.engine.runner, 8),
        "spec": ForwardProbe(spec.engine.runner, 16),
    }
    metrics: dict[str, float] = {"num_speculative_tokens": float(K)}
    end_to_end(plain, spec, sizes, args.max_tokens, metrics)
    oracle_runs(plain, spec, sizes, args.max_tokens, metrics)
    ok = checks(probes, metrics)
    costs(probes, sizes, metrics)
    write_result(
        args.out, "spec_graphs", metrics,
        {"same engine and weights without speculative_config": True},
        workload={
            "proposer": NGRAM, "modes": MODES, "max_tokens": args.max_tokens,
            "copy": "128 random tokens, 2 separators, their first 32 again",
            "plain": "162 random tokens", "batch_sizes": sizes,
            "oracle": "drafts: the next 2 tokens emitted without speculation, 2 wrong ones",
            "expected_speedup": "plain step / (verify step / 3): acceptance length 3",
        },
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
