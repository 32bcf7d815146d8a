"""AdapterNames: which requests need their adapter registered, removals, and the version a name
is bound to (the registration itself, by path or by command, is tested in test_manager.py)."""

from __future__ import annotations

import os

import pytest
from lora_fixtures import make_peft_adapter

from loraplex.adapters.adapter_names import AdapterNames, key_from_digest
from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.adapters.request import LoRARequest
from loraplex.platform.core.commands import AddAdapter

KEY_1, KEY_2 = key_from_digest("1" * 64), key_from_digest("2" * 64)


def test_a_key_is_the_prefix_and_32_hex_digits_of_the_digest():
    digest = "0123456789abcdef" * 4
    assert key_from_digest(digest) == "lora-0123456789abcdef0123456789abcdef"


def _touch(folder) -> None:
    """Rewrite the weights with one more byte: another size, so another fingerprint."""
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    os.utime(weights, ns=(1, 1))


# how the name was registered, what happens next, the request -> served by the entry?
RESOLVE_CASES = {
    "never seen": (None, None, "a", False),
    "seen by path, same folder": (True, None, "a", True),
    "seen by path, another folder": (True, None, "b", False),
    "seen by path, files changed": (True, "touch", "a", False),
    "seen by path, then removed": (True, "remove", "a", False),
    "registered by command, another folder": (False, None, "b", True),
    "registered by command, files changed": (False, "touch", "a", True),
}


@pytest.mark.parametrize("case", RESOLVE_CASES)
def test_resolve_says_which_requests_need_a_registration(tmp_path, case):
    on_sight, then, folder, served = RESOLVE_CASES[case]
    folders = {"a": make_peft_adapter(tmp_path / "a"), "b": tmp_path / "b"}
    names = AdapterNames()
    if on_sight is not None:
        names.add(AddAdapter("x", str(folders["a"])), KEY_1, on_sight=on_sight)
    if then == "touch":
        _touch(folders["a"])
    elif then == "remove":
        names.remove("x")
    entry = names.resolve(LoRARequest("x", str(folders[folder])))
    assert (entry is not None) == served
    if served:
        assert entry is not None and entry.key == KEY_1


def test_a_name_removed_by_command_is_refused_until_registered_again(tmp_path):
    names = AdapterNames()
    names.add(AddAdapter("x", str(tmp_path)), KEY_1, on_sight=False)
    assert names.remove("x") is not None and names.remove("x") is None
    with pytest.raises(AdapterNotFoundError, match="`x` was removed"):
        names.resolve(LoRARequest("x", str(tmp_path)))
    names.add(AddAdapter("x", str(tmp_path)), KEY_2, on_sight=False)
    assert names.resolve(LoRARequest("x", "/anywhere")).key == KEY_2  # type: ignore[union-attr]


def test_a_version_is_used_while_some_name_is_bound_to_it(tmp_path):
    names = AdapterNames()
    assert names.add(AddAdapter("x", "/v1"), KEY_1, on_sight=False) is None
    names.add(AddAdapter("y", "/v1"), KEY_1, on_sight=True)
    replaced = names.add(AddAdapter("x", "/v2", tenant="t", label="l"), KEY_2, on_sight=False)
    assert replaced is not None and replaced.key == KEY_1
    assert names.uses(KEY_1) and names.uses(KEY_2) and len(names) == 2
    names.remove("y")
    assert not names.uses(KEY_1) and names.uses(KEY_2)
    assert names.path_of(KEY_1) == "/v1"  # a queued request on the old version may need it
    entry = names.get("x")
    assert entry is not None and (entry.path, entry.tenant, entry.label) == ("/v2", "t", "l")
