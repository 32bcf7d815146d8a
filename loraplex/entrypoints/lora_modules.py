"""Parsing `--lora-modules`, as vLLM names it: adapters the server serves from start-up, to
every tenant, under names of their own (each a `LoRAModule` of the `ServerSettings`).

Each entry is `name=path` or a JSON object `{"name": ..., "path": ..., "base_model_name": ...}`
(in YAML a string or a mapping). The folder is validated as an upload is, once per API
process at start-up, and registered with the engine by its content digest; it is not copied
into the tenants' registry, so dropping the flag drops the adapter on the next start.
"""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.platform.api.settings import LoRAModule


def parse_lora_modules(entries: list[object] | tuple[object, ...] | None) -> tuple[LoRAModule, ...]:
    """The entries as `LoRAModule`s; ValueError naming the entry at fault (a bad form, name or
    folder, or a name given twice)."""
    modules: list[LoRAModule] = []
    for entry in entries or ():
        module = _parse_one(entry)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: {module.name!r} is given twice")
        modules.append(module)
    return tuple(modules)


def _parse_one(entry: object) -> LoRAModule:
    from loraplex.platform.api.tenancy.adapter_service import valid_adapter_name

    fields: object = entry
    if isinstance(entry, str):
        text = entry.strip()
        if text.startswith("{"):
            try:
                fields = json.loads(text)
            except ValueError as error:
                raise ValueError(f"--lora-modules: {entry!r} is not valid JSON ({error})") from None
        elif "=" in text:
            name, path = text.split("=", 1)
            fields = {"name": name, "path": path}
        else:
            raise ValueError(
                f"--lora-modules: {entry!r} is neither name=path nor a JSON object with "
                '"name" and "path"'
            )
    if not isinstance(fields, dict):
        raise ValueError(f"--lora-modules: {entry!r} is neither name=path nor a JSON object")
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"--lora-modules: {entry!r} has unknown field(s) {unknown}")
    name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    if not isinstance(name, str) or not valid_adapter_name(name):
        raise ValueError(
            f"--lora-modules: invalid adapter name {name!r}: use 1-128 letters, digits, '_', "
            "'.', ':' or '-', starting with a letter or digit, without '..'"
        )
    if not isinstance(path, str) or not (Path(path) / "adapter_config.json").is_file():
        raise ValueError(
            f"--lora-modules {name}: {path!r} is not a PEFT adapter folder (no adapter_config.json)"
        )
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {name}: base_model_name must be a string, got {base!r}")
    return LoRAModule(name, str(Path(path).resolve()), base)
