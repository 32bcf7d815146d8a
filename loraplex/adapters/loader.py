"""The adapter loader: disk -> a validated slot image in host memory, off the engine thread.

`AdapterReader` is what one read does: validate the PEFT folder (`AdapterValidator`, the same
checks the API ran at upload), stage it as a slot image (`adapters.slot_memory`: page-locked on
CUDA, laid out as a slot, so the engine thread's slot write is a few copies) and, for a known
key, check that the files still hold that version (their digest is the key).

`AdapterLoader` runs reads on one background thread: the engine thread starts a read
(`start`), goes on stepping, and once per step takes the finished ones (`take_finished`); a
read that failed comes back as its exception, for the admission to mark the adapter failed.
The host-to-GPU copy that follows runs on the slot pool's side stream (`adapters.slot_pool`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.adapters.adapter_names import AdapterNames, key_from_digest
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.lora_layer import LoRAModelState
from loraplex.adapters.slot_memory import SlotImage
from loraplex.adapters.validator import AdapterValidator


@dataclass(frozen=True)
class AdapterReader:
    """Reads adapters for one model; touches no cache or slot, so any thread may call it."""

    validator: AdapterValidator
    model_state: LoRAModelState
    names: AdapterNames  # only its key -> folder table is read
    pin_memory: bool  # stage images in page-locked memory (CUDA)

    def read(self, path: str | os.PathLike[str]) -> SlotImage:
        """Validate the folder and stage it as a slot image.

        Raises `AdapterValidationError` naming what is wrong."""
        weights = self.validator.validate(path)
        return self.model_state.stage(weights, pin_memory=self.pin_memory)

    def read_key(self, key: str) -> SlotImage:
        """Read the version `key` from the folder it was registered from; raises
        `AdapterValidationError` when the files there no longer hold that version."""
        path = self.names.path_of(key)
        if path is None:
            raise KeyError(f"unknown adapter key {key!r}")
        image = self.read(path)
        if key_from_digest(image.digest) != key:
            raise AdapterValidationError(
                f"{path}: adapter files changed on disk since they were registered; "
                "register it again"
            )
        return image


class AdapterLoader:
    """Adapter reads on one background thread, taken back on the engine thread."""

    def __init__(self, read: Callable[[str], SlotImage]) -> None:
        """`read`: key -> slot image (run on the loader thread; its errors are reported)."""
        self._read = read
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loraplex-adapter-loader")
        self._pending: dict[str, Future[SlotImage]] = {}  # key -> read under way
        self._done = threading.Event()  # set by the loader thread when a read finishes

    @property
    def num_in_flight(self) -> int:
        """Reads started and not taken back yet."""
        return len(self._pending)

    def is_reading(self, key: str) -> bool:
        return key in self._pending

    def start(self, key: str) -> bool:
        """Start reading `key` unless a read of it is under way; True if this started one."""
        if key in self._pending:
            return False
        future = self._executor.submit(self._read, key)
        future.add_done_callback(lambda _: self._done.set())
        self._pending[key] = future
        return True

    def take_finished(self) -> list[tuple[str, SlotImage | Exception]]:
        """The reads finished since the last call: (key, its image or the error it raised)."""
        self._done.clear()
        finished: list[tuple[str, SlotImage | Exception]] = []
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                finished.append((key, future.result()))
            except Exception as error:  # NOTE: a cancelled read (at shutdown) included
                finished.append((key, error))
        return finished

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a read under way to finish; False when none is under
        way or none finished in time."""
        if not self._pending:
            return False
        return self._done.wait(timeout_s)

    def shutdown(self) -> None:
        """Stop the thread; reads not started are dropped (one under way runs to its end)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
