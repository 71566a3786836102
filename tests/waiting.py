"""The one way a test waits: on a condition, with a generous deadline. The machine is shared (two
cores, often two pytest workers and a benchmark on them), so a deadline is only a bound on a hang,
never a speed assertion: a test that waits gives its condition minutes. Speed is measured in
benchmarks/, not asserted here."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 120.0  # how long a condition may take on a busy machine before the test calls it a hang
INTERVAL_S = 0.02


def poll(condition: Callable[[], T], timeout: float = DEADLINE_S, interval: float = INTERVAL_S) -> T:
    """Call `condition` until it returns something true or `timeout` seconds pass; its last value
    (false when the deadline passed)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_for(condition: Callable[[], T], what: str | Callable[[], object], timeout: float = DEADLINE_S,
             interval: float = INTERVAL_S) -> T:
    """`poll`, raising AssertionError with `what` (a description, or a callable that describes the
    state at the deadline) when the condition never held; its true value otherwise."""
    value = poll(condition, timeout, interval)
    if not value:
        raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
    return value


async def async_wait_for(condition: Callable[[], T], what: str | Callable[[], object], timeout: float = DEADLINE_S,
                         interval: float = INTERVAL_S) -> T:
    """`wait_for` for a coroutine: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
        await asyncio.sleep(interval)
    return value
