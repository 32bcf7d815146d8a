"""Our Triton paged attention against torch SDPA (flash backend) on equivalent contiguous
inputs, and the small kernels (norms, rotary, activation, KV write, fused rotary + KV write)
against their torch references, each checked against its reference first.

    python -m benchmarks.attention [--out h200_attention.json]

Speed-ups are baseline time / our time (> 1 is faster). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common.timing import triton_seconds
from benchmarks.record import write_result
from loraplex.kernels.activation import silu_and_mul, silu_and_mul_ref
from loraplex.kernels.attention import paged_attention, paged_attention_ref
from loraplex.kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from loraplex.kernels.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from loraplex.kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    cos_sin_cache,
    rotary_write_kv,
    rotary_write_kv_ref,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def paged_inputs(batch: int, seq_len: int, query_len: int) -> dict[str, torch.Tensor]:
    """Contiguous per-sequence K/V [batch, seq_len, kv_heads, dim] and the same data paged."""
    k = torch.randn(batch, seq_len, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    q = torch.randn(batch * query_len, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    blocks_per_seq = seq_len // BLOCK_SIZE
    order = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int64)
    block_tables = order.view(batch, blocks_per_seq).int()
    cache_shape = (batch * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(cache_shape, device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    pos = torch.arange(seq_len, device="cuda")
    slots = block_tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    write_kv_cache(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots.flatten())
    qsl = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * query_len
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=block_tables,
    )


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hk, L, D]; flash backend, GQA native or expanded if unsupported."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except RuntimeError:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def bench(fn: Callable[[], object], graph: bool = False) -> float:
    """Milliseconds per call by Triton's `do_bench` (replayed from a CUDA graph when `graph`)."""
    return triton_seconds(fn, graph) * 1e3


def attention_case(name: str, batch: int, seq_len: int, query_len: int, metrics: dict) -> None:
    x = paged_inputs(batch, seq_len, query_len)
    scale = HEAD_DIM**-0.5
    args = (
        x["q"],
        x["k_cache"],
        x["v_cache"],
        x["query_start_loc"],
        x["seq_lens"],
        x["block_tables"],
        scale,
    )

    def ours() -> torch.Tensor:
        return paged_attention(*args, max_query_len=query_len, max_seq_len=seq_len)

    q_sdpa = x["q"].view(batch, query_len, HEADS, HEAD_DIM).transpose(1, 2)
    k_sdpa, v_sdpa = x["k"].transpose(1, 2), x["v"].transpose(1, 2)
    causal = query_len > 1

    def theirs() -> torch.Tensor:
        return sdpa_flash(q_sdpa, k_sdpa, v_sdpa, causal)

    out = ours().float()
    expected = theirs().transpose(1, 2).reshape(out.shape).float()
    ref_diff = (out - paged_attention_ref(*args).float()).abs().max().item()
    sdpa_diff = (out - expected).abs().max().item()
    print(f"{name}: max |ours - reference| = {ref_diff:.2e}, max |ours - sdpa| = {sdpa_diff:.2e}")
    if sdpa_diff > 5e-2:
        raise SystemExit(f"{name}: paged attention disagrees with SDPA ({sdpa_diff:.3f})")
    graph = query_len == 1
    ours_ms, theirs_ms = bench(ours, graph), bench(theirs, graph)
    flops = 4 * batch * HEADS * HEAD_DIM * query_len * (seq_len - (query_len - 1) / 2)
    print(
        f"{name}: ours {ours_ms * 1e3:.1f} us ({flops / ours_ms / 1e9:.0f} TFLOP/s), "
        f"sdpa {theirs_ms * 1e3:.1f} us -> {theirs_ms / ours_ms:.2f}x"
    )
    metrics[f"{name}_ms"] = round(ours_ms, 4)
    metrics[f"{name}_sdpa_ms"] = round(theirs_ms, 4)
    metrics[f"{name}_tflops"] = round(flops / ours_ms / 1e9, 1)
    metrics[f"{name}_vs_sdpa"] = round(theirs_ms / ours_ms, 3)
    metrics[f"{name}_max_abs_diff"] = round(sdpa_diff, 5)
    if query_len == 1:
        kv_bytes = 2 * batch * seq_len * KV_HEADS * HEAD_DIM * x["k"].element_size()
        metrics[f"{name}_kv_read_gb_per_s"] = round(kv_bytes / ours_ms / 1e6, 1)


def small_kernels(metrics: dict) -> None:
    tokens, hidden, inter = 8192, 4096, 14336
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cache = cos_sin_cache(HEAD_DIM, 8192, 500000.0, rope).cuda()
    kc = torch.zeros(
        tokens // BLOCK_SIZE, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE
    )
    vc, kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
    slots = torch.randperm(tokens, device="cuda")
    cases = {
        "rms_norm": (lambda: rms_norm(x, w, 1e-5), lambda: rms_norm_ref(x, w, 1e-5)),
        "fused_add_rms_norm": (
            lambda: fused_add_rms_norm(x, res, w, 1e-5)[0],
            lambda: fused_add_rms_norm_ref(x, res, w, 1e-5)[0],
        ),
        "rotary": (
            lambda: apply_rotary(pos, q, k, cache)[0],
            lambda: apply_rotary_ref(pos, q, k, cache)[0],
        ),
        "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up)),
        "write_kv_cache": (
            lambda: (write_kv_cache(k, k, kc, vc, slots), kc)[1],
            lambda: (write_kv_cache_ref(k, k, kc_ref, vc_ref, slots), kc_ref)[1],
        ),
    }
    for name, (ours, theirs) in cases.items():
        diff = (ours().float() - theirs().float()).abs().max().item()
        ours_ms, theirs_ms = bench(ours), bench(theirs)
        print(
            f"{name}: max |ours - reference| = {diff:.2e}; ours {ours_ms * 1e3:.1f} us, "
            f"torch {theirs_ms * 1e3:.1f} us -> {theirs_ms / ours_ms:.2f}x"
        )
        metrics[f"{name}_ms"] = round(ours_ms, 4)
        metrics[f"{name}_vs_torch"] = round(theirs_ms / ours_ms, 3)

    def fused_rotary_case(name: str, n: int, graph: bool) -> None:
        """Fused rotary + KV write on views of one qkv output (as the model calls it), timed
        against the two launches it replaces (rotary, then write_kv_cache)."""
        qkv = torch.randn(n, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        fq, fk, fv = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        fpos, fslots = pos[:n], slots[:n]
        caches = [torch.zeros_like(kc) for _ in range(4)]  # fused k/v, unfused k/v

        def fused() -> torch.Tensor:
            return rotary_write_kv(fpos, fq, fk, fv, cache, caches[0], caches[1], fslots)

        def unfused() -> torch.Tensor:
            q_rot, k_rot = apply_rotary(fpos, fq, fk, cache)
            write_kv_cache(k_rot, fv, caches[2], caches[3], fslots)
            return q_rot

        q_ref = rotary_write_kv_ref(fpos, fq, fk, fv, cache, caches[2], caches[3], fslots)
        diff = max(
            (fused().float() - q_ref.float()).abs().max().item(),
            (caches[0].float() - caches[2].float()).abs().max().item(),
            (caches[1].float() - caches[3].float()).abs().max().item(),
        )
        ours_ms, theirs_ms = bench(fused, graph), bench(unfused, graph)
        print(
            f"{name}: max |ours - reference| = {diff:.2e}; fused {ours_ms * 1e3:.1f} us, "
            f"rotary + write_kv_cache {theirs_ms * 1e3:.1f} us -> {theirs_ms / ours_ms:.2f}x"
        )
        metrics[f"{name}_ms"] = round(ours_ms, 4)
        metrics[f"{name}_vs_unfused"] = round(theirs_ms / ours_ms, 3)

    fused_rotary_case("rotary_write_kv", tokens, graph=False)
    fused_rotary_case("rotary_write_kv_decode", 1, graph=True)  # batch-1 decode, CUDA graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_attention.json", help="in benchmarks/results/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.attention needs a CUDA GPU; none found, nothing measured.")
        return 0
    torch.manual_seed(0)
    metrics: dict[str, float] = {}
    attention_case("attn_prefill", batch=4, seq_len=2048, query_len=2048, metrics=metrics)
    attention_case("attn_decode", batch=64, seq_len=1024, query_len=1, metrics=metrics)
    attention_case(
        "attn_decode_long_small_batch", batch=2, seq_len=16384, query_len=1, metrics=metrics
    )
    small_kernels(metrics)
    baseline = {k: metrics.pop(k) for k in list(metrics) if k.endswith("_sdpa_ms")}
    write_result(
        args.out,
        "attention",
        metrics,
        baseline,
        baseline_is=(
            "torch.nn.functional.scaled_dot_product_attention, flash backend, on contiguous "
            "K/V (prefill: 4 x 2048 tokens causal; decode: 64 x 1024 and 2 x 16384 context; "
            "32 heads, 8 KV heads, head_dim 128, bf16); small kernels vs their torch "
            "references; speedup = baseline time / our time"
        ),
        versions={"torch": torch.__version__, "triton": __import__("triton").__version__},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
