"""A reverse proxy on a loopback port, as nginx or Caddy run in front of an app bound to
127.0.0.1: every request forwarded to the app, streamed both ways (Gradio's event streams
included), with the headers such a proxy adds — X-Forwarded-For with the address it saw
appended (nginx's `$proxy_add_x_forwarded_for`), X-Real-IP, X-Forwarded-Host and -Proto."""
from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from served_app import Served
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

# Headers that describe one connection, not the message (RFC 9110 7.6.1): never forwarded.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host"}
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ReverseProxy:
    """Forwards http://127.0.0.1:<port>/… to `upstream` (a base URL) until `close()`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._http: httpx.AsyncClient | None = None
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=METHODS)], lifespan=self._lifespan)
        # The proxy reads its own peer as nginx reads $remote_addr: never from a header.
        self._served = Served(app, proxy_headers=False)
        self.port, self.url = self._served.port, self._served.url

    @asynccontextmanager
    async def _lifespan(self, app):
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as http:
            self._http = http
            yield

    async def _forward(self, request: Request) -> StreamingResponse:
        peer = request.client.host if request.client else ""
        headers = [(name, value) for name, value in request.headers.items() if name not in HOP_BY_HOP]
        earlier = request.headers.get("x-forwarded-for")
        headers += [("x-forwarded-for", f"{earlier}, {peer}" if earlier else peer), ("x-real-ip", peer),
                    ("x-forwarded-host", request.headers.get("host", "")), ("x-forwarded-proto", "http")]
        path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        query = request.url.query
        upstream = self._http.build_request(request.method, f"{self.upstream}{path}{'?' + query if query else ''}",
                                            headers=headers, content=request.stream())
        response = await self._http.send(upstream, stream=True)
        forwarded = StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                      background=BackgroundTask(response.aclose))
        forwarded.raw_headers = [(name.encode("latin-1"), value.encode("latin-1"))
                                 for name, value in response.headers.multi_items() if name.lower() not in HOP_BY_HOP]
        return forwarded

    def close(self) -> None:
        self._served.close()


def from_address(address: str, **options) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any of 127.0.0.0/8 on Linux), so
    that the proxy sees, and forwards, a client address of the test's choosing."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), **options)
