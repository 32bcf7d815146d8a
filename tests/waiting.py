"""Waiting for state a test can observe, instead of sleeping and hoping it arrived.

    from tests.waiting import wait_until

    wait_until(lambda: alive(pids) == [], 10, "every server process to exit")

`wait_until` polls a predicate until it returns something truthy (and returns that), or fails
the test, naming what it waited for and the last value it saw. `async_wait_until` is the same
for a test running inside an event loop, which must keep running while it waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition"
) -> T:
    """The first truthy value `predicate()` returns, polled every POLL_S seconds; an
    AssertionError when `timeout_s` passes without one."""
    deadline = time.monotonic() + timeout_s
    while (value := _poll(predicate, deadline, timeout_s, what)) is None:
        time.sleep(POLL_S)
    return value


async def async_wait_until(
    predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition"
) -> T:
    """`wait_until` that yields to the running event loop between polls."""
    deadline = time.monotonic() + timeout_s
    while (value := _poll(predicate, deadline, timeout_s, what)) is None:
        await asyncio.sleep(POLL_S)
    return value


def _poll(predicate: Callable[[], T], deadline: float, timeout_s: float, what: str) -> T | None:
    """One poll: the predicate's value when truthy, None to poll again; past `deadline`, an
    AssertionError naming `what` and the last value seen."""
    value = predicate()
    if value:
        return value
    if time.monotonic() > deadline:
        raise AssertionError(
            f"timed out after {timeout_s:g} s waiting for {what} (last seen: {value!r})"
        )
    return None
