"""A browser's side of one Gradio event, over plain HTTP: what Gradio's JavaScript client does
(POST `queue/join`, then read the session's server-sent events from `queue/data`), so that a
test or a benchmark can leave mid-reply by closing the connection, as a closed tab does.
(gradio_client can cancel an event, which is the Stop button, but not vanish like a browser.)"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


def fn_index(url: str, api_name: str) -> int:
    """The id Gradio's queue knows the endpoint `api_name` by."""
    config = httpx.get(f"{url}config", timeout=30).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == api_name)


@dataclass
class BrowserEvent:
    """One event submitted by a browser session, with its event stream open."""
    http: httpx.Client
    stream: httpx.Response

    def messages(self) -> Iterator[dict]:
        """The event stream's messages as they arrive (`msg`: process_starts, process_generating,
        process_completed, ...)."""
        for line in self.stream.iter_lines():
            if line.startswith("data:"):
                yield json.loads(line[len("data:"):])

    def leave(self) -> None:
        """Close the connection, as a closed tab or a lost network does."""
        self.stream.close()
        self.http.close()


def submit(url: str, fn: int, data: list, timeout: float = 60.0) -> BrowserEvent:
    """Submit `data` to the endpoint with id `fn` from a fresh browser session and open the
    session's event stream."""
    session_hash = uuid.uuid4().hex[:11]
    http = httpx.Client(base_url=url, timeout=timeout)
    try:
        joined = http.post("gradio_api/queue/join", json={"data": data, "fn_index": fn, "session_hash": session_hash,
                                                          "event_data": None, "trigger_id": None})
        joined.raise_for_status()
        stream = http.send(http.build_request("GET", "gradio_api/queue/data", params={"session_hash": session_hash}),
                           stream=True)
    except BaseException:
        http.close()
        raise
    return BrowserEvent(http, stream)
