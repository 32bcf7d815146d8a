"""The Llama family: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (qk norm),
SmolLM2; tied or separate embeddings. Attention runs over the paged KV cache. What a config may
ask for (RoPE variants, biases, sliding window) is decided by `ArchConfig`.

Under tensor parallelism (`tp`) each rank holds its attention heads (and their KV cache), a
slice of the MLP, and a slice of the vocabulary (`loraplex.platform.parallel.sharding`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from loraplex.kernels.activation import silu_and_mul
from loraplex.kernels.attention import paged_attention
from loraplex.kernels.gemv import linear
from loraplex.kernels.layernorm import fused_add_rms_norm, rms_norm
from loraplex.kernels.rotary import cos_sin_cache, rotary_write_kv
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.registry import register_model
from loraplex.platform.models.weight_loader import load_named_weights
from loraplex.platform.parallel.parallel_state import SINGLE, TensorParallel
from loraplex.platform.parallel.sharding import (
    LinearShard,
    attention_shard,
    column_shard,
    row_shard,
    vocab_range,
)
from loraplex.quant.base import QuantizationConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        quant: QuantizationConfig | None,
        dtype: torch.dtype,
        prefix: str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        heads = attention_shard(cfg.num_heads, cfg.num_kv_heads, tp)
        hd = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, hd
        self.scale = cfg.head_dim**-0.5
        q_range = (heads.q_start * hd, heads.num_heads * hd)
        kv_range = (heads.kv_start * hd, heads.num_kv_heads * hd)
        self.qkv_proj = Linear(
            cfg.hidden_size,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            bias=cfg.attention_bias,
            shard_names=("q_proj", "k_proj", "v_proj"),
            quant_config=quant,
            prefix=f"{prefix}.qkv_proj",
            params_dtype=dtype,
            tp=tp,
            tp_shard=LinearShard("column", (q_range, kv_range, kv_range), (0, cfg.hidden_size)),
        )
        self.o_proj = Linear(
            cfg.q_size,
            [cfg.hidden_size],
            bias=cfg.o_proj_bias,
            quant_config=quant,
            prefix=f"{prefix}.o_proj",
            params_dtype=dtype,
            tp=tp,
            tp_shard=LinearShard("row", ((0, cfg.hidden_size),), q_range),
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,  # [max_positions, head_dim]
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        k_cache, v_cache = kv_cache
        q = rotary_write_kv(positions, q, k, v, rope_cache, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            plan=meta.decode_plan,
        )
        return self.o_proj(out.reshape(num_tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        quant: QuantizationConfig | None,
        dtype: torch.dtype,
        prefix: str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            [inter, inter],
            shard_names=("gate_proj", "up_proj"),
            quant_config=quant,
            prefix=f"{prefix}.gate_up_proj",
            params_dtype=dtype,
            tp=tp,
            tp_shard=column_shard([inter, inter], cfg.hidden_size, tp) if tp.enabled else None,
        )
        self.down_proj = Linear(
            inter,
            [cfg.hidden_size],
            quant_config=quant,
            prefix=f"{prefix}.down_proj",
            params_dtype=dtype,
            tp=tp,
            tp_shard=(
                row_shard(cfg.hidden_size, inter, tp, "intermediate size") if tp.enabled else None
            ),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        quant: QuantizationConfig | None,
        dtype: torch.dtype,
        prefix: str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, quant, dtype, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, quant, dtype, f"{prefix}.mlp", tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        quant: QuantizationConfig | None = None,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        # NOTE: vocabulary-parallel: this rank's rows [vocab_start, vocab_start + vocab_rows)
        # of the embedding and the LM head (rows past the vocabulary are zero padding).
        self.vocab_start, vocab_rows = vocab_range(cfg.vocab_size, tp)
        self.embed_tokens = self._vocab_param(vocab_rows, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, quant, dtype, f"model.layers.{i}", tp)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = self._vocab_param(vocab_rows, cfg.hidden_size, dtype)
        # LoRA hooks on the vocabulary ends, set by `adapters` (see `adapters.vocab_lora`)
        self.embed_lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.logits_lora: (
            Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None
        ) = None
        # NOTE: a model built on the meta device only lends its parameters' shapes (random
        # weights of a tensor-parallel rank): it gets no RoPE table, whose arange on the meta
        # device would import torch's compiler stack (seconds).
        on_meta = torch.empty(0).device.type == "meta"
        rope = torch.empty(0) if on_meta else cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope.theta, cfg.rope.scaling()
        )  # fmt: skip
        self.register_buffer("rope_cache", rope, persistent=False)

    def _vocab_param(self, rows: int, hidden: int, dtype: torch.dtype) -> nn.Parameter:
        param = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)
        if self.tp.enabled:
            param.vocab_range = (self.vocab_start, rows)  # type: ignore[attr-defined]
        return param

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if not self.tp.enabled:
            return self.embed_tokens[input_ids]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.shape[0])  # [num_tokens]
        hidden = self.embed_tokens[local.clamp(0, self.embed_tokens.shape[0] - 1)]
        hidden = hidden * mine.unsqueeze(1).to(hidden.dtype)
        return self.tp.all_reduce(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.embed(input_ids)
        if self.embed_lora is not None:
            self.embed_lora(input_ids, hidden)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.rope_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, token_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> [num_rows, vocab] in fp32. `token_rows` ([num_rows]
        int64, on the device): the step's token each row was computed from (what lm_head LoRA
        reads its adapter by); None: every token of the step, in order."""
        logits = linear(hidden, self.lm_head, None).float()
        if self.tp.enabled:
            # NOTE: every rank gets the whole logits (rank 0 samples; the others discard them).
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        if self.logits_lora is not None:
            self.logits_lora(hidden, logits, token_rows)
        return logits

    # Checkpoint names (after the "model." prefix) that differ from our module paths.
    checkpoint_renames = {
        "model.embed_tokens.weight": "embed_tokens",
        "lm_head.weight": "lm_head",
        "model.norm.weight": "norm.weight",
    }
    stacked_shards = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights)
