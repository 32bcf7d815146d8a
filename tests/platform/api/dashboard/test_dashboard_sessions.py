"""The dashboard's session cookies: signed with the admin key, expiring, for its reads only."""

from __future__ import annotations

import pytest

from loraplex.platform.api.dashboard.sessions import COOKIE, DashboardSessions, cookie_value

NOW = 1_800_000_000.0


def test_a_session_holds_until_it_expires():
    sessions = DashboardSessions("sk-admin", ttl_s=60)
    token = sessions.issue(now=NOW)
    assert sessions.is_valid(token, now=NOW + 59)
    assert not sessions.is_valid(token, now=NOW + 61)


def test_forged_or_foreign_tokens_are_refused():
    token = DashboardSessions("sk-admin").issue(now=NOW)
    expiry, signature = token.split(".")
    sessions = DashboardSessions("sk-admin")
    later = str(int(expiry) + 10_000)
    for forged in (f"{later}.{signature}", f"{expiry}.{'0' * 64}", expiry, "", "a.b.c", ".x"):
        assert not sessions.is_valid(forged, now=NOW), forged
    assert not DashboardSessions("sk-other-admin").is_valid(token, now=NOW)  # key rotated


def test_without_an_admin_key_there_is_no_login():
    sessions = DashboardSessions(None)
    assert not sessions.enabled
    with pytest.raises(ValueError, match="no admin key"):
        sessions.issue()
    assert not sessions.is_valid("9999999999.00")
    with pytest.raises(ValueError, match="ttl_s"):
        DashboardSessions("sk-admin", ttl_s=0)


def test_the_cookie_opens_only_the_dashboard_reads():
    sessions = DashboardSessions("sk-admin")
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
