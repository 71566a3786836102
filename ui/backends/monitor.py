"""Health and load of every backend, looked at about once a second on a thread per backend (a
slow or hung server delays only its own row): what the router routes by and the panel draws.

A backend is down from the moment a look or a request finds it unreachable or unhealthy (a
reply that cannot connect reports it at once), and up again at the first look that finds
`/health` and `/v1/models` answering.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from engine import BlockMap, EngineInfo
from ui.backends.backend import Endpoint, Probe
from ui.backends.figures import BackendStatus, Figures, MetricsSnapshot
from ui.backends.metrics_reader import figures

log = logging.getLogger(__name__)


# Rates (throughput, hit rate, TTFT, preemptions) are taken over this many seconds of scrapes:
# over one second, a step longer than the interval reads as zero throughput.
WINDOW_S = 5.0


class _Watched:
    def __init__(self, endpoint: Endpoint, capacity: int, window: int) -> None:
        self.endpoint = endpoint
        self.probe = Probe(up=False, problem="not looked at yet")
        self.looked = threading.Event()  # set after the first look
        self.recent: deque[MetricsSnapshot] = deque(maxlen=window + 1)  # the window's scrapes, newest last
        self.history: deque[Figures] = deque(maxlen=capacity)
        self.in_flight = 0


class Monitor:
    def __init__(self, endpoints: Sequence[Endpoint], interval_s: float = 1.0, capacity: int = 120) -> None:
        if not endpoints:
            raise ValueError("a monitor needs at least one backend")
        names = [e.name for e in endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"two backends have the same name: {names}")
        self.interval_s = interval_s
        window = max(1, round(WINDOW_S / interval_s))
        self._watched = {e.name: _Watched(e, capacity, window) for e in endpoints}
        for endpoint in endpoints:  # a request that finds its server gone reports it here at once
            if getattr(endpoint, "on_unreachable", False) is None:
                endpoint.on_unreachable = self.mark_down
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def endpoints(self) -> list[Endpoint]:
        return [w.endpoint for w in self._watched.values()]

    def start(self) -> Monitor:
        """Look at every backend once (in parallel), then keep looking in the background."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._watch, args=(name,), name=f"monitor-{name}", daemon=True)
                             for name in self._watched]
            for thread in self._threads:
                thread.start()
            deadline = time.monotonic() + 10  # a hung backend's first look must not hold up the app
            for watched in self._watched.values():
                watched.looked.wait(max(0.0, deadline - time.monotonic()))
        return self

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _watch(self, name: str) -> None:
        while True:
            self.look(name)
            if self._stop.wait(self.interval_s):
                return

    def look(self, name: str) -> None:
        """Probe one backend now and record what it showed."""
        watched = self._watched[name]
        try:
            probe = watched.endpoint.probe()
        except Exception as error:  # a look must never end the watching thread
            log.exception("probing %s failed", name)
            probe = Probe(up=False, problem=f"the look failed: {error}")
        with self._lock:
            if probe.up and not watched.probe.up:
                log.info("backend %s is up", name)
            elif watched.probe.up and not probe.up:
                log.warning("backend %s is down: %s", name, probe.problem)
            watched.probe = probe
            watched.looked.set()
            if not probe.up:  # its last scrape is not its load now, nor a start for rates when it is back
                watched.recent.clear()
            elif probe.metrics is not None:
                watched.history.append(figures(watched.recent[0] if watched.recent else None, probe.metrics))
                watched.recent.append(probe.metrics)

    def mark_down(self, name: str, why: str) -> None:
        """A request found the backend unreachable: out of routing until a look finds it back."""
        with self._lock:
            watched = self._watched[name]
            if watched.probe.up:
                log.warning("backend %s is down: %s", name, why)
            watched.probe = replace(watched.probe, up=False, problem=f"unreachable: {why}")
            watched.recent.clear()

    def started(self, name: str) -> None:
        with self._lock:
            self._watched[name].in_flight += 1

    def ended(self, name: str) -> None:
        with self._lock:
            self._watched[name].in_flight -= 1

    def is_up(self, name: str) -> bool:
        with self._lock:
            return self._watched[name].probe.up

    def load(self, name: str) -> tuple[float, float]:
        """(requests on it, KV usage): running + waiting from its latest metrics, or the replies
        this app has on it if more (they count before its next scrape shows them)."""
        with self._lock:
            watched = self._watched[name]
            last = watched.recent[-1] if watched.recent else None
            queued = (last.running or 0) + (last.waiting or 0) if last is not None else 0
            return max(queued, watched.in_flight), (last.kv_usage or 0.0) if last is not None else 0.0

    def statuses(self) -> list[BackendStatus]:
        with self._lock:
            return [self._status(w) for w in self._watched.values()]

    def _status(self, watched: _Watched) -> BackendStatus:
        endpoint, probe = watched.endpoint, watched.probe
        last = watched.recent[-1] if watched.recent else None
        return BackendStatus(name=endpoint.name, url=endpoint.url, up=probe.up, problem=probe.problem,
                             model=probe.model, max_model_len=probe.max_model_len,
                             flavor=last.flavor if last is not None else "unknown",
                             in_flight=watched.in_flight, history=tuple(watched.history),
                             missing=dict(last.missing) if last is not None else {})

    def block_map(self, name: str) -> tuple[BlockMap, EngineInfo] | None:
        """The backend's latest block map (each endpoint fetches its own at most once per
        interval, however many ask); None where it shows none."""
        watched = self._watched.get(name)
        if watched is None or not self.is_up(name):
            return None
        try:
            return watched.endpoint.block_map()
        except Exception as error:  # the endpoint gives every caller of that interval the same error
            log.warning("reading %s's block map failed: %s", name, error)
            return None
