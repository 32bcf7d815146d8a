"""Installing and removing a tenant's adapters: stage, validate (off the event loop and off the
engine thread), commit to the registry, then register with the engine by an `AddAdapter`
command (the content digest and folder of the stored files: the engine reads nothing on its
step thread; its loader reads the weights ahead of the first request).

Replacing an adapter installs the new version under a new engine name and unregisters the old
one: requests already admitted keep the old version (its slot and files stay until they
finish); new requests resolve to the new one.

With a registry shared by several replicas, `following_registry` keeps this engine in step with
the changes other replicas make: every `registry_sync_s` it registers adapters they added
(downloading them first from a remote store) and unregisters those they removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILE
from loraplex.adapters.blob_store import present_files
from loraplex.adapters.errors import without_path
from loraplex.adapters.peft_format import AdapterValidationError
from loraplex.adapters.registry import AdapterRecord
from loraplex.adapters.upload import UploadedFile, UploadTooLargeError, unpack_upload
from loraplex.platform.api.errors import APIError, bad_request
from loraplex.platform.api.state import ServerState
from loraplex.platform.core.commands import AddAdapter
from loraplex.platform.tokenizer.tokenizer import read_chat_template

logger = logging.getLogger(__name__)
# NOTE: matched whole (`fullmatch`): `$` would also match before a trailing newline.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def adapter_not_found(name: str, param: str = "name") -> APIError:
    """404 for a name the caller's tenant does not hold (also when another tenant does);
    `param`: the body field or path part that named it."""
    return APIError(
        404, f"The adapter `{name}` does not exist.", type="not_found_error", param=param,
        code="adapter_not_found",
    )  # fmt: skip


def valid_adapter_name(name: str) -> bool:
    """Letters, digits and `_ . : -` (1-128, a letter or digit first), no `..`: never a path."""
    return _NAME.fullmatch(name) is not None and ".." not in name


def check_adapter_name(name: object, base_name: str, param: str = "name") -> str:
    """A valid adapter name, or 400 naming `param` (the field that holds it): letters, digits
    and `_ . : -`, no `/`, `..` or NUL."""
    if name is None:
        raise bad_request(f"`{param}` is required: the adapter's name", param=param)
    if not isinstance(name, str) or not valid_adapter_name(name) or name == base_name:
        raise bad_request(
            f"invalid adapter name {name!r} in `{param}`: use 1-128 letters, digits, '_', '.', "
            "':' or '-', starting with a letter or digit, without '..', and not the base "
            "model's name",
            param=param,
        )
    return name


def card(record: AdapterRecord, base_name: str) -> dict[str, object]:
    """An adapter as the API shows it."""
    return {
        "id": record.name,
        "object": "adapter",
        "created": int(record.created),
        "parent": base_name,
        "digest": f"sha256:{record.digest}",
        "size_bytes": record.size,
        "rank": record.rank,
        "target_modules": list(record.modules),
    }


def files_from_upload(files: list[UploadedFile]) -> Callable[[Path, int], None]:
    return lambda staging, limit: unpack_upload(files, staging, limit)


def files_from_path(path: str) -> Callable[[Path, int], None]:
    """Copy a server-local PEFT folder's files (its tokenizer's too) into the staging folder."""

    def copy(staging: Path, limit: int) -> None:
        folder = Path(path)
        if not folder.is_dir():
            raise AdapterValidationError(f"{path}: adapter path is not a folder")
        names = present_files(folder)
        if sum((folder / f).stat().st_size for f in names) > limit:
            raise UploadTooLargeError(f"{path}: over the limit of {limit} bytes")
        for f in names:
            shutil.copyfile(folder / f, staging / f)

    return copy


class AdapterService:
    """Tenant-scoped adapter installs and removals, serialized per (tenant, name)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._registered: set[str] = set()  # engine names this process registered
        self._uploads = asyncio.Semaphore(state.settings.max_concurrent_uploads)
        self._uploading: dict[str, int] = {}  # uploads in progress, by tenant

    @contextlib.asynccontextmanager
    async def upload_slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of this process's `max_concurrent_uploads` upload slots while an upload is
        read and installed: 503 (with Retry-After) when every slot is taken, 429 when the
        tenant already holds all but one of them (so a tenant trickling its uploads in never
        holds every slot)."""
        slots = self.state.settings.max_concurrent_uploads
        per_tenant = max(1, slots - 1)
        if self._uploading.get(tenant, 0) >= per_tenant:
            raise APIError(
                429,
                f"this tenant already has {per_tenant} adapter upload(s) in progress on this "
                "server process; wait for them to finish",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "5"},
            )
        if self._uploads.locked():
            raise APIError(
                503,
                f"{slots} adapter uploads are already being read by this server process "
                "(--max-concurrent-uploads); try again shortly",
                type="service_unavailable",
                code="uploads_busy",
                headers={"Retry-After": "5"},
            )
        self._uploading[tenant] = self._uploading.get(tenant, 0) + 1
        try:
            async with self._uploads:
                yield
        finally:
            self._uploading[tenant] -= 1
            if not self._uploading[tenant]:
                del self._uploading[tenant]

    @property
    def base_name(self) -> str:
        return self.state.engine.served_model_name

    async def install(
        self, tenant: str, name: str, write_files: Callable[[Path, int], None]
    ) -> tuple[AdapterRecord, bool]:
        """Validate and store an adapter under (tenant, name); returns (record, replaced)."""
        validator = self.state.engine.adapter_validator
        if validator is None:
            raise bad_request("LoRA adapters are disabled on this server")
        if name in self.state.models.server_wide:
            raise bad_request(
                f"the adapter name {name!r} is taken by a server-wide adapter (--lora-modules)",
                param="name",
            )
        registry = self.state.tenancy.registry
        limit = self.state.settings.max_adapter_bytes
        staging = registry.new_staging_dir()

        def stage_and_validate():
            write_files(staging, limit)
            return validator.validate(staging)  # the same checks as every later load

        try:
            weights = await asyncio.to_thread(stage_and_validate)
        except UploadTooLargeError as error:
            registry.discard(staging)
            raise APIError(413, _public(error, staging), code="adapter_too_large") from None
        except (AdapterValidationError, OSError) as error:
            registry.discard(staging)
            raise bad_request(_public(error, staging), code="invalid_adapter") from None
        try:
            await self._probe_chat_template(staging)
        except APIError:
            registry.discard(staging)
            raise
        async with self._lock(tenant, name):
            record, old = await asyncio.to_thread(registry.commit, tenant, name, staging, weights)
            try:
                await self.state.engine.add_adapter(
                    AddAdapter(record.engine_name, record.path, record.digest,
                               tenant=tenant, label=name)
                )  # fmt: skip
            except AdapterValidationError as error:  # its stored files changed since staging
                if old is None:
                    await asyncio.to_thread(registry.delete, tenant, name)
                raise bad_request(
                    _public(error, Path(record.path)), code="invalid_adapter"
                ) from None
            self._registered.add(record.engine_name)
            if old is not None and old.engine_name != record.engine_name:
                await self.state.engine.remove_adapter(old.engine_name)
                self._registered.discard(old.engine_name)
        return record, old is not None

    async def _probe_chat_template(self, folder: Path) -> None:
        """400 if the adapter's own chat template (if it has one) is not a template, or is too
        slow, too large or too greedy on a short conversation (`ChatTemplateRenderer.probe`)."""
        try:
            template = await asyncio.to_thread(_own_chat_template, folder)
        except (ValueError, OSError) as error:  # an unreadable tokenizer_config.json
            raise bad_request(_public(error, folder), code="invalid_adapter") from None
        if template is None:
            return
        base = self.state.engine.tokenizer
        max_chars = self.state.limits_for(base).max_prompt_chars
        await self.state.chat_templates.probe(
            template,
            getattr(base, "bos_token", None) or "",
            getattr(base, "eos_token", None) or "",
            max_chars or self.state.settings.max_request_body_bytes,
        )

    async def remove(self, tenant: str, name: str, param: str = "name") -> AdapterRecord:
        """Delete (tenant, name); 404 naming `param` if the tenant holds no such adapter."""
        async with self._lock(tenant, name):
            record = await asyncio.to_thread(self.state.tenancy.registry.delete, tenant, name)
            if record is None:
                raise adapter_not_found(name, param)
            await self.state.engine.remove_adapter(record.engine_name)
            self._registered.discard(record.engine_name)
        return record

    async def register_stored(self) -> int:
        """Register every stored adapter with the engine (by digest: nothing is read until a
        request needs it), so that after a restart no request reads an adapter on the engine's
        step thread; returns how many were registered."""
        if self.state.engine.adapter_validator is None:
            return 0
        records = await asyncio.to_thread(self.state.tenancy.registry.list)
        registered = 0
        for record in records:
            registered += await self._try_register(record)
        return registered

    async def register_lora_modules(self) -> int:
        """Validate the `--lora-modules` folders (off the event loop) and serve each to every
        tenant under its name; returns how many. ValueError naming the module when LoRA is off,
        its `base_model_name` is not the served model's, or its folder is refused: the server
        does not start with an adapter it was told to serve and cannot."""
        modules = self.state.settings.lora_modules
        if not modules:
            return 0
        if self.state.engine.adapter_validator is None:
            raise ValueError("--lora-modules needs LoRA serving on (--enable-lora)")
        for module in modules:
            if module.base_model_name not in (None, self.base_name):
                raise ValueError(
                    f"--lora-modules {module.name}: base_model_name {module.base_model_name!r} "
                    f"is not the served model {self.base_name!r}"
                )
            try:
                await self._serve_to_everyone(module.name, module.path)
            except (AdapterValidationError, OSError) as error:
                raise ValueError(f"--lora-modules {module.name}: {error}") from None
        return len(modules)

    async def load_server_wide(self, name: str, path: str) -> None:
        """vLLM's `load_lora_adapter`: validate the folder `path` and serve it to every tenant
        as `name`, as `--lora-modules` does; 400 for a name already served (server-wide, or
        held by a tenant, whose requests it would take over) or a folder that is refused."""
        if self.state.engine.adapter_validator is None:
            raise bad_request("LoRA adapters are disabled on this server", param="lora_path")
        async with self._lock("", name):
            if name in self.state.models.server_wide:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                    code="adapter_already_loaded",
                )  # fmt: skip
            records = await asyncio.to_thread(self.state.tenancy.registry.list)
            if any(record.name == name for record in records):
                raise bad_request(
                    f"the name '{name}' is taken by a tenant's adapter (it would take over that "
                    "tenant's requests); choose another name",
                    param="lora_name",
                )
            try:
                await self._serve_to_everyone(name, path)
            except (AdapterValidationError, OSError) as error:
                raise bad_request(_public(error, Path(path)), param="lora_path",
                                  code="invalid_adapter") from None  # fmt: skip

    async def unload_server_wide(self, name: str) -> None:
        """vLLM's `unload_lora_adapter`: stop serving the server-wide adapter `name` (requests
        running on it finish); 404 naming `lora_name` when there is none."""
        async with self._lock("", name):
            served = self.state.models.remove_server_wide(name)
            if served is None or served.lora_request is None:
                raise adapter_not_found(name, "lora_name")
            await self.state.engine.remove_adapter(served.lora_request.lora_name)
        logger.info("stopped serving the server-wide adapter %s", name)

    async def _serve_to_everyone(self, name: str, path: str) -> None:
        """Validate `path` (off the event loop), register it with the engine by its digest and
        serve it to every tenant as `name`. Raises AdapterValidationError or OSError."""
        validator = self.state.engine.adapter_validator
        assert validator is not None
        weights = await asyncio.to_thread(validator.validate, path)
        engine_name = f"{name}@{weights.digest[:12]}"  # tenants' have "tenant/"
        await self.state.engine.add_adapter(
            AddAdapter(engine_name, path, weights.digest, label=name)
        )
        self.state.models.add_server_wide(name, engine_name, path)
        logger.info("serving adapter %s from %s to every tenant", name, path)

    async def sync_with_registry(self) -> tuple[int, int]:
        """Register the adapters other replicas added to the shared registry and unregister
        those they removed; returns (added, removed)."""
        registry = self.state.tenancy.registry
        records = {r.engine_name: r for r in await asyncio.to_thread(registry.list)}
        added = removed = 0
        for name in sorted(self._registered - records.keys()):
            await self.state.engine.remove_adapter(name)
            self._registered.discard(name)
            removed += 1
        for name, record in records.items():
            if name not in self._registered:
                added += await self._try_register(record)
        return added, removed

    @contextlib.asynccontextmanager
    async def following_registry(self) -> AsyncIterator[None]:
        """While open, sync with a shared registry every `registry_sync_s` (a no-op for a
        local one)."""
        if self.state.engine.adapter_validator is None or not self.state.tenancy.registry.shared:
            yield
            return

        async def follow() -> None:
            while True:
                await asyncio.sleep(self.state.settings.registry_sync_s)
                try:
                    await self.sync_with_registry()
                except Exception:  # the store is unreachable: keep serving, try again
                    logger.exception("syncing with the shared adapter registry failed")

        task = asyncio.create_task(follow(), name="loraplex-registry-sync")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _try_register(self, record: AdapterRecord) -> bool:
        """AddAdapter for a stored record, its files fetched to this machine first; False (and
        a warning) when they cannot be fetched or are refused: a request on it gets the
        error, and a shared registry's next sync tries again."""
        try:
            await asyncio.to_thread(self.state.tenancy.registry.materialize, record)
            await self.state.engine.add_adapter(
                AddAdapter(record.engine_name, record.path, record.digest,
                           tenant=record.tenant, label=record.name)
            )  # fmt: skip
        except (OSError, ValueError) as error:
            logger.warning("stored adapter %r: %s", record.engine_name, without_path(
                str(error), Path(record.path)))  # fmt: skip
            return False
        self._registered.add(record.engine_name)
        return True

    def get(self, tenant: str, name: str) -> AdapterRecord:
        record = self.state.tenancy.registry.get(tenant, name)
        if record is None:
            raise adapter_not_found(name)
        return record

    def _lock(self, tenant: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((tenant, name), asyncio.Lock())


def _own_chat_template(folder: Path) -> str | None:
    """The chat template an adapter carries (only an adapter with its own tokenizer.json has one:
    without it the base tokenizer, and its template, serve the adapter)."""
    return read_chat_template(folder) if (folder / TOKENIZER_FILE).is_file() else None


def _public(error: Exception, folder: Path) -> str:
    """The error's message without the server's staging or storage path."""
    return without_path(str(error), folder)
