"""The Responses store: per-tenant isolation and bound, shared by every API process over the
same data folder, kept across restarts."""

from __future__ import annotations

import pytest

from loraplex.platform.api.openai.responses.store import ResponseStore, StoredResponse


def _stored(i: int) -> StoredResponse:
    return StoredResponse({"id": f"r{i}", "output": []}, ({"role": "user", "content": f"{i}"},))


def test_tenants_see_only_their_own_and_the_oldest_go_first(tmp_path):
    store = ResponseStore(tmp_path, max_per_tenant=3)
    for i in range(5):
        store.put("alpha", f"r{i}", _stored(i))
    store.put("beta", "b0", _stored(9))
    assert [store.get("alpha", f"r{i}") is not None for i in range(5)] == [False, False] + [
        True
    ] * 3
    assert store.get("alpha", "r4") == _stored(4)
    assert store.get("beta", "r4") is None and store.get("alpha", "b0") is None
    assert store.get("beta", "b0") == _stored(9)  # beta's one survives alpha's evictions
    with pytest.raises(ValueError):
        ResponseStore(tmp_path, max_per_tenant=0)


def test_another_process_and_a_restart_see_stored_responses(tmp_path):
    first, second = ResponseStore(tmp_path), ResponseStore(tmp_path)
    first.put("alpha", "r1", _stored(1))
    assert second.get("alpha", "r1") == _stored(1)
    first.close()
    second.close()
    assert ResponseStore(tmp_path).get("alpha", "r1") == _stored(1)


def test_a_tenant_deletes_only_its_own(tmp_path):
    store = ResponseStore(tmp_path)
    store.put("alpha", "r1", _stored(1))
    assert not store.delete("beta", "r1")  # another tenant's id is not found
    assert store.get("alpha", "r1") == _stored(1)
    assert store.delete("alpha", "r1") and store.get("alpha", "r1") is None
    assert not store.delete("alpha", "r1")
    store.close()
