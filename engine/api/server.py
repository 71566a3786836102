"""The OpenAI-compatible API over one engine client, as FastAPI routes: what `python -m engine.serve`
serves alone and what the chat app serves next to its pages.

    /v1/chat/completions  /v1/completions  /v1/models  /v1/kv_cache   (API key, when one is set)
    /health  /metrics  /tokenize  /detokenize                         (open, as on vLLM's server)

Every error answers in OpenAI's shape (engine/api/errors.py). A body larger than MAX_BODY_BYTES
is refused with 413 before the routes see any of it, and no text is tokenized on the event loop
(engine/api/tokenization.py, engine/runtime/process_client.py).
"""
from __future__ import annotations

import asyncio
import copy
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api.access import bearer_key_check
from engine.api.completions import Completions
from engine.api.errors import APIError, install_error_handlers
from engine.api.kv_cache import kv_cache_json
from engine.api.metrics import CONTENT_TYPE, EngineMetrics
from engine.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.api.tokenization import Tokenization
from engine.runtime.streaming_client import StreamingClient

MAX_BODY_BYTES = 8 * 1024 * 1024  # far above any prompt the engine can hold, far below harm
API_PATHS = ("/v1/", "/tokenize", "/detokenize")  # the body limit's; the app's pages keep Gradio's


def add_openai_api(app: FastAPI, client: StreamingClient, model_name: str | None = None,
                   api_key: str | None = None) -> EngineMetrics:
    """Add the API's routes, error handlers and body limit to `app`. `api_key`: required as a
    Bearer token on /v1/*; None leaves them open. Returns the metrics (registered on the client)."""
    info = client.info()
    model_name = model_name or info.model
    tokenizer = copy.deepcopy(client.tokenizer)  # the API's own: a fast tokenizer is not thread-safe
    completions = Completions(client, tokenizer, model_name)
    tokenization = Tokenization(client.tokenizer, info.max_model_len)  # copied into a process of its own
    app.router.add_event_handler("shutdown", tokenization.close)
    metrics = EngineMetrics(client, model_name)
    created = int(time.time())
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_key_check(api_key))])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await completions.chat(body, request)

    @v1.post("/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        return await completions.text(body, request)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pagedchat", "root": info.model,
                                            "max_model_len": info.max_model_len}]}

    @v1.get("/kv_cache")
    async def kv_cache() -> dict:
        return kv_cache_json(info, client.stats(), await asyncio.to_thread(client.block_map))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if client.closed:
            raise APIError(503, "The engine loop is not running.", "service_unavailable", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(body)

    return metrics


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's shape. The body is
    read here, whole, before the app sees any of it (the routes read it whole anyway), so a body
    sent chunked is refused as surely as one whose Content-Length says it is too large. An
    exception raised from inside the app's `receive` would not do: FastAPI turns any failure
    while reading a body into 400. (Starlette's own RequestBodyLimitMiddleware answers a declared
    length in plain text, not in OpenAI's shape.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PATHS):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnects, as the app would see them
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than {self.max_bytes} bytes.", code="request_too_large")
        await error.response()(scope, receive, send)
