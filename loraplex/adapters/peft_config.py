"""`adapter_config.json`, checked field by field: every field that decides how a LoRA adapter
computes must have the right type and a finite value in range, or the adapter is refused with
an `AdapterValidationError` naming the field. Fields we do not read are left alone (PEFT adds
new ones with each release).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.patterns import PatternTable, Regex, compile_pattern, fullmatch_modules

V = TypeVar("V")

#: the largest `r` (or `rank_pattern` value) accepted before the tensors are even read
MAX_RANK_FIELD = 1 << 16

#: options that change the computation in ways we do not implement (true / non-empty = refused)
_UNSUPPORTED_OPTIONS = {
    "lora_bias": "LoRA bias terms (lora_bias)",
    "layer_replication": "layer replication",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
}
_BOOLEANS = (
    "use_rslora",
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "use_qalora",
    "inference_mode",
    "ensure_weight_tying",
)
_OPTIONAL_STRINGS = ("base_model_name_or_path", "task_type", "revision", "peft_version")
_ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output head
#: the modules whose full copies (`modules_to_save`) or trained rows (`trainable_token_indices`)
#: are served
VOCAB_MODULES = ("embed_tokens", "lm_head")
#: the most token ids one `trainable_token_indices` entry may list
MAX_TRAINABLE_TOKENS = 1 << 16


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The validated fields of one `adapter_config.json` that serving reads."""

    where: str  # the config file, for messages
    r: int
    lora_alpha: float
    use_rslora: bool
    use_dora: bool  # every adapted module carries a `lora_magnitude_vector`
    rank_pattern: PatternTable[int]
    alpha_pattern: PatternTable[float]
    target_modules: tuple[str, ...] | Regex | None  # names, a regex, or None (all-linear)
    exclude_modules: tuple[str, ...] | Regex | None
    base_model_class: str | None
    base_model_name_or_path: str | None
    modules_to_save: tuple[str, ...] = ()  # of VOCAB_MODULES
    trainable_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)  # module -> ids

    def rank_of(self, module_path: str) -> tuple[int, str]:
        """The rank the config declares for a module, and the field it came from."""
        hit = self.rank_pattern.match_pattern_key(module_path)
        return (self.r, "r") if hit is None else (hit[1], f"rank_pattern[{hit[0]!r}]")

    def scaling_of(self, module_path: str, rank: int) -> tuple[float, str]:
        """PEFT's scaling of a module (alpha / r, or alpha / sqrt(r) with rsLoRA) and the field
        its alpha came from."""
        hit = self.alpha_pattern.match_pattern_key(module_path)
        alpha, field = (
            (self.lora_alpha, "lora_alpha")
            if hit is None
            else (hit[1], f"alpha_pattern[{hit[0]!r}]")
        )
        return alpha / (math.sqrt(rank) if self.use_rslora else rank), field

    def targets(self, module_path: str) -> bool:
        """Whether PEFT would have put a LoRA layer on the module (target_modules minus
        exclude_modules, by PEFT's matching rules)."""
        return _selects(self.target_modules, module_path, default=True) and not _selects(
            self.exclude_modules, module_path, default=False
        )


def _selects(rule: tuple[str, ...] | Regex | None, module_path: str, default: bool) -> bool:
    if rule is None:
        return default
    if isinstance(rule, tuple):
        return module_path in rule or any(module_path.endswith(f".{name}") for name in rule)
    return fullmatch_modules(rule, module_path)


def parse_peft_config(config: Any, where: str) -> PeftLoRAConfig:
    """Check a parsed `adapter_config.json`; raises `AdapterValidationError` naming the field."""
    if not isinstance(config, dict):
        raise AdapterValidationError(f"{where}: expected a JSON object")
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterValidationError(f"{where}: peft_type {peft_type!r} is not LORA")
    for name in _BOOLEANS:
        if config.get(name) is not None and not isinstance(config[name], bool):
            raise AdapterValidationError(
                f"{where}: {name} must be true or false, got {config[name]!r}"
            )
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise AdapterValidationError(f"{where}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias is not None and bias != "none":
        raise AdapterValidationError(f"{where}: bias={bias!r} is not supported (only 'none')")
    for name in _OPTIONAL_STRINGS:
        if config.get(name) is not None and not isinstance(config[name], str):
            raise AdapterValidationError(f"{where}: {name} must be a string or null")
    dropout = config.get("lora_dropout")
    if dropout is not None and not (_is_number(dropout) and 0 <= dropout <= 1):
        raise AdapterValidationError(
            f"{where}: lora_dropout must be a number in [0, 1], got {dropout!r}"
        )
    _check_layers(config, where)
    return PeftLoRAConfig(
        where=where,
        r=_rank(config.get("r"), "r", where),
        lora_alpha=_alpha(config.get("lora_alpha"), "lora_alpha", where),
        use_rslora=bool(config.get("use_rslora")),
        use_dora=bool(config.get("use_dora")),
        rank_pattern=_pattern_table(config, "rank_pattern", _rank, where),
        alpha_pattern=_pattern_table(config, "alpha_pattern", _alpha, where),
        target_modules=_module_rule(config, "target_modules", where),
        exclude_modules=_module_rule(config, "exclude_modules", where),
        base_model_class=_base_model_class(config, where),
        base_model_name_or_path=config.get("base_model_name_or_path"),
        modules_to_save=_modules_to_save(config, where),
        trainable_tokens=_trainable_tokens(config, where),
    )


def _modules_to_save(config: dict[str, Any], where: str) -> tuple[str, ...]:
    """`modules_to_save` as module names of VOCAB_MODULES (PEFT matches names by suffix)."""
    value = config.get("modules_to_save")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterValidationError(f"{where}: modules_to_save must be a list of module names")
    names = []
    for name in value:
        short = name.rsplit(".", 1)[-1]
        if short not in VOCAB_MODULES:
            raise AdapterValidationError(
                f"{where}: modules_to_save {name[:80]!r} is not supported: only full copies of "
                f"{list(VOCAB_MODULES)} are served (not norms, classifier heads or projections)"
            )
        names.append(short)
    if names and config.get("ensure_weight_tying"):
        raise AdapterValidationError(
            f"{where}: modules_to_save with ensure_weight_tying is not supported"
        )
    return tuple(dict.fromkeys(names))


def _trainable_tokens(config: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """`trainable_token_indices` (a list of ids for embed_tokens, or module -> ids)."""
    value = config.get("trainable_token_indices")
    if value is None:
        return {}
    table = {"embed_tokens": value} if isinstance(value, list) else value
    if not isinstance(table, dict):
        raise AdapterValidationError(
            f"{where}: trainable_token_indices must be a list of token ids or an object "
            "mapping embed_tokens / lm_head to one"
        )
    tokens: dict[str, tuple[int, ...]] = {}
    for name, ids in table.items():
        short = name.rsplit(".", 1)[-1] if isinstance(name, str) else name
        if short not in VOCAB_MODULES:
            raise AdapterValidationError(
                f"{where}: trainable_token_indices on {str(name)[:80]!r} is not supported; "
                f"only {list(VOCAB_MODULES)}"
            )
        if (
            not isinstance(ids, list)
            or not 1 <= len(ids) <= MAX_TRAINABLE_TOKENS
            or not all(_is_index(i) for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise AdapterValidationError(
                f"{where}: trainable_token_indices[{short!r}] must list 1 to "
                f"{MAX_TRAINABLE_TOKENS} distinct token ids >= 0"
            )
        tokens[short] = tuple(ids)
    return tokens


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rank(value: object, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK_FIELD:
        raise AdapterValidationError(
            f"{where}: {field} must be an integer in [1, {MAX_RANK_FIELD}], got {value!r}"
        )
    return value


def _alpha(value: object, field: str, where: str) -> float:
    if not _is_number(value) or value <= 0:  # type: ignore[operator]
        raise AdapterValidationError(f"{where}: {field} must be a finite number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _pattern_table(
    config: dict[str, Any], field: str, check: Callable[[object, str, str], V], where: str
) -> PatternTable[V]:
    table = config.get(field)
    if table is None:
        return PatternTable.compile(field, {}, where)
    if not isinstance(table, dict):
        raise AdapterValidationError(
            f"{where}: {field} must be an object mapping module patterns to values, "
            f"got {type(table).__name__}"
        )
    values = {key: check(value, f"{field}[{key[:80]!r}]", where) for key, value in table.items()}
    return PatternTable.compile(field, values, where)


def _module_rule(config: dict[str, Any], field: str, where: str) -> tuple[str, ...] | Regex | None:
    value = config.get(field)
    if value is None or value == _ALL_LINEAR:
        return None
    if isinstance(value, str):
        return compile_pattern(value, field, where)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterValidationError(
            f"{where}: {field} must be a list of module names or one regex string"
        )
    if len(value) > 1024:
        raise AdapterValidationError(f"{where}: {field} has {len(value)} names, over 1024")
    return tuple(value)


def _check_layers(config: dict[str, Any], where: str) -> None:
    layers = config.get("layers_to_transform")
    indices = layers if isinstance(layers, list) else [layers]
    if layers is not None and not all(_is_index(i) for i in indices):
        raise AdapterValidationError(
            f"{where}: layers_to_transform must be a layer index or a list of them"
        )
    pattern = config.get("layers_pattern")
    names = pattern if isinstance(pattern, list) else [pattern]
    if pattern is not None and not all(isinstance(p, str) for p in names):
        raise AdapterValidationError(f"{where}: layers_pattern must be a string or a list of them")


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _base_model_class(config: dict[str, Any], where: str) -> str | None:
    mapping = config.get("auto_mapping")
    if mapping is None:
        return None
    if not isinstance(mapping, dict):
        raise AdapterValidationError(f"{where}: auto_mapping must be an object or null")
    base_class = mapping.get("base_model_class")
    if base_class is not None and not isinstance(base_class, str):
        raise AdapterValidationError(f"{where}: auto_mapping.base_model_class must be a string")
    return base_class
