"""`SessionWatch` (ui/sessions.py), the ASGI middleware around Gradio's per-session event stream:
it marks a session gone on its stream's disconnect, and ends quietly a stream Gradio raised 404 in
after it had begun (its session's queue cleaned), where anything else still propagates."""
from __future__ import annotations

import asyncio

import pytest
from starlette.exceptions import HTTPException

from ui.sessions import EVENT_STREAM_PATH, Sessions, SessionWatch


def stream_scope(session_hash: str = "abc") -> dict:
    return {"type": "http", "method": "GET", "path": "/gradio_api" + EVENT_STREAM_PATH,
            "query_string": f"session_hash={session_hash}".encode()}


def run(app, scope: dict, incoming: list[dict] | None = None) -> list[dict]:
    """`app` called as a server calls it; what it sent."""
    sent: list[dict] = []
    incoming = list(incoming or [{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def stream_then(error: BaseException | None):
    """A stand-in for Gradio's stream route: starts its response, sends a message, then raises."""
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        if error is not None:
            raise error

    return app


def starlette_reraise(status: int) -> RuntimeError:
    """What Starlette raises for an HTTPException once the response has started."""
    try:
        raise RuntimeError("Caught handled exception, but response already started.") from HTTPException(status)
    except RuntimeError as error:
        return error


def test_a_404_after_the_stream_began_ends_it_quietly():
    sessions = Sessions()
    sent = run(SessionWatch(stream_then(starlette_reraise(404)), sessions=sessions), stream_scope())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(sessions) == 0  # released


@pytest.mark.parametrize("error", [starlette_reraise(500), RuntimeError("a bug"), ValueError("a bug")])
def test_other_errors_in_a_stream_propagate(error):
    with pytest.raises(type(error)):
        run(SessionWatch(stream_then(error), sessions=Sessions()), stream_scope())


def test_a_404_before_the_stream_began_propagates():
    async def app(scope, receive, send) -> None:
        raise starlette_reraise(404)

    with pytest.raises(RuntimeError):
        run(SessionWatch(app, sessions=Sessions()), stream_scope())


def test_other_routes_pass_through_untouched():
    error = starlette_reraise(404)
    with pytest.raises(RuntimeError):
        run(SessionWatch(stream_then(error), sessions=Sessions()), {**stream_scope(), "path": "/gradio_api/info"})
