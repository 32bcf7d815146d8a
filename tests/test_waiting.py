"""The tests' one way to wait for state: it returns what it waited for, or fails saying what."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.waiting import async_wait_until, wait_until


def test_returns_the_first_truthy_value_once_another_thread_provides_it() -> None:
    box: list[int] = []
    threading.Thread(target=lambda: box.append(7)).start()
    assert wait_until(lambda: box and box[0], 10, "the box to fill") == 7


def test_fails_naming_what_it_waited_for_and_the_last_value_seen() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the door to open \(last seen: 0\)"):
        wait_until(lambda: 0, 0.05, "the door to open")


def test_the_async_wait_lets_the_event_loop_run_meanwhile() -> None:
    async def scenario() -> str:
        box: list[str] = []
        asyncio.get_running_loop().call_later(0.05, box.append, "done")
        return await async_wait_until(lambda: box and box[0], 10, "the callback")

    assert asyncio.run(scenario()) == "done"
