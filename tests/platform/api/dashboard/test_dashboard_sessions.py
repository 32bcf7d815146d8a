"""The dashboard's session cookies: random tokens kept (hashed) in the data folder's SQLite file,
expiring, ended by a logout in every process that shares the folder, refused after the admin key
changes, and opening the dashboard's reads only."""

from __future__ import annotations

import pytest

from loraplex.platform.api.dashboard.sessions import COOKIE, DashboardSessions, cookie_value

NOW = 1_800_000_000.0


def test_a_session_holds_until_it_expires(tmp_path):
    sessions = DashboardSessions("sk-admin", tmp_path, ttl_s=60)
    token = sessions.issue(now=NOW)
    assert sessions.is_valid(token, now=NOW + 59)
    assert not sessions.is_valid(token, now=NOW + 61)


def test_a_logout_ends_the_session_in_every_process_sharing_the_folder(tmp_path):
    first, second = DashboardSessions("sk-admin", tmp_path), DashboardSessions("sk-admin", tmp_path)
    token, other = first.issue(), first.issue()
    assert second.is_valid(token) and second.is_valid(other)
    second.revoke(token)
    assert not first.is_valid(token) and not second.is_valid(token)
    assert first.is_valid(other)  # only that session ended


def test_unknown_tokens_and_a_rotated_admin_key_are_refused(tmp_path):
    sessions = DashboardSessions("sk-admin", tmp_path)
    token = sessions.issue(now=NOW)
    for forged in (token[:-1], token + "x", "", "x" * 10_000, f"{int(NOW) + 9999}.{'0' * 64}"):
        assert not sessions.is_valid(forged, now=NOW), forged
    rotated = DashboardSessions("sk-other-admin", tmp_path)
    assert not rotated.is_valid(token, now=NOW)
    rotated.issue(now=NOW)  # a login under the new key drops the old key's sessions
    assert not sessions.is_valid(token, now=NOW)


def test_without_an_admin_key_there_is_no_login(tmp_path):
    sessions = DashboardSessions(None, tmp_path)
    assert not sessions.enabled
    with pytest.raises(ValueError, match="no admin key"):
        sessions.issue()
    assert not sessions.is_valid("9999999999.00")
    sessions.revoke("anything")
    with pytest.raises(ValueError, match="ttl_s"):
        DashboardSessions("sk-admin", tmp_path, ttl_s=0)


def test_the_cookie_opens_only_the_dashboard_reads(tmp_path):
    sessions = DashboardSessions("sk-admin", tmp_path)
    header = f"theme=dark; {COOKIE}={sessions.issue()}; other=1"
    assert sessions.authenticates("GET", "/admin/stats", header)
    assert sessions.authenticates("GET", "/dashboard", header)
    for method, path in (("GET", "/admin/tenants"), ("POST", "/admin/stats"),
                         ("POST", "/admin/tenants"), ("GET", "/v1/models")):  # fmt: skip
        assert not sessions.authenticates(method, path, header)
    assert not sessions.authenticates("GET", "/admin/stats", None)


def test_cookie_value_reads_one_cookie_of_a_header():
    assert cookie_value('a=1; b="two"; a=3', "b") == "two"
    assert cookie_value("a=1; a=3", "a") == "1"
    assert cookie_value("ab=1", "a") is None
    assert cookie_value("", "a") is None
