"""The adapter errors every part may see: a refused adapter, and one that failed to load."""

from __future__ import annotations


class AdapterValidationError(ValueError):
    """An adapter that cannot be served; the message names the file, field, tensor or module."""


class AdapterLoadError(AdapterValidationError):
    """An adapter registered earlier that failed to load when a request needed it (its files
    changed or vanished, or it no longer passes validation); only its own requests fail."""


class AdapterNotFoundError(AdapterValidationError):
    """A request names an adapter that was removed (or never registered) by an engine command;
    the API answers 404."""


def without_path(message: str, folder: object) -> str:
    """`message` with the server-side `folder` left out, fit to show a tenant."""
    text = str(folder)
    return message.replace(f"{text}/", "").replace(text, "the adapter")
