"""The serving launcher's choices that need no process: how many API processes by default,
the options it takes, and the values it refuses."""

from __future__ import annotations

import pytest

from loraplex.cli import build_parser
from loraplex.entrypoints.launcher import DEFAULT_API_SERVER_COUNT, Launcher
from loraplex.entrypoints.serve_cli import engine_config, resolve_options, server_settings


def test_one_api_process_by_default():
    # NOTE: tenants' concurrency caps are counted per API process (see launcher)
    assert DEFAULT_API_SERVER_COUNT == 1


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
