"""The serving launcher's choices that need no process: how many API processes by default,
the options it takes, and the values it refuses."""

from __future__ import annotations

import pytest

from loraplex.cli import build_parser
from loraplex.entrypoints.launcher import Launcher
from loraplex.entrypoints.serve_cli import (
    engine_config,
    resolve_options,
    run_serve,
    server_settings,
)


@pytest.mark.parametrize(("flags", "processes"), [([], 1), (["--api-server-count", "3"], 3)])
def test_serve_starts_one_api_process_unless_told_otherwise(monkeypatch, flags, processes):
    # NOTE: tenants' concurrency caps are counted per API process (see launcher)
    started = []
    monkeypatch.setattr(Launcher, "run", lambda self: started.append(self.api_server_count) or 0)
    assert run_serve(build_parser().parse_args(["serve", *flags])) == 0
    assert started == [processes]


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
