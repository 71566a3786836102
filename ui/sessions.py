"""Which browser sessions are still connected, so a reply stops the moment its reader leaves.

Gradio sends every event's output to a browser session over one server-sent-event stream
(GET `…/queue/data?session_hash=…`). When that connection drops (a closed tab, a lost network),
Gradio only marks the session's jobs dead, and a streaming handler learns of it at its next
yield, which for a reply still waiting for its first token can be many seconds away, all that time
holding the request's KV blocks. `SessionWatch` is ASGI middleware that sees the stream's
disconnect as it happens and sets the session's event in `Sessions`; `until_gone` ends a
handler's stream of views the moment that event is set, cancelling the view being produced.
It also ends quietly a stream Gradio has no more messages for (see `SessionWatch`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

EVENT_STREAM_PATH = "/queue/data"  # Gradio's per-session event stream (after its API prefix)


@dataclass
class _Watched:
    """One session's event, and how many hold it: handlers that asked, and its event stream."""
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    holders: int = 0


class Sessions:
    """Browser sessions by Gradio's session hash: an event set when the session's event stream
    disconnects. Lives on the event loop's thread (the middleware and async handlers use it).
    A session is kept only while a handler or its event stream holds it: a call with no stream
    of its own (Gradio's REST API, `/gradio_api/call/…`) leaves nothing behind."""

    def __init__(self) -> None:
        self._watched: dict[str, _Watched] = {}

    def __len__(self) -> int:
        """How many sessions are held now."""
        return len(self._watched)

    @contextmanager
    def watch(self, session_hash: str) -> Iterator[asyncio.Event]:
        """The session's event, set once its browser has disconnected, held for the `with`
        block. A handler may ask before the browser has opened its event stream (it opens it
        just after submitting the event)."""
        watched = self._hold(session_hash)
        try:
            yield watched.gone
        finally:
            self._release(session_hash, watched)

    def _hold(self, session_hash: str) -> _Watched:
        watched = self._watched.get(session_hash)
        # A session that disconnected and came back (or asks again) gets a fresh event; whoever
        # held the old one keeps it, set.
        if watched is None or watched.gone.is_set():
            watched = self._watched[session_hash] = _Watched()
        watched.holders += 1
        return watched

    def _release(self, session_hash: str, watched: _Watched) -> None:
        watched.holders -= 1
        if watched.holders == 0 and self._watched.get(session_hash) is watched:
            del self._watched[session_hash]


class SessionWatch:
    """ASGI middleware: tells `sessions` when a session's event stream disconnects.
    `server.add_middleware(SessionWatch, sessions=sessions)` on the app Gradio is mounted in."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_hash = _event_stream_session(scope)
        if session_hash is None:
            await self.app(scope, receive, send)
            return
        watched = self.sessions._hold(session_hash)

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                watched.gone.set()  # at once: the response may take a while to notice
            return message

        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except RuntimeError as error:
            # Gradio (6.31, routes.sse_stream) raises 404 inside a stream already under way when
            # the session's queue was cleaned meanwhile (its page navigated away, as signing in
            # does, while an event of it was ending): the stream has nothing more to send. Starlette
            # can only re-raise it ("response already started"), and uvicorn logs a traceback.
            gone = isinstance(error.__cause__, HTTPException) and error.__cause__.status_code == 404
            if not (started and gone):
                raise
            log.debug("session %s: its event stream ended by Gradio's 404 after its queue was cleaned", session_hash)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.sessions._release(session_hash, watched)


def _event_stream_session(scope: Scope) -> str | None:
    if scope["type"] != "http" or scope.get("method") != "GET" or not scope["path"].endswith(EVENT_STREAM_PATH):
        return None
    hashes = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash")
    return hashes[0] if hashes else None


async def until_gone(items: AsyncIterator, gone: asyncio.Event | None) -> AsyncIterator:
    """`items` until they end or `gone` is set; then the item being produced is cancelled (its
    generator's cleanup runs: the engine request is aborted) and this ends. Cancelling this
    cancels that item too."""
    if gone is None:
        async for item in items:
            yield item
        return
    left = asyncio.ensure_future(gone.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            try:
                await asyncio.wait({step, left}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not step.done():  # the session is gone, or this was cancelled: stop the producer
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)  # its cleanup (abort, save) runs
            if step.cancelled():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        left.cancel()
