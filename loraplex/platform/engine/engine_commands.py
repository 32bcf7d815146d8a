"""The engine's handlers of engine commands (`loraplex.platform.core.commands`), one per command
type in one table. Each runs on the thread that steps the engine, between steps, and returns the
command's result (the commands module lists them) or raises its error."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loraplex.adapters.manager import LoRAManager
from loraplex.platform.core.commands import (
    AdapterAdded,
    AdapterStatsReport,
    AddAdapter,
    EngineCommand,
    GetAdapterStats,
    GetTenantStats,
    PinAdapter,
    RemoveAdapter,
    SetTenantWeight,
    TenantStatsReport,
)

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import Engine


def _lora(engine: Engine) -> LoRAManager:
    if engine.lora_manager is None:
        raise ValueError("LoRA adapters are disabled on this engine (enable_lora=False)")
    return engine.lora_manager


def _add_adapter(engine: Engine, command: AddAdapter) -> AdapterAdded:
    return _lora(engine).register(command)


def _remove_adapter(engine: Engine, command: RemoveAdapter) -> bool:
    if engine.lora_manager is None:
        return False
    return engine.lora_manager.remove_adapter(command.name)


def _pin_adapter(engine: Engine, command: PinAdapter) -> bool:
    return _lora(engine).pin(command.name, command.pinned)


def _set_tenant_weight(engine: Engine, command: SetTenantWeight) -> None:
    engine.scheduler.set_tenant_weight(command.tenant, command.weight)


def _adapter_stats(engine: Engine, command: GetAdapterStats) -> AdapterStatsReport:
    return _lora(engine).stats_report(engine.scheduler.num_waiting_by_adapter())


def _tenant_stats(engine: Engine, command: GetTenantStats) -> TenantStatsReport:
    return engine.scheduler.tenant_stats()


COMMAND_HANDLERS: dict[type, Callable[[Engine, Any], object]] = {
    AddAdapter: _add_adapter,
    RemoveAdapter: _remove_adapter,
    PinAdapter: _pin_adapter,
    SetTenantWeight: _set_tenant_weight,
    GetAdapterStats: _adapter_stats,
    GetTenantStats: _tenant_stats,
}


def handle_command(engine: Engine, command: EngineCommand) -> object:
    """Run `command` on `engine`; ValueError for a command it refuses (LoRA disabled, pinning
    every slot, an unknown command), `AdapterValidationError` for an adapter it cannot serve."""
    handler = COMMAND_HANDLERS.get(type(command))
    if handler is None:
        raise ValueError(f"unknown engine command {command!r}")
    return handler(engine, command)
