"""The live panel's one view of the engine, shared by every browser that shows the panel.

A sampler thread reads the engine client's stats snapshot once per interval into a bounded
history, so the plots have a past even for a browser that opened the panel a minute ago, and
ten open panels cost the engine no more than one. Block maps are taken by the engine thread
between two steps (a walk over every block), so they are fetched only when asked for and at
most once per interval, then shared: `block_map_cache` serves the in-process backend too, so
the chats' memory strips add no fetches of their own (ui/backends/block_map_cache.py).
"""
from __future__ import annotations

import dataclasses
import threading
import time

from engine import BlockMap, StreamingClient
from ui.backends.block_map_cache import BlockMapCache
from ui.panel.history import StatsHistory


class PanelFeed:
    def __init__(self, client: StreamingClient, interval_s: float = 1.0, capacity: int = 600,
                 window_s: float = 30.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.client = client
        self.interval_s = interval_s
        self._history = StatsHistory(capacity, window_s)
        self._history_lock = threading.Lock()
        self.block_map_cache: BlockMapCache[BlockMap] = BlockMapCache(client.block_map, interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PanelFeed:
        if self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="panel-feed", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.client.closed:  # stopped, or its core restarting (engine/runtime/process_client.py)
                self.sample()

    def sample(self) -> None:
        """Add the client's current stats, stamped now: an idle engine publishes no new steps,
        and the plots must still move on (its cumulative counters make that exact)."""
        stats = dataclasses.replace(self.client.stats(), timestamp=time.time())
        with self._history_lock:
            self._history.add(stats)

    def history(self) -> StatsHistory:
        """A copy of the history that the caller may read while sampling goes on."""
        with self._history_lock:
            copy = StatsHistory(self._history.capacity, self._history.window_s)
            for stats in self._history.samples:
                copy.add(stats)
        return copy

    def block_map(self) -> BlockMap:
        """The latest block map, no older than one interval."""
        return self.block_map_cache.get()
