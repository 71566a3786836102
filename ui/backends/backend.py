"""The one interface the chat page uses to get a reply written, whoever writes it: the
in-process engine (ui/backends/local.py) or OpenAI-compatible servers (ui/backends/remote.py),
chosen per reply by the router (ui/backends/router.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine import BlockMap, Delta, EngineInfo, SamplingParams
from ui.backends.figures import BackendStatus, MetricsSnapshot


class BackendError(RuntimeError):
    """No backend could take the request (all of them down, or one rejected us); says why."""


class Deltas(Protocol):
    """A reply's deltas. `aclose()` ends the request at its backend, even before iteration
    began (closing an unstarted generator would run nothing)."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def aclose(self) -> None: ...


@dataclass
class Reply:
    deltas: Deltas
    backend: str | None = None  # the remote backend writing it; None: the in-process engine


@dataclass(frozen=True)
class Probe:
    """What one look at a backend found (ui/backends/monitor.py takes one per interval)."""
    up: bool
    problem: str | None = None          # why it is down, or what it lacks
    model: str | None = None
    max_model_len: int | None = None
    metrics: MetricsSnapshot | None = None


class Endpoint(Protocol):
    """One engine the router may send a reply to."""
    name: str
    url: str | None  # None: the in-process engine

    async def start(self, messages: list[dict], params: SamplingParams, *, request_id: str,
                    user: str | None, num_shared_messages: int) -> Deltas:
        """Submit; raises ValueError when the engine refuses the prompt (too long), EngineBusyError
        when it is full, BackendError when it cannot be reached."""

    def probe(self) -> Probe:
        """Health, model and metrics now (blocking; called on a monitor thread)."""

    def block_map(self) -> tuple[BlockMap, EngineInfo] | None:
        """Every KV block's state, where the engine shows it (PagedChat engines); blocking, and
        fetched at most once per interval however many ask (ui/backends/block_map_cache.py)."""


class ChatBackend(Protocol):
    """What ui/ sees: replies, and the state of whatever writes them."""

    async def start(self, messages: list[dict], params: SamplingParams, *, request_id: str,
                    user: str | None = None, num_shared_messages: int = 0, previous: str | None = None) -> Reply:
        """Submit a conversation; `previous`: the backend that wrote its last reply."""

    def statuses(self) -> list[BackendStatus]: ...

    def block_map(self, name: str) -> tuple[BlockMap, EngineInfo] | None: ...
