"""The OpenAI-compatible server, through the official `openai` client and raw HTTP: a real uvicorn
server on a loopback port over a tiny engine (greedy output compared with the offline `LLM`)."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import httpx
import pytest
from openai import APIStatusError, AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from served_api import running
from served_app import PeakRunning, free_port
from waiting import poll

from engine import LLM, EngineClient, LLMEngine, SamplingParams

SYSTEM = ("You are PagedChat's test assistant. You answer briefly and precisely, and you never mention "
          "that you are a language model. Keep every answer to a single short paragraph, please.")
GREEDY = dict(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def engine_client(tiny_model_dir):
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64), max_waiting=64)
    yield client
    client.close()


@pytest.fixture(scope="module")
def url(engine_client):
    with running(engine_client) as base:
        yield base


@pytest.fixture(scope="module")
def openai(url):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=128)


def idle(client: EngineClient) -> bool:
    """Whether the engine holds no request and no device block, waited for (120 s)."""
    def empty() -> bool:
        stats = client.stats()
        return stats.num_running + stats.num_waiting + stats.num_swapped == 0 and stats.device_blocks_used == 0
    return bool(poll(empty, interval=0.01))


def finish_reasons(client: EngineClient) -> list[str]:
    """The finish reasons of the requests that end from now on, as the client routes them."""
    reasons: list[str] = []
    client.add_listener(lambda delta, now: reasons.append(delta.finish_reason) if delta.finish_reason else None)
    return reasons


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# ---- the official client -------------------------------------------------------------------------
def test_greedy_chat_through_the_api_equals_llm_chat(openai, offline):
    messages = chat("What is a paged KV cache?")
    reply = openai.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    expected = offline.chat(messages, SamplingParams(**GREEDY))[0].outputs[0]
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    usage = reply.usage
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens == len(offline.engine.encode(offline.engine.apply_chat_template(messages)))
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_a_second_chat_with_the_same_system_prompt_reports_cached_tokens(openai):
    first = openai.chat.completions.create(model="tiny", messages=chat("First question, about lighthouses."), **GREEDY)
    second = openai.chat.completions.create(model="tiny", messages=chat("Second question, about rivers."), **GREEDY)
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # the system prompt's full blocks


def test_streaming_chat_gives_the_same_text_and_usage_last(openai):
    messages = chat("Stream me an answer.")
    whole = openai.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(openai.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_async_client_streams_many_at_once(url, engine_client, offline):
    questions = [f"Question {i}: tell me about the number {i * 7}." for i in range(32)]
    expected = [o.outputs[0].text for o in offline.generate(
        [offline.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]

    async def one(client: AsyncOpenAI, question: str) -> str:
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                      stream=True, temperature=0.0, max_tokens=24,
                                                      extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    async def main() -> list[str]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    with PeakRunning(engine_client) as running_at_once:
        replies = asyncio.run(main())
    assert replies == expected and running_at_once.peak >= 8  # each its own, complete; batched together
    assert idle(engine_client)


def test_n_samples_and_seeds(openai):
    messages = chat("Pick a random word.")
    sampled = dict(model="tiny", messages=messages, temperature=1.0, max_tokens=12, n=2, seed=1234,
                   extra_body={"ignore_eos": True})
    first = openai.chat.completions.create(**sampled)
    # The first computed the whole prompt; the next ones copy all but its last token from the
    # cache (the same K/V to ~1e-6, which at temperature 1 on this random model can pick another
    # token late in a reply): seeded samples repeat exactly from the same cache state.
    again = openai.chat.completions.create(**sampled)
    third = openai.chat.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in third.choices] == [c.message.content for c in again.choices]
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    other = openai.chat.completions.create(**{**sampled, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]
    single = openai.chat.completions.create(**{**sampled, "n": 1})
    assert first.usage.completion_tokens == 2 * single.usage.completion_tokens == 24  # every sample's tokens
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once


def test_stop_strings_cut_the_text(openai):
    messages = chat("Say something long.")
    whole = openai.chat.completions.create(model="tiny", messages=messages, temperature=0.0, max_tokens=24,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    stop = whole[8:11]
    cut = openai.chat.completions.create(model="tiny", messages=messages, temperature=0.0, max_tokens=24, stop=[stop],
                                         extra_body={"ignore_eos": True}).choices[0]
    assert cut.message.content == whole[:whole.index(stop)] and cut.finish_reason == "stop"


def test_logprobs_for_chat_and_completions(openai):
    reply = openai.chat.completions.create(model="tiny", messages=chat("Hi"), temperature=0.0, max_tokens=5,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content or \
        reply.choices[0].finish_reason == "stop"
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy takes the top token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    text = openai.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0.0,
                                     logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


def test_text_completions_take_text_token_ids_and_several_prompts(openai, offline):
    prompt = "Once upon a time"
    reply = openai.completions.create(model="tiny", prompt=prompt, **GREEDY)
    expected = offline.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].text
    assert reply.choices[0].text == expected and reply.object == "text_completion"
    ids = offline.engine.encode(prompt)
    assert openai.completions.create(model="tiny", prompt=ids, **GREEDY).choices[0].text == expected
    several = openai.completions.create(model="tiny", prompt=[prompt, "In a hole in the ground"], n=2, **GREEDY)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == expected  # greedy: both samples alike
    streamed = openai.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_models_tokenize_and_detokenize(url, openai, offline):
    [model] = openai.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == 1024
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["tokens"] == offline.engine.encode("Hello there") and tokens["count"] == len(tokens["tokens"])
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello there"}
    templated = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert templated["tokens"] == offline.engine.encode(offline.engine.apply_chat_template(
        [{"role": "user", "content": "Hi"}]))


def test_the_kv_cache_endpoint_describes_every_block(url, engine_client):
    body = httpx.get(f"{url}/v1/kv_cache").json()
    info = engine_client.info()
    assert body["block_size"] == info.block_size and body["device"]["num_blocks"] == info.num_device_blocks
    assert len(body["device"]["states"]) == info.num_device_blocks and set(body["device"]["states"]) <= set("fcu")
    assert sum(run for _, run in body["device"]["owners"]) == info.num_device_blocks
    assert len(body["host"]["states"]) == info.num_host_blocks
    # ... and the engine's whole configuration, as `python -m engine.serve --print-config` prints it
    assert body["config"] == info.config.as_dict() and body["config"]["scheduler"]["num_device_blocks"] == 128


# ---- errors, in OpenAI's shape ---------------------------------------------------------------------
def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_parameters_are_400_naming_the_parameter(url, body, param):
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_nan_and_infinity_are_refused(url):
    for value in ("NaN", "Infinity", "-Infinity"):
        raw = '{"messages": [{"role": "user", "content": "hi"}], "temperature": %s}' % value
        response = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and error_of(response)["param"] == "temperature", (value, response.text)
    assert math.isnan(json.loads('{"t": NaN}')["t"])  # what a Python client could send


def test_garbage_bodies_are_400_and_huge_ones_413(url, engine_client):
    for raw in (b"not json", b"{", b"[1, 2, 3]", b"\xff\xfe\x00", b'{"messages": [{"role": "user"'):
        response = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (raw, response.text)
        error_of(response)
    huge = b'{"messages": [{"role": "user", "content": "' + b"a" * (9 * 1024 * 1024) + b'"}]}'
    response = httpx.post(f"{url}/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "larger than" in error_of(response)["message"]
    assert httpx.get(f"{url}/health").status_code == 200 and idle(engine_client)


def test_a_prompt_longer_than_the_engine_holds_is_400_with_both_numbers(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 3000, "max_tokens": 4})
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "prompt"
    assert "max_model_len=1024" in error["message"] and "the prompt has" in error["message"]


def test_a_refused_prompt_among_several_leaves_none_of_them_running(url, engine_client):
    """The prompts before the refused one were already taken by the engine: they are aborted."""
    body = {"prompt": ["Run for a long time.", "word " * 3000], "max_tokens": 900, "ignore_eos": True}
    reasons = finish_reasons(engine_client)
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    assert idle(engine_client), engine_client.stats()
    assert "length" not in reasons, reasons  # aborted, not left to write its 900 tokens


def test_an_unknown_model_is_404(url):
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "gpt-9", "messages": chat("hi")})
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def test_an_api_key_is_required_when_set(engine_client):
    with running(engine_client, api_key="s3cret") as base:
        body = {"messages": chat("hi"), "max_tokens": 2}
        assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 401
        wrong = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
        with pytest.raises(APIStatusError) as refused:
            OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
        assert refused.value.status_code == 401
        assert OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0).models.list().data[0].id == "tiny"
        assert httpx.get(f"{base}/health").status_code == 200  # health and metrics stay open, as on vLLM


def test_a_full_queue_and_a_dead_engine_are_503_with_retry_after(deep_model_dir):
    busy = EngineClient(LLMEngine(deep_model_dir, num_gpu_blocks=64, max_num_seqs=1), max_waiting=1)
    with running(busy) as base:
        long = dict(prompt="Keep going.", max_tokens=900, ignore_eos=True, temperature=0.0, stream=True)
        with httpx.stream("POST", f"{base}/v1/completions", json=long) as running_one, \
                httpx.stream("POST", f"{base}/v1/completions", json=long) as waiting_one:
            lines = running_one.iter_lines()  # kept: a dropped line iterator closes the connection
            next(lines)
            assert waiting_one.status_code == 200
            full = httpx.post(f"{base}/v1/completions", json={"prompt": "One too many", "max_tokens": 2})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert error_of(full)["code"] == "engine_busy" and "limit 1" in error_of(full)["message"]
        busy.close()
        dead = httpx.post(f"{base}/v1/completions", json={"prompt": "Anyone?", "max_tokens": 2})
        assert dead.status_code == 503 and error_of(dead)["code"] == "engine_dead"
        assert httpx.get(f"{base}/health").status_code == 503


def test_a_client_gone_mid_stream_leaves_nothing_behind(url, engine_client):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    reasons = finish_reasons(engine_client)
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        while engine_client.stats().device_blocks_used == 0 or not next(lines).startswith("data:"):
            pass
    assert idle(engine_client), engine_client.stats()
    assert "abort" in reasons and "length" not in reasons, reasons  # ended by the client's leaving, not by writing its 900 tokens


# ---- metrics -------------------------------------------------------------------------------------------
def test_metrics_parse_and_agree_with_the_engines_stats(url, openai, engine_client):
    assert idle(engine_client)
    openai.chat.completions.create(model="tiny", messages=chat("Count my tokens."), **GREEDY)
    assert idle(engine_client)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    stats = engine_client.stats()

    def value(name: str, suffix: str = "", **labels) -> float:
        """The sample `name` + suffix ("_total" for counters, "_count" for a histogram's count)."""
        family = families[name]
        wanted = name + (suffix or ("_total" if family.type == "counter" else ""))
        samples = [s for s in family.samples if s.name == wanted and s.labels.get("model_name") == "tiny"
                   and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(samples) == 1, (wanted, labels, family.samples)
        return samples[0].value

    assert value("vllm:num_requests_running") == stats.num_running == 0
    assert value("vllm:num_requests_waiting") == stats.num_waiting == 0
    assert value("vllm:kv_cache_usage_perc") == stats.device_blocks_used / stats.device_blocks_total
    assert value("vllm:prefix_cache_queries") == stats.prefix_cache_queries > 0
    assert value("vllm:prefix_cache_hits") == stats.prefix_cache_hits
    assert value("vllm:num_preemptions") == stats.num_preemptions_swap + stats.num_preemptions_recompute
    assert value("pagedchat:blocks_swapped_out") == stats.total_blocks_swapped_out
    assert value("vllm:generation_tokens") >= 16 and value("vllm:prompt_tokens") > 0
    assert value("vllm:request_success", finished_reason="length") >= 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert families[histogram].type == "histogram"
    # One observation of each per finished request (its first sample's), however many samples it had.
    assert value("vllm:time_to_first_token_seconds", "_count") == value("vllm:e2e_request_latency_seconds", "_count")
    assert value("vllm:e2e_request_latency_seconds", "_count") >= 1
    assert value("vllm:inter_token_latency_seconds", "_count") > 0
    for name in ("vllm:inter_token_latency_seconds", "pagedchat:num_requests_swapped",
                 "pagedchat:host_kv_cache_usage_perc", "pagedchat:num_preemptions_swap",
                 "pagedchat:num_preemptions_recompute", "pagedchat:blocks_swapped_in"):
        assert name in families


def test_python_m_engine_serve_runs_the_engine_alone(tiny_model_dir):
    """The real command, as a remote backend runs it; off loopback it wants a key first."""
    refused = subprocess.run([sys.executable, "-m", "engine.serve", "--model", tiny_model_dir, "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--api-key" in refused.stderr
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", tiny_model_dir, "--port", str(port),
                               "--served-model-name", "tiny", "--num-gpu-blocks", "64"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=chat("Hello?"), **GREEDY)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
