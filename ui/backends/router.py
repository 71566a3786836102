"""Which backend writes a reply. The rule, applied in `order`:

1. A conversation stays on the backend that wrote its previous reply: its KV blocks are there,
   so the next turn's prompt is mostly a prefix-cache hit.
2. A new conversation goes to the backend that last served its system prompt (a preset is
   cached there for every user; a user's own prompt for that user), unless that backend has
   more than MAX_IMBALANCE requests more than the least loaded one: a cache hit does not pay
   for a long queue.
3. Otherwise the least loaded backend by its own metrics: fewest running + waiting requests,
   then lowest KV-cache usage.

Only backends the monitor finds up are candidates. A backend that cannot be reached or is full
when the reply starts is skipped for the next one in that order; only when none takes it does
the chat hear that no backend could.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator

from engine import BlockMap, Delta, EngineBusyError, EngineInfo, SamplingParams
from ui.backends.backend import BackendError, Deltas, Reply
from ui.backends.figures import BackendStatus
from ui.backends.monitor import Monitor

MAX_IMBALANCE = 4
MAX_PREFIXES = 4096  # system prompts remembered, least recently used dropped first


class Router:
    """The ChatBackend over one or more endpoints (a single in-process engine included)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._endpoints = {e.name: e for e in monitor.endpoints}
        self._prefix_owner: OrderedDict[str, str] = OrderedDict()

    @property
    def names(self) -> list[str]:
        return list(self._endpoints)

    def order(self, previous: str | None = None, prefix: str | None = None) -> list[str]:
        """The backends that are up, in the order the rule above tries them."""
        up = [name for name in self._endpoints if self.monitor.is_up(name)]
        loads = {name: self.monitor.load(name) for name in up}
        ranked = sorted(up, key=lambda name: (*loads[name], name))
        first = None
        if previous in loads:
            first = previous
        elif prefix is not None and (owner := self._prefix_owner.get(prefix)) in loads:
            if loads[owner][0] <= loads[ranked[0]][0] + MAX_IMBALANCE:
                first = owner
        return ([first] if first else []) + [name for name in ranked if name != first]

    async def start(self, messages: list[dict], params: SamplingParams, *, request_id: str,
                    user: str | None = None, num_shared_messages: int = 0, previous: str | None = None) -> Reply:
        prefix = prefix_key(messages, user, num_shared_messages)
        order = self.order(previous, prefix)
        if not order:
            raise BackendError("no backend is reachable right now: " + self._problems())
        failures = []
        for name in order:
            endpoint = self._endpoints[name]
            # Counted from before the request is sent: replies starting at the same moment must
            # see each other's load, or they would all pick the same backend.
            self.monitor.started(name)
            try:
                deltas = await endpoint.start(messages, params, request_id=request_id, user=user,
                                              num_shared_messages=num_shared_messages)
            except (BackendError, EngineBusyError) as error:
                self.monitor.ended(name)
                failures.append(error)
                continue
            except BaseException:
                self.monitor.ended(name)
                raise
            if prefix is not None:
                self._prefix_owner[prefix] = name
                self._prefix_owner.move_to_end(prefix)
                while len(self._prefix_owner) > MAX_PREFIXES:
                    self._prefix_owner.popitem(last=False)
            return Reply(_Counted(deltas, self.monitor, name), backend=name if endpoint.url is not None else None)
        if all(isinstance(error, EngineBusyError) for error in failures):
            raise failures[0] if len(failures) == 1 else EngineBusyError("every backend is full")
        raise BackendError("; ".join(str(error) for error in failures))

    def statuses(self) -> list[BackendStatus]:
        return self.monitor.statuses()

    def close(self) -> None:
        self.monitor.close()

    def block_map(self, name: str) -> tuple[BlockMap, EngineInfo] | None:
        return self.monitor.block_map(name)

    def _problems(self) -> str:
        return "; ".join(f"{s.name}: {s.problem or 'down'}" for s in self.monitor.statuses())


def prefix_key(messages: list[dict], user: str | None, num_shared_messages: int) -> str | None:
    """What identifies a conversation's cacheable start: its preset messages (the same blocks for
    every user), or its own system prompt with its user (salted to them); None without either."""
    if num_shared_messages:
        start, owner = messages[:num_shared_messages], None
    elif messages and messages[0].get("role") == "system":
        start, owner = messages[:1], user
    else:
        return None
    return hashlib.sha256(json.dumps([owner, start], sort_keys=True).encode()).hexdigest()


class _Counted:
    """A reply's deltas, counted in its backend's in-flight replies until it ends or closes."""

    def __init__(self, deltas: Deltas, monitor: Monitor, name: str) -> None:
        self._deltas = deltas
        self._monitor = monitor
        self._name = name
        self._open = True  # counted by the router before it sent the request

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._monitor.ended(self._name)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for delta in self._deltas:
                if delta.finish_reason is not None:
                    self._end()
                yield delta
        finally:
            self._end()

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()
        finally:
            self._end()
