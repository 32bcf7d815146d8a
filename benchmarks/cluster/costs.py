"""`CostModel`: one simulated replica's step and adapter-load costs, fitted to the H200 records
in benchmarks/results (see `benchmarks.cluster_sim`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.record import RESULTS

# The multi-LoRA run the costs are fitted to: 256 requests, as the fit below assumes.
MULTI_LORA = "h200_multi_lora_256_requests.json"


@dataclass(frozen=True)
class CostModel:
    """One replica's costs (seconds): step = (t1 + k (B-1) + p * prefill tokens) * f(A), with
    f(A) = 1 + b log2(A) for A >= 1 distinct adapters in the batch; `load_s` per adapter load."""

    t1: float  # decode step of one sequence
    k: float  # each further running sequence
    p: float  # each prompt token prefilled in the step
    b: float  # slowdown per doubling of distinct adapters
    load_s: float  # disk/host -> GPU slot, one adapter
    sources: dict[str, str]

    def step(self, batch: int, adapters: int, prefill_tokens: int) -> float:
        base = self.t1 + self.k * max(batch - 1, 0) + self.p * prefill_tokens
        return base * (1.0 + self.b * math.log2(adapters)) if adapters else base

    @classmethod
    def from_records(cls, results: Path = RESULTS) -> CostModel:
        """Fit the costs to the recorded H200 runs (Llama-3.1-8B shapes, bf16)."""
        multi = json.loads((results / MULTI_LORA).read_text())
        sampling = json.loads((results / "h200_sampling.json").read_text())
        upload = json.loads((results / "h200_adapter_upload.json").read_text())
        t1 = multi["baseline"]["tpot_bs1_base_s"]
        # Each run: P prompt tokens, S steps (the longest output), D output tokens, in D / tok_s
        # seconds: P p + S t1 + (D - S) k = T. Two runs, two unknowns (p, k).
        n = 256
        runs = [  # (P, S, D, tok/s)
            (n * 128, 256, n * 256, sampling["metrics"]["greedy_out_tok_s"]),
            (n * 320, 256, n * 160, multi["baseline"]["base_out_tok_s_t1"]),
        ]
        (p1, s1, d1, r1), (p2, s2, d2, r2) = runs
        rhs1, rhs2 = d1 / r1 - s1 * t1, d2 / r2 - s2 * t1
        det = p1 * (d2 - s2) - p2 * (d1 - s1)
        p = (rhs1 * (d2 - s2) - rhs2 * (d1 - s1)) / det
        k = (p1 * rhs2 - p2 * rhs1) / det
        points = [(8, 1 / multi["metrics"]["ratio_vs_base_8_t1"]),
                  (64, 1 / multi["metrics"]["ratio_vs_base_64_t1"])]  # fmt: skip
        b = sum(math.log2(a) * (f - 1) for a, f in points) / sum(
            math.log2(a) ** 2 for a, _ in points
        )
        load_s = (upload["metrics"]["first_token_after_upload_s_median"]
                  - upload["baseline"]["base_model_first_token_s_median"])  # fmt: skip
        sources = {
            "t1": f"{MULTI_LORA} baseline.tpot_bs1_base_s",
            "p, k": "fitted to h200_sampling.json metrics.greedy_out_tok_s (256 x 128 in, 256 "
            f"out) and {MULTI_LORA} baseline.base_out_tok_s_t1 (256 x U[128,512] in, "
            "U[64,256] out)",
            "b": f"least squares on {MULTI_LORA} metrics.ratio_vs_base_8_t1 and "
            "ratio_vs_base_64_t1 (8 and 64 distinct adapters)",
            "load_s": "h200_adapter_upload.json first_token_after_upload_s_median - "
            "base_model_first_token_s_median (rank 16, all 7 projections, 168 MB)",
        }
        return cls(t1, k, p, b, load_s, sources)
