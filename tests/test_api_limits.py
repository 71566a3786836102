"""What one API request can do to everyone else, through a real `python -m engine.serve` (the
engine core in its own process, as served): heavy text work never stalls other users' streams,
a prompt that cannot fit is refused before it is tokenized, and a body over the limit gets 413 in
OpenAI's shape however it is sent."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from engine_servers import EngineServer
from served_app import Served
from waiting import wait_for

from engine import EngineClient, LLMEngine
from engine.api.server import MAX_BODY_BYTES
from engine.serve import build_server

MAX_MODEL_LEN = 1024  # the tiny model's (tests/conftest.py)


@pytest.fixture(scope="module")
def server(deep_model_dir, tmp_path_factory):
    """The deep tiny model: slow enough per token that one reply streams for many seconds."""
    served = EngineServer(deep_model_dir, tmp_path_factory.mktemp("engine-logs")).start(timeout=180)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def in_process(tiny_model_dir):
    """The same API over an engine on a thread of the server's process (--engine-in-process): its URL."""
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64))
    served = Served(build_server(client, "tiny"))
    yield served.url.rstrip("/")
    served.close()
    client.close()


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class StreamClock:
    """A streamed chat reply read on a thread of its own, noting when each chunk arrived."""

    def __init__(self, url: str) -> None:
        self.arrivals: list[float] = []
        self.finished = threading.Event()
        self._stop = threading.Event()
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 900,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data:"):
                        self.arrivals.append(time.monotonic())
                    if self._stop.is_set():
                        return
        finally:
            self.finished.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


# ---- heavy text work stays off the event loop ---------------------------------------------------------
def test_a_large_tokenize_does_not_stall_another_users_stream(server):
    """While one user's /tokenize of 2 MB runs, another user's reply goes on streaming: chunks
    arrive between the tokenize's start and its answer (on the event loop, or holding the
    server's GIL, the whole tokenize would be one gap with none inside it)."""
    stream = StreamClock(server.url)
    try:
        wait_for(lambda: len(stream.arrivals) >= 5, "the stream's first chunks", interval=0.01)
        prompt = "Paged attention keeps every sequence's keys in fixed-size blocks. " * 30_000  # 2 MB
        start = time.monotonic()
        answer = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=300)
        end = time.monotonic()
        assert answer.status_code == 200, answer.text[:500]
        assert answer.json()["count"] > 100_000
        # (The tokenizer's worker runs at nice 19, so under this stream a tokenize may take longer than
        # the whole reply: chunks arriving until the stream's end count as not stalled.)
        wait_for(lambda: stream.arrivals[-1] > end or stream.finished.is_set(), "a chunk after the tokenize",
                 interval=0.01)
        during = [t for t in stream.arrivals if start < t < end]
        assert len(during) >= 3, f"{len(during)} chunks arrived while a tokenize ran for {end - start:.2f} s"
    finally:
        stream.close()


@pytest.mark.parametrize("engine", ["process", "in-process"])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(request, engine, tokenizer):
    url = request.getfixturevalue("server").url if engine == "process" else request.getfixturevalue("in_process")
    prompt = "word " * 400_000  # 2 MB: tokenizing it takes seconds
    start = time.monotonic()
    tokenized = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=300)
    took_tokenizing = time.monotonic() - start
    assert tokenized.status_code == 200 and tokenized.json()["count"] > MAX_MODEL_LEN
    longest = max(len(token) for token in tokenizer.get_vocab())
    for path, body, param in (("/v1/completions", {"prompt": prompt, "max_tokens": 2}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                        "max_tokens": 2}, "messages")):
        start = time.monotonic()
        refused = httpx.post(f"{url}{path}", json=body, timeout=300)
        took = time.monotonic() - start
        error = error_of(refused)
        assert refused.status_code == 400 and error["param"] == param, refused.text
        assert "characters" in error["message"] and f"max_model_len={MAX_MODEL_LEN}" in error["message"], error
        assert f"{MAX_MODEL_LEN * longest}" in error["message"], error
        assert took < took_tokenizing / 4, f"{path} refused in {took:.2f} s; tokenizing took {took_tokenizing:.2f} s"
    fits = httpx.post(f"{url}/v1/completions", json={"prompt": "A short one.", "max_tokens": 2}, timeout=60)
    assert fits.status_code == 200, fits.text


def test_tokenize_errors_from_its_thread_are_400_naming_the_parameter(in_process):
    bad_id = httpx.post(f"{in_process}/detokenize", json={"tokens": [1, -1]}, timeout=60)
    assert bad_id.status_code == 400 and error_of(bad_id)["param"] == "tokens" and "got -1" in bad_id.text
    neither = httpx.post(f"{in_process}/tokenize", json={}, timeout=60)
    assert neither.status_code == 400 and error_of(neither)["param"] == "prompt"
    both = httpx.post(f"{in_process}/tokenize", json={"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]})
    assert both.status_code == 400 and error_of(both)["param"] == "prompt"


# ---- the body limit -----------------------------------------------------------------------------------
def chat_body(padding: int) -> bytes:
    """A small chat request whose `user` field (an id the server ignores) makes the body `padding` bytes longer."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": ""})
    return body[:-2].encode() + b"a" * padding + b'"}'


def in_chunks(data: bytes, size: int = 256 * 1024):
    """A generator body: httpx sends it chunked, with no Content-Length."""
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_however_it_is_sent(server, chunked):
    over = chat_body(MAX_BODY_BYTES)
    under = chat_body(MAX_BODY_BYTES - len(chat_body(0)) - 1)
    assert len(over) > MAX_BODY_BYTES >= len(under)
    headers = {"content-type": "application/json"}
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = httpx.post(f"{server.url}{path}", content=in_chunks(over) if chunked else over, headers=headers,
                             timeout=120)
        assert refused.status_code == 413, (path, refused.status_code, refused.text[:300])
        error = error_of(refused)
        assert f"larger than {MAX_BODY_BYTES} bytes" in error["message"] and error["code"] == "request_too_large", error
    taken = httpx.post(f"{server.url}/v1/chat/completions", content=in_chunks(under) if chunked else under,
                       headers=headers, timeout=120)
    assert taken.status_code == 200, taken.text[:300]
    assert taken.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(f"{server.url}/health").status_code == 200
