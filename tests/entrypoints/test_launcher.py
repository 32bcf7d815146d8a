"""The serving launcher's choices that need no process: how many API processes by default,
the options it takes, and the values it refuses."""

from __future__ import annotations

import logging

import pytest

from loraplex.cli import build_parser
from loraplex.entrypoints import launcher
from loraplex.entrypoints.launcher import (
    API_SERVER_COUNT_RULE,
    MAX_DEFAULT_API_SERVERS,
    Launcher,
    default_api_server_count,
)
from loraplex.entrypoints.serve_cli import (
    engine_config,
    resolve_options,
    run_serve,
    server_settings,
)


@pytest.mark.parametrize(
    ("flags", "cores", "processes"),
    [([], 2, 1), ([], 8, 2), ([], 16, 4), ([], 128, 4), (["--api-server-count", "3"], 16, 3),
     (["--api-server-count", "1"], 64, 1)],
)  # fmt: skip
def test_serve_chooses_the_api_processes_from_the_host_unless_told(
    monkeypatch, caplog, flags, cores, processes
):
    # NOTE: tenants' caps hold across API processes (the engine core counts them)
    started = []
    monkeypatch.setattr(Launcher, "run", lambda self: started.append(self.api_server_count) or 0)
    monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
    with caplog.at_level(logging.INFO):
        assert run_serve(build_parser().parse_args(["serve", *flags])) == 0
    assert started == [processes]
    # the count it chose, and why, is in the log
    chose = "given" if flags else f"{API_SERVER_COUNT_RULE}, {cores} cores"
    assert f"{processes} API process(es) ({chose})" in caplog.text


def test_the_default_count_is_one_per_four_cores_from_one_to_four():
    assert [default_api_server_count(c) for c in (1, 3, 4, 8, 12, 15, 16, 64)] == [
        1, 1, 1, 2, 3, 3, 4, 4,
    ]  # fmt: skip
    assert 1 <= default_api_server_count() <= MAX_DEFAULT_API_SERVERS


def test_serve_takes_the_process_options():
    values = resolve_options(
        build_parser().parse_args(["serve", "--api-server-count", "3", "--shutdown-timeout", "7"])
    )
    assert values["api_server_count"] == 3 and values["shutdown_timeout"] == 7.0
    defaults = resolve_options(build_parser().parse_args(["serve"]))
    assert defaults["api_server_count"] is None and defaults["shutdown_timeout"] == 30.0


@pytest.mark.parametrize(("count", "grace"), [(0, 5.0), (-1, 5.0), (1, -1.0)])
def test_bad_counts_and_grace_periods_are_refused(count, grace):
    values = resolve_options(build_parser().parse_args(["serve"]))
    with pytest.raises(ValueError):
        Launcher(engine_config(values), server_settings(values), count, grace, {})
