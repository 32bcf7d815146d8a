"""Model architectures by the `architectures` name in config.json."""

from __future__ import annotations

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


def register_model(*names: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            _MODELS[name] = cls
        return cls

    return wrap


def get_model_class(architecture: str) -> type[nn.Module]:
    import loraplex.platform.models.llama  # noqa: F401  (registers the Llama family)

    cls = _MODELS.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    return cls
