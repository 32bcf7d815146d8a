"""`loraplex quantize`: write a real AWQ, GPTQ or FP8 checkpoint of a bf16/fp32 model.

Round-to-nearest, no calibration: every q/k/v/o/gate/up/down projection is quantized, all other
tensors are copied. The result is a Hugging Face folder (safetensors, config.json with the
format's `quantization_config`, tokenizer files) that loraplex and other engines load.
GPTQ asymmetric checkpoints are written as "gptq_v2" (the v1 "zero minus one" cannot store a
zero point of 0). With desc_act the inputs get a fixed pseudo-random order per input size: real
GPTQ orders them by the Hessian of the layer input, which q/k/v (and gate/up) share, so merged
shards share the order too; any shared order exercises the act-order path.
Options left out get defaults that fit the model (`loraplex.quant.quantize_options`), all
checked before any work; the folder is built under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from loraplex.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from loraplex.quant.fp8 import quantize_weight_per_channel
from loraplex.quant.packing import AWQ_PACK_ORDER, pack_int32
from loraplex.quant.quantize_options import PROJECTIONS, QuantizeOptions, resolve_options
from loraplex.quant.registry import find_quantization_config, get_quantization_config

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


def _weight_files(src_dir: Path) -> list[Path]:
    files = sorted(src_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {src_dir}")
    return files


def _is_projection(name: str) -> bool:
    module, _, suffix = name.rpartition(".")
    return suffix == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS


def projection_shapes(src_dir: Path) -> dict[str, tuple[int, int]]:
    """(N, K) of every projection weight to quantize, keyed by module, read from the file
    headers only (no tensor is loaded)."""
    shapes = {}
    for path in _weight_files(src_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if _is_projection(name):
                    shape = tuple(handle.get_slice(name).get_shape())
                    if len(shape) != 2:
                        raise ValueError(f"{name}: expected a 2-D weight, got shape {shape}")
                    shapes[name.rpartition(".")[0]] = (int(shape[0]), int(shape[1]))
    return shapes


def _source_tensors(src_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(src_dir):
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


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} already exists and is not an empty folder; choose another")


@contextmanager
def _build_folder(out_dir: Path) -> Iterator[Path]:
    """A fresh hidden sibling of `out_dir` to write into, renamed to `out_dir` when the block
    succeeds. On an error it is removed, with any parent folders made for it, so `out_dir` is
    either absent (or the empty folder it was) or complete."""
    made = [p for p in (out_dir.parent, *out_dir.parent.parents) if not p.exists()]  # deepest first
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build.mkdir()
    try:
        yield build
        if out_dir.exists():
            out_dir.rmdir()  # NOTE: checked empty before any work
        os.rename(build, out_dir)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def quantize_model(
    src_dir: Path,
    out_dir: Path,
    method: str,
    *,
    bits: int | None = None,
    group_size: int | None = None,
    sym: bool | None = None,
    desc_act: bool = False,
    fp8_scheme: str | None = None,
    progress: bool = True,
) -> Path:
    """Quantize the HF-layout model in `src_dir` into the new folder `out_dir` and return it.

    `bits`, `group_size`, `sym` and `desc_act` apply to AWQ/GPTQ, `fp8_scheme` to FP8; None
    picks the default that works for this model (see `resolve_options`): 4 bits, the largest
    group size dividing every quantized input size, AWQ asymmetric, GPTQ symmetric, FP8
    per-channel. Everything is checked before any work; the folder is written under a temporary
    name and renamed at the end, so a failed run leaves no folder behind. `out_dir` must not
    exist, or be an empty folder. Raises ValueError for options or a model it cannot quantize."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if not (src_dir / "config.json").is_file():
        raise ValueError(f"{src_dir} is not a model folder (config.json and *.safetensors)")
    hf_config = json.loads((src_dir / "config.json").read_text())
    if find_quantization_config(src_dir, hf_config) is not None:
        raise ValueError(f"{src_dir} is already quantized")
    options = resolve_options(
        method, projection_shapes(src_dir), bits=bits, group_size=group_size, sym=sym,
        desc_act=desc_act, fp8_scheme=fp8_scheme,
    )  # fmt: skip
    checkpoint_config = quantization_config(
        options.method, options.bits, options.group_size, options.sym, options.desc_act,
        options.fp8_scheme,
    )  # fmt: skip
    get_quantization_config(None, checkpoint_config)  # the loader accepts what we write
    _check_out_dir(out_dir)
    with _build_folder(out_dir) as build:
        _write_quantized(src_dir, build, options, progress)
        hf_config["quantization_config"] = checkpoint_config
        (build / "config.json").write_text(json.dumps(hf_config, indent=2))
        for path in src_dir.iterdir():
            is_weights = path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(
                ".index.json"
            )
            if path.is_file() and not is_weights and path.name != "config.json":
                shutil.copy2(path, build / path.name)
    return out_dir


def _write_quantized(
    src_dir: Path, out_dir: Path, options: QuantizeOptions, progress: bool
) -> None:
    """Every projection quantized, every other tensor copied, in shards of at most 4 GiB."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tqdm(_source_tensors(src_dir), desc="quantize", disable=not progress):
        if _is_projection(name):
            if options.method == "awq":
                parts = quantize_awq(tensor, options.group_size)
            elif options.method == "gptq":
                parts = quantize_gptq(
                    tensor, options.bits, options.group_size, options.sym, options.desc_act
                )
            else:
                parts = quantize_fp8(tensor, options.fp8_scheme)
            module = name.rpartition(".")[0]
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
