"""`LoRAManager`: the adapters of one engine, owned by the engine alone.

A thin owner of four parts, each in its own module:

- `names` (`adapters.adapter_names`): name -> adapter version (its key, a content hash). One
  registration path, `register`: an `AddAdapter` command goes through it, and so does a
  `LoRARequest` naming a folder on first sight (`adapter_key`).
- `loader` (`adapters.loader`): disk -> validated slot image, on a background thread.
- `admission` (`adapters.slot_admission`): GPU slots, pins and the starvation bound; the only
  part the scheduler sees (its `AdapterAdmission` protocol).
- statistics (`adapters.adapter_stats`): `stats` and `stats_report`, typed snapshots.

The engine builds it, runs the adapter commands on it (`register`, `remove_adapter`, `pin`,
`stats_report`), calls `poll` once per step and ends the requests of `take_failures`; the
runner never sees it (it writes each step's slots into the LoRA layers' batch metadata);
prefix caching hashes blocks with `adapter_key`.
"""

from __future__ import annotations

from collections import Counter

import torch

from loraplex.adapters.adapter_names import AdapterNames, key_from_digest
from loraplex.adapters.adapter_stats import AdapterStats
from loraplex.adapters.errors import AdapterLoadError
from loraplex.adapters.loader import AdapterLoader, AdapterReader
from loraplex.adapters.lora_layer import LoRAModelState
from loraplex.adapters.peft_format import BaseModelSpec
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.slot_admission import SlotAdmission
from loraplex.adapters.slot_pool import LoRASlotPool
from loraplex.adapters.validator import AdapterValidator
from loraplex.config import LoRAConfig
from loraplex.platform.core.commands import AdapterAdded, AdapterStatsReport, AddAdapter
from loraplex.platform.core.stats import LoRAStats


class LoRAManager:
    """The names, loader, slot admission and statistics of the LoRA adapters of one model."""

    def __init__(
        self,
        config: LoRAConfig,
        spec: BaseModelSpec,
        model_state: LoRAModelState,
        dtype: torch.dtype,
        *,
        base_tokenizer: str = "",
    ) -> None:
        """`base_tokenizer`: the folder of the base model's tokenizer.json ("": none), which an
        adapter's own tokenizer must agree with."""
        model_state.check_spec(spec)
        if model_state.saved_module_slots != config.max_saved_module_loras:
            raise ValueError(
                f"max_saved_module_loras={config.max_saved_module_loras}, but the model holds "
                f"{model_state.saved_module_slots} slots of embed_tokens / lm_head copies"
            )
        device = model_state.meta.workspace.device
        #: the checks of this manager's adapters, as a value to hand to other processes
        self.validator = AdapterValidator(
            spec, config.max_lora_rank, str(dtype).removeprefix("torch."),
            config.max_saved_module_loras, base_tokenizer,
        )  # fmt: skip
        self.names = AdapterNames()
        self._reader = AdapterReader(self.validator, model_state, self.names, device.type == "cuda")
        self.pool = LoRASlotPool(
            config.max_loras,
            config.max_cpu_loras,
            model_state,
            self._reader.read_key,
            device,
            config.max_saved_module_loras,
        )
        self.loader = AdapterLoader(self.pool.read)
        self._stats = AdapterStats()
        self.admission = SlotAdmission(self.pool, self.names, self.loader, self._stats)

    # -- names --------------------------------------------------------------------------------

    def register(self, command: AddAdapter, *, on_sight: bool = False) -> AdapterAdded:
        """Register (or replace) the adapter `command.name`: the one registration path.

        With the content digest given, nothing is read here: the key follows from the digest
        and the loader reads and validates the files ahead of the first request (a mismatch
        fails the adapter's load). Without it the files are read and validated now.
        `on_sight`: registered for a `LoRARequest` naming the folder (see `adapter_key`).
        Raises `AdapterValidationError`."""
        if command.digest:
            key = key_from_digest(command.digest)
        else:
            image = self._reader.read(command.path)
            key = key_from_digest(image.digest)
            self.pool.put_host(key, image)
        self.admission.unpin(command.name)  # a pin holds the replaced version's slot
        self.admission.clear_failure(key)  # validated afresh: a new chance
        old = self.names.add(command, key, on_sight=on_sight)
        if old is not None and old.key != key:
            self.admission.drop_if_unused(old.key)
        if command.pinned:
            self.pin(command.name, True)
        elif self.pool.cpu_resident() < self.pool.max_cpu_loras:
            self.admission.prefetch(key)  # room in the host cache: read it ahead of need
        return AdapterAdded(command.name, key, old is not None)

    def adapter_key(self, request: LoRARequest | None) -> str | None:
        """The identity of the adapter's weights (a content hash), None for the base model.

        Registers the adapter on first sight, and again when its folder or files changed.
        Raises `AdapterValidationError` (`AdapterLoadError` for one that failed to load,
        `AdapterNotFoundError` for one a command removed)."""
        if request is None:
            return None
        entry = self.names.resolve(request)
        if entry is None:
            command = AddAdapter(request.lora_name, request.lora_path)
            return self.register(command, on_sight=True).key
        failure = self.admission.failure(entry.key)
        if failure is not None:
            raise AdapterLoadError(failure)
        return entry.key

    def remove_adapter(self, lora_name: str) -> bool:
        """Unregister an adapter; running requests keep their slot until they finish."""
        self.admission.unpin(lora_name)
        entry = self.names.remove(lora_name)
        if entry is None:
            return False
        self.admission.drop_if_unused(entry.key)
        return True

    def pin(self, name: str, pinned: bool = True) -> bool:
        """Keep the adapter in a GPU slot (loaded as soon as it can be) or release it; False if
        no adapter has that name. Raises ValueError when pinning would leave no slot for the
        other adapters."""
        entry = self.names.get(name)
        if entry is None:
            return False
        if not pinned:
            self.admission.unpin(name)
        elif not self.admission.is_pinned(name):
            num_pinned = self.admission.num_pins
            if num_pinned + 1 >= self.pool.num_slots:
                raise ValueError(
                    f"cannot pin {name!r}: {num_pinned} of {self.pool.num_slots} GPU slots are "
                    "pinned already, and one must stay for the other adapters"
                )
            self.admission.pin(name, entry.key)
        return True

    # -- each step ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Once per step, on the engine thread (see `SlotAdmission.poll`)."""
        self.admission.poll()

    def wait_for_loads(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a read under way to finish (the engine calls this when
        a step had nothing to run but requests wait for adapters); False on timeout or when
        no read is under way."""
        return self.loader.wait(timeout_s)

    def take_failures(self) -> dict[str, str]:
        """Adapters (key -> reason) that failed to load since the last call; the engine ends
        the requests queued on them with the reason. Requests added later are refused."""
        return self.admission.take_failures()

    # -- statistics ---------------------------------------------------------------------------

    def stats(self) -> LoRAStats:
        return self._stats.snapshot(self.names, self.pool)

    def stats_report(self, waiting: Counter[str] | None = None) -> AdapterStatsReport:
        """The `GetAdapterStats` result; `waiting` counts queued requests per adapter key."""
        return self._stats.report(self.names, self.admission, self.loader, waiting or Counter())

    def shutdown(self) -> None:
        """Stop the loader thread (reads under way are dropped)."""
        self.loader.shutdown()
