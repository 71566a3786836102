"""An OpenAI-compatible server as a router endpoint: vLLM, SGLang, llama.cpp's llama-server or
PagedChat's `python -m engine.serve`. Replies stream from `/v1/chat/completions`; closing the
stream is how a reply is stopped (each of these servers aborts a request whose client went away).
The monitor reads `/health`, `/v1/models` and `/metrics`, and `/v1/kv_cache` where it exists.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import ssl
import time
from functools import cache
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httpx

from engine import (BlockMap, Delta, EngineBusyError, EngineInfo, SamplingParams, Usage,
                    block_map_from_kv_cache_json)
from ui.backends.backend import BackendError, Probe
from ui.backends.block_map_cache import BlockMapCache
from ui.backends.metrics_reader import MetricsReadError, read_metrics

CONNECT_TIMEOUT_S = 3.0
PROBE_TIMEOUT_S = 3.0
# Between two streamed chunks. Long: a busy server may queue a request for minutes before its first token.
READ_TIMEOUT_S = 600.0
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# Keys the salt a user's chats are cached under on a remote server (`users_salt`). This process's
# own: after a restart a user's blocks there are no longer hit, which costs one prompt's compute.
_SALT_KEY = secrets.token_bytes(32)


@cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every request to every backend: httpx otherwise builds one per client,
    reading the whole CA bundle (~90 ms of CPU on a 2-core EPYC), and the monitor opens a client
    per backend every second."""
    return httpx.create_ssl_context()


class RemoteEndpoint:
    def __init__(self, url: str, api_key: str | None = None,
                 on_unreachable: Callable[[str, str], None] | None = None, map_interval_s: float = 1.0) -> None:
        """`url`: the server's base URL, with or without the trailing /v1. `on_unreachable(name,
        why)` is told at once when a request finds the server gone (the monitor takes it out).
        `map_interval_s`: how often its block map is fetched at most, however many ask."""
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"a backend URL must look like http://host:port, got {url!r}")
        path = parts.path.rstrip("/").removesuffix("/v1")
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self.name = parts.netloc + path
        self.api_key = api_key
        self.on_unreachable = on_unreachable
        self.model: str | None = None          # the first model /v1/models lists
        self.max_model_len: int | None = None
        self.has_kv_cache = True               # until /v1/kv_cache answers 404
        self.block_map_cache = BlockMapCache(self._fetch_block_map, map_interval_s)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ---- replies ------------------------------------------------------------------------------
    async def start(self, messages: list[dict], params: SamplingParams, *, request_id: str,
                    user: str | None, num_shared_messages: int) -> _RemoteStream:
        client = httpx.AsyncClient(base_url=self.url, headers=self._headers(), verify=tls_context(),
                                   timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        try:
            if self.model is None:
                self._read_models((await client.get("/v1/models")).raise_for_status().json())
            body = chat_body(self.model, messages, params, user, num_shared_messages)
            started = time.perf_counter()
            response = await client.send(client.build_request("POST", "/v1/chat/completions", json=body),
                                         stream=True)
        except (httpx.TransportError, httpx.HTTPStatusError, ValueError, KeyError) as error:
            await client.aclose()
            why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if self.on_unreachable is not None:
                self.on_unreachable(self.name, why)
            raise BackendError(f"{self.name} could not be reached ({why})") from None
        if response.status_code != 200:
            message = error_message(await response.aread(), response.status_code)
            await response.aclose()
            await client.aclose()
            if response.status_code == 400:
                raise ValueError(message)  # the prompt: too long for the model, most often
            if response.status_code in (429, 503):
                raise EngineBusyError(f"{self.name} is busy: {message}")
            raise BackendError(f"{self.name} answered {response.status_code}: {message}")
        return _RemoteStream(self, client, response, request_id, started)

    # ---- what the monitor reads -----------------------------------------------------------------
    def probe(self) -> Probe:
        try:
            with httpx.Client(base_url=self.url, headers=self._headers(), verify=tls_context(),
                              timeout=PROBE_TIMEOUT_S) as client:
                health = client.get("/health")
                if health.status_code != 200:
                    return Probe(up=False, problem=f"/health answered {health.status_code}", model=self.model)
                models = client.get("/v1/models")
                if models.status_code != 200:
                    return Probe(up=False, problem=f"/v1/models answered {models.status_code}: "
                                                   f"{error_message(models.content, models.status_code)}")
                self._read_models(models.json())
                metrics, problem = None, None
                response = client.get("/metrics")
                if response.status_code == 200:
                    try:
                        metrics = read_metrics(response.text, time.time())
                    except MetricsReadError as error:
                        problem = f"its /metrics could not be read: {error}"
                else:
                    problem = (f"no metrics: /metrics answered {response.status_code} (llama-server needs "
                               "--metrics; vLLM and SGLang serve it by default, SGLang with --enable-metrics)")
        except (httpx.TransportError, ValueError, KeyError) as error:
            return Probe(up=False, problem=f"unreachable: {type(error).__name__}: {error}", model=self.model)
        return Probe(up=True, problem=problem, model=self.model, max_model_len=self.max_model_len, metrics=metrics)

    def block_map(self) -> tuple[BlockMap, EngineInfo] | None:
        """The server's block map from PagedChat's /v1/kv_cache; None where it has none."""
        return self.block_map_cache.get()

    def _fetch_block_map(self) -> tuple[BlockMap, EngineInfo] | None:
        if not self.has_kv_cache:
            return None
        try:
            response = httpx.get(f"{self.url}/v1/kv_cache", headers=self._headers(), verify=tls_context(),
                                 timeout=PROBE_TIMEOUT_S)
        except httpx.TransportError:
            return None
        if response.status_code == 404:
            self.has_kv_cache = False  # not a PagedChat server
            return None
        if response.status_code != 200:
            return None
        return block_map_from_kv_cache_json(response.json())

    def _read_models(self, body: dict) -> None:
        first = body["data"][0]
        self.model = first["id"]
        # vLLM, SGLang and PagedChat say max_model_len; llama-server gives its per-slot context in `meta`.
        meta = first.get("meta") or {}
        length = first.get("max_model_len") or meta.get("n_ctx") or meta.get("n_ctx_train")
        self.max_model_len = int(length) if length else None


class _RemoteStream:
    """The deltas of one streamed completion. Closing it (before or during iteration) closes the
    HTTP response, which the server takes as an abort."""

    def __init__(self, endpoint: RemoteEndpoint, client: httpx.AsyncClient, response: httpx.Response,
                 request_id: str, started: float) -> None:
        self.endpoint = endpoint
        self._client = client
        self._response = response
        self._request_id = request_id
        self._started = started
        self._iterator: AsyncIterator[Delta] | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._iterator is None:
            self._iterator = self._deltas()
        return self._iterator

    async def aclose(self) -> None:
        if self._iterator is not None:
            await self._iterator.aclose()
        await self._response.aclose()
        await self._client.aclose()

    def _delta(self, text: str = "", **end) -> Delta:
        return Delta(self._request_id, 0, text, (), **end)

    async def _deltas(self) -> AsyncIterator[Delta]:
        first_at = finish = usage = None
        chunks = 0
        try:
            async for line in self._response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments and blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began comes as a chunk (vLLM, ours)
                    yield self._delta(finish_reason="error", error=f"{self.endpoint.name}: "
                                      f"{(chunk['error'] or {}).get('message', chunk['error'])}")
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
                    if text:
                        first_at = first_at or time.perf_counter()
                        chunks += 1
                        yield self._delta(text)
        except (httpx.TransportError, json.JSONDecodeError) as error:
            why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if self.endpoint.on_unreachable is not None and isinstance(error, httpx.TransportError):
                self.endpoint.on_unreachable(self.endpoint.name, why)
            yield self._delta(finish_reason="error", error=f"{self.endpoint.name} stopped answering mid-reply ({why})")
            return
        finally:
            await self._response.aclose()
        if finish is None:
            yield self._delta(finish_reason="error",
                              error=f"{self.endpoint.name} ended the stream without finishing the reply")
            return
        yield self._delta(finish_reason=FINISH_REASONS.get(finish, "stop"),
                          usage=self._usage(usage, first_at, chunks))

    def _usage(self, usage: dict | None, first_at: float | None, chunks: int) -> Usage | None:
        """The server's token counts with our own clock: time to first token as this app saw it."""
        if not usage or "prompt_tokens" not in usage:
            return None  # the reply's numbers then come from our clock alone
        now = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(prompt_tokens=int(usage["prompt_tokens"]), cached_tokens=cached,
                     completion_tokens=int(usage.get("completion_tokens", chunks)),
                     ttft_s=(first_at or now) - self._started, duration_s=now - self._started)


def chat_body(model: str, messages: list[dict], params: SamplingParams, user: str | None,
              num_shared_messages: int) -> dict:
    """The request: OpenAI's fields, vLLM's `top_k` and `cache_salt` (others ignore what they do
    not know), and PagedChat's `num_shared_messages`, which keeps a preset system prompt's blocks
    shared across users while the rest of the chat is salted to its user (`users_salt`)."""
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if user:
        body["cache_salt"] = users_salt(user)
        body["num_shared_messages"] = num_shared_messages
    return body


def users_salt(user: str) -> str:
    """The `cache_salt` a user's chats go by on a remote server: one per user, that only this app
    can make. The server's other API callers may know the user's id (an `hf:` name is public) and
    hold the same key, but cannot name this salt, so they cannot test guesses about the user's
    prompts by what hits its prefix cache. (PagedChat's API also keeps each key's salts apart.)"""
    return hmac.new(_SALT_KEY, user.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def error_message(body: bytes, status: int) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace") or f"HTTP {status}"
