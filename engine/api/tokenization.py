"""`/tokenize` and `/detokenize`, in a process of their own. A body may hold 8 MiB of text:
seconds of tokenizing, and a few million token ids to write as JSON. On the server's event loop
that would stall every reply it streams; on a thread of the server's process it still did, by
up to 0.4-0.6 s on a 2-core Intel Xeon (the tokenizer gives the GIL back while it splits the
text, but its Python around that, the ids as a list and their JSON, holds it; at a low priority
the thread held it longer, waiting for a core). So the work runs in a worker process with a
tokenizer copy of its own, at the lowest priority (nice 19: the engine and the streams come
first), one request at a time (vLLM's server also tokenizes these one by one); it sends back the
answer's JSON as bytes, which the server passes on as they are. The worker starts with the
server, at that priority from its first instruction: its start-up (importing the tokenizer's
library, seconds of a core) at the normal priority stalled a streaming chat for 3 s.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from fastapi.responses import Response

from engine.api.errors import bad_request
from engine.api.protocol import DetokenizeRequest, TokenizeRequest
from engine.worker.parent_watch import end_with_parent

_tokenizer = None  # the worker's own, set by _start_worker


class Tokenization:
    """The two endpoints over `tokenizer` (copied into the worker process)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._worker: ProcessPoolExecutor | None = None
        self._starting = threading.Thread(target=self._start, name="api-tokenizer-start", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        """Start the worker from this thread at nice 19 (Linux's priority is a thread's, and a
        process started from a thread inherits it), and wait until it has its tokenizer."""
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        worker = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_start_worker, initargs=(self._tokenizer, os.getpid()))
        try:
            worker.submit(_ready).result()
        except BrokenProcessPool:
            pass  # the next request starts another
        self._worker = worker

    async def tokenize(self, body: TokenizeRequest) -> Response:
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either `prompt` or `messages`", "prompt")
        messages = None
        if body.messages is not None:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            except ValueError as error:
                raise bad_request(str(error), "messages") from None
        return await self._in_worker(_tokenize, body.prompt, messages, body.add_generation_prompt, self.max_model_len)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        return await self._in_worker(_detokenize, body.tokens)

    def close(self) -> None:
        self._starting.join(timeout=60)
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)

    async def _in_worker(self, work, *args) -> Response:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            if self._starting.is_alive() or self._worker is None:
                if not self._starting.is_alive():  # the worker died: start another the same way
                    self._starting = threading.Thread(target=self._start, name="api-tokenizer-start", daemon=True)
                    self._starting.start()
                await loop.run_in_executor(None, self._starting.join)
            try:
                ok, content = await loop.run_in_executor(self._worker, work, *args)
                break
            except BrokenProcessPool:  # the worker died (killed, out of memory): a new one, once
                self._worker = None
                if attempt == 2:
                    raise
        if not ok:
            message, param = content
            raise bad_request(message, param)
        return Response(content, media_type="application/json")


# ---- in the worker process ---------------------------------------------------------------------
def _start_worker(tokenizer, server: int) -> None:
    global _tokenizer
    _tokenizer = tokenizer
    end_with_parent(server)  # a server killed outright cannot stop its pool


def _ready() -> bool:
    return True


def _tokenize(prompt: str | None, messages: list[dict] | None, add_generation_prompt: bool,
              max_model_len: int) -> tuple[bool, bytes]:
    if messages is not None:
        prompt = _tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    tokens = _tokenizer(prompt, add_special_tokens=False).input_ids
    return True, _json({"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len})


def _detokenize(tokens: list[int]) -> tuple[bool, bytes | tuple[str, str]]:
    vocab = len(_tokenizer)
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        return False, (f"token ids must be in [0, {vocab}), got {bad}", "tokens")
    return True, _json({"prompt": _tokenizer.decode(tokens)})


def _json(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
