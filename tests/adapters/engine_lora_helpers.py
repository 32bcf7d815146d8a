"""Tools of the engine-level LoRA tests: PEFT adapters on the embedded model with their greedy
references, broken copies of an adapter, and a recorder of the adapter slot each token ran with.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.platform.engine.engine import Engine

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: Adapters of different ranks, targets and scalings (one rsLoRA), keyed by name.
ADAPTER_SPECS: dict[str, dict] = {
    "r4-qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "r8-all": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "r16-o-gate-rslora": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": ["o_proj", "gate_proj"],
        "use_rslora": True,
    },
    "r32-k-up-down": {
        "r": 32,
        "lora_alpha": 32,
        "target_modules": ["k_proj", "up_proj", "down_proj"],
    },
    "r2-v-down": {"r": 2, "lora_alpha": 4, "target_modules": ["v_proj", "down_proj"]},
    "r12-q-k-up": {"r": 12, "lora_alpha": 24, "target_modules": ["q_proj", "k_proj", "up_proj"]},
}


#: Factor on B over nn.Linear's default init (what `init_lora_weights=False` leaves), so each
#: adapter changes a greedy continuation within a dozen tokens.
B_SCALE = 3.0
#: Noise added to full module copies (modules_to_save) and to trained token rows, so they
#: change greedy text (the rows more: tied embeddings keep a model repeating a token whose
#: input and output rows change together).
SAVED_NOISE = 4.0
TOKEN_ROW_NOISE = 8.0


class PeftReference:
    """One HF PEFT model holding every adapter of `specs` (default `ADAPTER_SPECS`; non-zero
    B, DoRA magnitudes moved off their initial norms, module copies and token rows moved off
    the base weights), saved as PEFT folders; greedy
    generations are computed one prompt at a time and cached."""

    def __init__(
        self, model_dir: Path, folder: Path, max_new_tokens: int, specs: dict | None = None
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        specs = ADAPTER_SPECS if specs is None else specs
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = None
        for index, (name, options) in enumerate(specs.items()):
            torch.manual_seed(1000 + index)
            config = LoraConfig(init_lora_weights=False, **options)
            if model is None:
                model = get_peft_model(base, config, adapter_name=name)
            else:
                model.add_adapter(name, config)
        assert model is not None
        model.eval()
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for module in model.modules():
                for b in getattr(module, "lora_B", {}).values():
                    b.weight.mul_(B_SCALE)
                for b in (getattr(module, "lora_embedding_B", None) or {}).values():
                    b.mul_(B_SCALE)
                for dora in (getattr(module, "lora_magnitude_vector", None) or {}).values():
                    dora.weight.mul_(0.5 + torch.rand(dora.weight.shape, generator=gen))
                copies = getattr(module, "modules_to_save", None)  # modules_to_save
                for copy in copies.values() if isinstance(copies, torch.nn.ModuleDict) else ():
                    copy.weight.add_(torch.randn(copy.weight.shape, generator=gen) * SAVED_NOISE)
                for rows in (getattr(module, "trainable_tokens_delta", None) or {}).values():
                    rows.add_(torch.randn(rows.shape, generator=gen) * TOKEN_ROW_NOISE)
        model.save_pretrained(
            str(folder)
        )  # NOTE: an adapter not named "default" lands in folder/name
        self.model = model
        self.paths = {name: folder / name for name in specs}
        self.max_new_tokens = max_new_tokens
        self._cache: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def greedy(self, adapter: str | None, prompt_ids: list[int]) -> list[int]:
        """PEFT's greedy tokens for one prompt under `adapter` alone (None: the base model),
        `max_new_tokens` of them whatever EOS says."""
        key = (adapter, tuple(prompt_ids))
        if key not in self._cache:
            if adapter is not None:
                self.model.set_adapter(adapter)
            n = self.max_new_tokens
            with (
                torch.no_grad(),
                self.model.disable_adapter() if adapter is None else nullcontext(),
            ):
                out = self.model.generate(
                    torch.tensor([prompt_ids]),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]

    def agrees(
        self, adapter: str | None, prompt_ids: list[int], tokens: list[int], tolerance: float
    ) -> bool:
        """Whether each of `tokens`, after the prompt and the tokens before it, has a PEFT fp32
        logit within `tolerance` standard deviations (of that position's logits) of the best:
        greedy up to the rounding of a lower-precision engine (bf16), which may flip near-ties."""
        if adapter is not None:
            self.model.set_adapter(adapter)
        ids = torch.tensor([prompt_ids + tokens[:-1]])
        with (
            torch.no_grad(),
            self.model.disable_adapter() if adapter is None else nullcontext(),
        ):
            logits = self.model(ids).logits[0, len(prompt_ids) - 1 :].float()  # [n, vocab]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [n]
        return bool((chosen >= logits.max(dim=1).values - tolerance * logits.std(dim=1)).all())


# -- broken copies of a good adapter ---------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(dst: Path, edit_tensors=None, **config_changes) -> Path:
    config = json.loads((dst / CONFIG_FILE).read_text())
    config.update(config_changes)
    (dst / CONFIG_FILE).write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(str(dst / WEIGHTS_FILE))
        edit_tensors(tensors)
        save_file(tensors, str(dst / WEIGHTS_FILE))
    return dst


def pickle_only(src: Path, dst: Path) -> Path:
    """The weights as `adapter_model.bin` (a pickle), no safetensors file."""
    _copy(src, dst)
    tensors = load_file(str(dst / WEIGHTS_FILE))
    (dst / WEIGHTS_FILE).unlink()
    with open(dst / "adapter_model.bin", "wb") as f:
        pickle.dump(tensors, f)
    return dst


def truncated(src: Path, dst: Path) -> Path:
    """The safetensors file cut in half."""
    _copy(src, dst)
    data = (dst / WEIGHTS_FILE).read_bytes()
    (dst / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    return dst


def wrong_shape(src: Path, dst: Path) -> Path:
    """One lora_A with 8 input features too few for the base model."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        key = sorted(k for k in tensors if "lora_A" in k)[0]
        tensors[key] = tensors[key][:, :-8].contiguous()

    return _edit(_copy(src, dst), edit)


def _sizes(src: Path) -> tuple[int, int, int]:
    """(rank, hidden size, vocab size) of an adapter and the base model it was saved from."""
    config = json.loads((src / CONFIG_FILE).read_text())
    base = json.loads((Path(config["base_model_name_or_path"]) / "config.json").read_text())
    return config["r"], base["hidden_size"], base["vocab_size"]


def lm_head_target(src: Path, dst: Path) -> Path:
    """`lm_head` in target_modules, with A/B tensors one vocabulary row short."""
    config = json.loads((src / CONFIG_FILE).read_text())
    rank, hidden, vocab = _sizes(src)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(rank, hidden)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab - 1, rank)

    targets = [*config["target_modules"], "lm_head"]
    return _edit(_copy(src, dst), edit, target_modules=targets)


def embed_tokens_tensors(src: Path, dst: Path) -> Path:
    """LoRA tensors of `embed_tokens` in the file though the config does not list it."""
    rank, hidden, vocab = _sizes(src)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        prefix = "base_model.model.model.embed_tokens"
        tensors[f"{prefix}.lora_embedding_A"] = torch.randn(rank, vocab)
        tensors[f"{prefix}.lora_embedding_B"] = torch.randn(hidden, rank)

    return _edit(_copy(src, dst), edit)


def rank_over(max_rank: int):
    """A maker of a copy reduced to one module of rank `max_rank + 16` (config says so too)."""
    rank = max_rank + 16

    def make(src: Path, dst: Path) -> Path:
        def edit(tensors: dict[str, torch.Tensor]) -> None:
            a_key = sorted(k for k in tensors if "lora_A" in k)[0]
            b_key = a_key.replace("lora_A", "lora_B")
            a, b = tensors[a_key], tensors[b_key]
            tensors.clear()
            tensors[a_key] = torch.randn(rank, a.shape[1]) * 0.01
            tensors[b_key] = torch.randn(b.shape[0], rank) * 0.01

        return _edit(_copy(src, dst), edit, r=rank, lora_alpha=rank)

    return make


def nan_weights(src: Path, dst: Path) -> Path:
    """One NaN in a lora_B."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        key = sorted(k for k in tensors if "lora_B" in k)[-1]
        tensors[key][0, 0] = float("nan")

    return _edit(_copy(src, dst), edit)


def rot_in_place(folder: Path) -> None:
    """Bit rot after registration: the last weight of the safetensors file becomes NaN, with
    the file's size and modification time kept, so the registry's fingerprint cannot see it."""
    path = folder / WEIGHTS_FILE
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-4:] = struct.pack("<f", float("nan"))  # tensors are fp32, stored little-endian
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# -- which adapter each token ran with -------------------------------------------------------


@dataclass(frozen=True)
class TokenRecord:
    """One token of one step: its request, the request's adapter key, and the slot's tenant."""

    step: int
    request_id: str
    request_key: str | None  # None: the base model
    slot: int  # -1: the base model
    slot_key: str | None  # the adapter resident in `slot` when the batch was installed


class SlotRecorder:
    """Wraps an engine's runner slot writer and slot pool (instance attributes, through
    pytest's monkeypatch) to record every token's slot and to check, at each slot acquisition,
    that no adapter of a running request left its slot."""

    def __init__(self, engine: Engine, keys: list[str], monkeypatch) -> None:
        self.tokens: list[TokenRecord] = []
        self.acquisitions = 0
        self.moved_while_running: list[tuple[str, str]] = []  # (request id, adapter key)
        self.unpinned_in_batch: list[int] = []  # steps whose batch used more slots than pinned
        self.slot_writes = 0
        self.overwritten_in_use: list[tuple[str, int]] = []  # (running request, slot written)
        self._last_slot: dict[str, int] = {}  # request id -> slot its last token ran with
        self._engine = engine
        self._keys = keys
        self._scheduled: list[tuple[str, int, str | None]] = []
        self._step = 0
        runner, manager = engine.runner, engine.lora_manager
        assert manager is not None
        self._pool = manager.pool
        # NOTE: every step, however the runner launches it, starts by applying its output.
        monkeypatch.setattr(runner, "_update_states", self._wrap_update(runner._update_states))
        writer = runner.lora_writer
        monkeypatch.setattr(writer, "write", self._wrap_write(writer.write))
        monkeypatch.setattr(self._pool, "acquire", self._wrap_acquire(self._pool.acquire))
        monkeypatch.setattr(self._pool, "stage", self._wrap_acquire(self._pool.stage, count=False))
        monkeypatch.setattr(self._pool, "_writer", _WriteWatcher(self._pool._writer, self))

    def _resident(self) -> dict[int, str]:
        slots = {key: self._pool.slot_of(key) for key in self._keys}
        return {slot: key for key, slot in slots.items() if slot is not None}

    def _wrap_update(self, update):
        def wrapped(so):
            result = update(so)
            requests = self._engine.scheduler.requests
            rows = self._engine.runner.input_batch.req_index
            scheduled = [
                (rid, n, requests[rid].adapter_key) for rid, n in so.num_scheduled_tokens.items()
            ]
            # NOTE: the runner lays tokens out in the order of its batch rows
            self._scheduled = sorted(scheduled, key=lambda s: rows[s[0]])
            self._step += 1
            return result

        return wrapped

    def _wrap_write(self, write):
        def wrapped(lora_slots, num_padded=None, *, always_apply: bool = False) -> None:
            resident = self._resident()
            slots = lora_slots.tolist()  # [num_tokens], the runner's order of requests
            owners = [(rid, key) for rid, n, key in self._scheduled for _ in range(n)]
            assert len(owners) == len(slots)
            for (rid, key), slot in zip(owners, slots):
                slot_key = resident.get(slot) if slot >= 0 else None
                self.tokens.append(TokenRecord(self._step, rid, key, slot, slot_key))
                self._last_slot[rid] = slot
            if len({s for s in slots if s >= 0}) > self._pool.pinned():
                self.unpinned_in_batch.append(self._step)
            write(lora_slots, num_padded, always_apply=always_apply)

        return wrapped

    def on_slot_write(self, slot: int) -> None:
        """Before a slot is written: no running request may have run its tokens on it."""
        self.slot_writes += 1
        for r in self._engine.scheduler.running:
            if r.adapter_key is not None and self._last_slot.get(r.request_id) == slot:
                self.overwritten_in_use.append((r.request_id, slot))

    def _wrap_acquire(self, acquire, count: bool = True):
        def wrapped(key, **kwargs):
            running = [r for r in self._engine.scheduler.running if r.adapter_key is not None]
            before = {r.request_id: self._pool.slot_of(r.adapter_key) for r in running}
            slot = acquire(key, **kwargs)
            self.acquisitions += count
            for r in running:
                held = before[r.request_id]
                if held is not None and self._pool.slot_of(r.adapter_key) != held:
                    self.moved_while_running.append((r.request_id, r.adapter_key))
            return slot

        return wrapped


class _WriteWatcher:
    """Stands in for the slot pool's writer: tells the recorder of each slot write first."""

    def __init__(self, writer, recorder: SlotRecorder) -> None:
        self._writer = writer
        self._recorder = recorder

    def write_slot(self, slot: int, image) -> None:
        self._recorder.on_slot_write(slot)
        self._writer.write_slot(slot, image)
