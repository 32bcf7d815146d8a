"""`loraplex quantize`: write a real AWQ, GPTQ or FP8 checkpoint of a bf16/fp32 model.

Round-to-nearest, no calibration: every q/k/v/o/gate/up/down projection is quantized, all other
tensors are copied. The result is a Hugging Face folder (safetensors, config.json with the
format's `quantization_config`, tokenizer files) that loraplex and other engines load.
GPTQ asymmetric checkpoints are written as "gptq_v2" (the v1 "zero minus one" cannot store a
zero point of 0). With desc_act the inputs get a fixed pseudo-random order per input size: real
GPTQ orders them by the Hessian of the layer input, which q/k/v (and gate/up) share, so merged
shards share the order too; any shared order exercises the act-order path.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from loraplex.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from loraplex.quant.fp8 import quantize_weight_per_channel
from loraplex.quant.packing import AWQ_PACK_ORDER, pack_int32

METHODS = ("awq", "gptq", "fp8")
FP8_SCHEMES = ("per_channel", "per_tensor", "block")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_BLOCK = 128
_MAX_SHARD_BYTES = 4 << 30


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of weight [N, K] in groups of `group_size` inputs.

    Returns q [N, K] int32 in [0, 2**bits), scales [G, N] fp16, zeros [G, N] int32, with
    weight ~= (q - zeros) * scales per group."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the input size {k}")
    maxq = (1 << bits) - 1
    w = weight.float().reshape(n, k // group_size, group_size)
    if sym:
        scales = 2 * w.abs().amax(dim=-1) / maxq  # [N, G]
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        low = w.amin(dim=-1).clamp(max=0)
        scales = (w.amax(dim=-1).clamp(min=0) - low) / maxq
        zeros = (-low / scales.clamp(min=1e-10)).round().clamp(0, maxq)
    scales = scales.clamp(min=1e-6).half()
    q = (w / scales.float()[..., None]).round() + zeros[..., None]
    q = q.clamp(0, maxq).reshape(n, k).to(torch.int32)
    return q, scales.t().contiguous(), zeros.t().to(torch.int32).contiguous()


def quantize_awq(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ "gemm" tensors of weight [N, K]."""
    size = weight.shape[1] if group_size == -1 else group_size
    q, scales, zeros = rtn_quantize(weight, 4, size, sym=False)
    return {
        "qweight": pack_int32(q.t(), 4, dim=1, order=AWQ_PACK_ORDER),  # [K, N / 8]
        "qzeros": pack_int32(zeros, 4, dim=1, order=AWQ_PACK_ORDER),  # [G, N / 8]
        "scales": scales,  # [G, N]
    }


def quantize_gptq(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool
) -> dict[str, torch.Tensor]:
    """GPTQ tensors of weight [N, K]: v1 zero points when symmetric, v2 otherwise."""
    k = weight.shape[1]
    size = k if group_size == -1 else group_size
    if desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k))  # [K]
    else:
        order = torch.arange(k)
    q_sorted, scales, zeros = rtn_quantize(weight[:, order], bits, size, sym)
    q = torch.empty_like(q_sorted).index_copy_(1, order, q_sorted)  # [N, K], input order
    g_idx = torch.empty(k, dtype=torch.int32).index_copy_(
        0, order, torch.arange(k, dtype=torch.int32) // size
    )
    stored_zeros = zeros - 1 if sym else zeros
    return {
        "qweight": pack_int32(q.t(), bits, dim=0),  # [K / pack, N]
        "qzeros": pack_int32(stored_zeros, bits, dim=1),  # [G, N / pack]
        "scales": scales,  # [G, N]
        "g_idx": g_idx,  # [K]
    }


def quantize_fp8(weight: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """FP8 e4m3 tensors of weight [N, K]: compressed-tensors names, or "fp8" block names."""
    if scheme == "per_channel":
        q, scale = quantize_weight_per_channel(weight)
        return {"weight": q, "weight_scale": scale}
    if scheme == "per_tensor":
        scale = (weight.float().abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
        q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return {"weight": q, "weight_scale": scale}
    n, k = weight.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.nn.functional.pad(
        weight.float(), (0, cols * FP8_BLOCK - k, 0, rows * FP8_BLOCK - n)
    )
    blocks = padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    full = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    q = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return {"weight": q, "weight_scale_inv": scale_inv}


def quantization_config(
    method: str, bits: int, group_size: int, sym: bool, desc_act: bool, fp8_scheme: str
) -> dict[str, Any]:
    """The config.json `quantization_config` entry of a checkpoint written here."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": desc_act, "sym": sym, "static_groups": False,
                "true_sequential": True, "damp_percent": 0.0,
                "checkpoint_format": "gptq" if sym else "gptq_v2"}  # fmt: skip
    if fp8_scheme == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if fp8_scheme == "per_channel" else "tensor"}  # fmt: skip
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                   "strategy": "token"}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}  # fmt: skip


def _source_tensors(src_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(src_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {src_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                yield name, handle.get_tensor(name)


def _write_shards(shards: list[dict[str, torch.Tensor]], out_dir: Path) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def quantize_model(
    src_dir: Path,
    out_dir: Path,
    method: str,
    *,
    bits: int = 4,
    group_size: int = 128,
    sym: bool | None = None,
    desc_act: bool = False,
    fp8_scheme: str = "per_channel",
    progress: bool = True,
) -> Path:
    """Quantize the HF-layout model in `src_dir` into `out_dir` (created) and return it.

    `sym` defaults to True for GPTQ; AWQ is always asymmetric. `bits`, `group_size`, `sym`
    and `desc_act` apply to AWQ/GPTQ, `fp8_scheme` to FP8."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if fp8_scheme not in FP8_SCHEMES:
        raise ValueError(f"fp8_scheme must be one of {FP8_SCHEMES}, got {fp8_scheme!r}")
    if method == "awq" and (bits != 4 or sym):
        raise ValueError("AWQ is 4-bit and asymmetric (zero points)")
    if method != "fp8" and bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    sym = method == "gptq" if sym is None else sym
    hf_config = json.loads((src_dir / "config.json").read_text())
    if "quantization_config" in hf_config:
        raise ValueError(f"{src_dir} is already quantized")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tqdm(_source_tensors(src_dir), desc="quantize", disable=not progress):
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            if method == "awq":
                parts = quantize_awq(tensor, group_size)
            elif method == "gptq":
                parts = quantize_gptq(tensor, bits, group_size, sym, desc_act)
            else:
                parts = quantize_fp8(tensor, fp8_scheme)
            tensors = {f"{module}.{key}": value.contiguous() for key, value in parts.items()}
        else:
            tensors = {name: tensor.contiguous()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard_bytes and shard_bytes + size > _MAX_SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1].update(tensors)
        shard_bytes += size
    _write_shards(shards, out_dir)
    hf_config["quantization_config"] = quantization_config(
        method, bits, group_size, sym, desc_act, fp8_scheme
    )
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    for path in src_dir.iterdir():
        is_weights = path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(
            ".index.json"
        )
        if path.is_file() and not is_weights and path.name != "config.json":
            shutil.copy2(path, out_dir / path.name)
    return out_dir
