"""The Sampler alone: time per call for each sampling mix users send, beside a plain argmax
(what a greedy batch costs), at one row and at a full batch of a 128k vocabulary.

    python -m benchmarks.sampler                      # CUDA: [1, 128256] and [256, 128256]
    python -m benchmarks.sampler --cpu --vocab 4096   # CPU smoke run (small vocabulary)

`*_ms` is the time per call over `--iters` back-to-back calls between two CUDA events, so
launch overheads that leave the GPU idle count too; `*_gpu_ms` is the same call replayed from a
CUDA graph (the device's own time, no launch overhead). Logits are N(0, --logit-std) per token.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common.timing import event_seconds_per_call, graph_seconds_per_call
from benchmarks.record import write_result
from loraplex.platform.runner.sampler import Sampler
from loraplex.platform.runner.sampling_metadata import SamplingMetadata, build_sampling_metadata

#: name -> SamplingParams-like values every row gets (the mixes the issue measures)
MIXES: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "t1.0": dict(temperature=1.0),
    "t0.7_top_p0.9": dict(temperature=0.7, top_p=0.9),
    "t0.7_seed": dict(temperature=0.7, seeds=1234),
    "t0.7_top_k50": dict(temperature=0.7, top_k=50),
    "min_p0.05": dict(min_p=0.05),
    "repetition1.1": dict(repetition_penalty=1.1),
    "presence0.5_frequency0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "logprobs5": dict(logprobs=5),
}


def penalty_state(n: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Output counts (~256 generated tokens per row) and a prompt mask (~1024 prompt tokens)."""
    gen = torch.Generator(device=device).manual_seed(1)
    counts = torch.zeros(n, vocab, dtype=torch.int32, device=device)
    out = torch.randint(0, vocab, (n, 256), generator=gen, device=device)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    prompt = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    prompt.scatter_(1, torch.randint(0, vocab, (n, 1024), generator=gen, device=device), True)
    return {"output_counts": counts, "prompt_mask": prompt}


def metadata(
    mix: dict[str, Any], n: int, vocab: int, device: torch.device, state: dict[str, torch.Tensor]
) -> SamplingMetadata:
    extra = {}
    if "repetition_penalty" in mix or "presence_penalty" in mix:
        extra = state
    return build_sampling_metadata(n, vocab, device, **mix, **extra)


def ms_per_call(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Milliseconds per call of fn over `iters` calls in a row, after three warm-up calls."""
    return event_seconds_per_call(fn, iters, cuda=device.type == "cuda") * 1e3


def run(
    rows: list[int], vocab: int, iters: int, logit_std: float, device: torch.device
) -> tuple[dict[str, float], dict[str, float]]:
    sampler = Sampler()
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    for n in rows:
        gen = torch.Generator(device=device).manual_seed(n)
        logits = torch.randn(n, vocab, generator=gen, device=device) * logit_std
        state = penalty_state(n, vocab, device)
        argmax = lambda x=logits: x.argmax(dim=-1)  # noqa: E731
        argmax_ms = ms_per_call(argmax, iters, device)
        baseline[f"argmax_ms_n{n}"] = round(argmax_ms, 4)
        line = f"[{n}, {vocab}] {'argmax':>26}: {argmax_ms:.4f} ms"
        if device.type == "cuda":
            argmax_gpu = graph_seconds_per_call(argmax) * 1e3
            baseline[f"argmax_gpu_ms_n{n}"] = round(argmax_gpu, 4)
            line += f", GPU {argmax_gpu:.4f} ms"
        print(line)
        for name, mix in MIXES.items():
            meta = metadata(mix, n, vocab, device, state)
            call = lambda x=logits, m=meta: sampler(x, m)  # noqa: E731
            ms = ms_per_call(call, iters, device)
            metrics[f"{name}_ms_n{n}"] = round(ms, 4)
            metrics[f"{name}_extra_ms_n{n}"] = round(ms - argmax_ms, 4)
            line = f"[{n}, {vocab}] {name:>26}: {ms:.4f} ms ({ms - argmax_ms:+.4f} vs argmax)"
            if device.type == "cuda":
                gpu = graph_seconds_per_call(call) * 1e3
                metrics[f"{name}_gpu_ms_n{n}"] = round(gpu, 4)
                line += f", GPU {gpu:.4f} ms"
            print(line)
    return metrics, baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,256", help="batch sizes, comma separated")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--logit-std", type=float, default=2.0)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    parser.add_argument("--out", default=None, help="results file (default: per device)")
    args = parser.parse_args()
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("benchmarks.sampler needs a CUDA GPU (or --cpu with a small --vocab); skipped")
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    metrics, baseline = run(rows, args.vocab, args.iters, args.logit_std, device)
    out = args.out or ("h200_sampler.json" if device.type == "cuda" else "cpu_sampler.json")
    write_result(
        out, "sampler", metrics, baseline,
        rows=rows, vocab=args.vocab, iters=args.iters, logit_std=args.logit_std,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
