"""An engine's block map, fetched at most once per interval however many ask for it.

A block map is a walk over every KV block, taken by the engine between two steps (or an HTTP
call to a remote one), and it is asked for by every open panel and, through the backend, by
every streaming chat's memory strip. One cache per engine serves them all: the in-process
engine's is made by the panel's feed (ui/panel/feed.py) and handed to its backend
(`ui.backends.in_process`), so the panel and the chats also show the same map.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BlockMapCache(Generic[T]):
    """What `fetch` returns, no older than `interval_s`. Callers that ask while a fetch runs wait
    for it rather than start their own; a fetch that fails fails every caller of its interval
    the same way, so an engine that cannot answer is still asked only once per interval."""

    def __init__(self, fetch: Callable[[], T], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._fetch = fetch
        self._lock = threading.Lock()
        self._value: T | None = None
        self._error: Exception | None = None
        self._fetched_at = float("-inf")

    def get(self) -> T:
        with self._lock:
            now = time.monotonic()
            if now - self._fetched_at >= self.interval_s:
                try:
                    self._value, self._error = self._fetch(), None
                except Exception as error:
                    self._value, self._error = None, error
                self._fetched_at = now
            if self._error is not None:
                raise self._error
            return self._value
