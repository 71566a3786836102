"""The engine core in a process of its own: the same replies as in-process, and a core that dies
(kill -9 mid-stream) ends every open stream with an error, is replaced, and the app, the API and
the stored chats carry on. (The shared client contract runs on both clients in test_client.py.)"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from waiting import wait_for

from engine import LLM, SamplingParams
from engine.runtime.process_client import CoreProcessClient, EngineStartError
from engine.runtime.streaming_client import EngineDeadError

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "Tell me about lighthouses."}]


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    client = CoreProcessClient(tiny_model_dir, num_gpu_blocks=96, num_cpu_blocks=32)
    yield client
    client.close()


def test_the_core_process_writes_what_the_in_process_engine_writes(core, tiny_model_dir):
    prompts = ["Tell me about lighthouses.", "What is paged attention?", "Name three rivers."]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(tiny_model_dir, num_gpu_blocks=96).generate(prompts, greedy)]
    got = ["".join(d.text for d in core.submit(p, greedy)) for p in prompts]
    assert got == expected
    assert core.info().max_model_len > 0 and core.info().num_device_blocks == 96


def test_a_stop_string_found_by_the_frontend_ends_the_reply_and_frees_its_blocks(core, tiny_model_dir):
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    full = "".join(d.text for d in core.submit("Name three rivers.", greedy))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"no stop string to pick from {full!r}"
    deltas = list(core.submit("Name three rivers.", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                                   stop=[stop])))
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop" and text == full[:full.index(stop)]
    assert deltas[-1].usage.completion_tokens < 60
    wait_for(lambda: core.stats().device_blocks_used == 0 and core.stats().num_running == 0,
             "the stopped request's blocks to return")


def test_a_model_the_core_cannot_load_is_refused_with_its_reason(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises((EngineStartError, OSError, ValueError)):
        CoreProcessClient(str(tmp_path))


def test_a_killed_core_ends_every_stream_with_an_error_and_a_new_one_serves(tiny_model_dir):
    client = CoreProcessClient(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=32)
    try:
        endings: dict[int, tuple] = {}
        started = threading.Barrier(4)

        def read(i: int) -> None:
            stream = client.submit(f"Question {i}: say something long.",
                                   SamplingParams(max_tokens=500, ignore_eos=True))
            first = next(stream)
            started.wait(timeout=60)
            last = first
            for last in stream:
                pass
            endings[i] = (last.finish_reason, last.error, time.monotonic())

        readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for reader in readers:
            reader.start()
        started.wait(timeout=60)  # all three are streaming
        pid = client.core_pid
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for reader in readers:
            reader.join(timeout=120)  # a bound on a hang: they end at once (a few ms, measured)
        assert sorted(endings) == [0, 1, 2]
        for reason, error, ended_at in endings.values():
            # Ended by the kill (not by running out of tokens), and only after it.
            assert reason == "error" and "killed (SIGKILL)" in error and ended_at >= killed_at
        # Restarting: closed (nothing is accepted, with the reason) until the new core is up.
        wait_for(lambda: not client.closed, "a new core")
        assert client.restarts == 1 and client.core_pid != pid
        reply = list(client.submit(QUESTION, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
        assert reply[-1].finish_reason == "length" and reply[-1].usage.completion_tokens == 8
        assert client.stats().num_running == 0
    finally:
        client.close()
    with pytest.raises(EngineDeadError):
        client.submit(QUESTION)


def core_children(pid: int) -> list[int]:
    """The server's engine-core processes: its children but the tokenizer's worker, which runs at
    nice 19 (engine/api/tokenization.py)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if nice_of(c) != 19]


def nice_of(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])  # stat's 19th field; the first two (pid, comm) are cut off above


def test_the_api_server_says_503_while_its_core_restarts_then_serves(tiny_model_dir):
    """Through `python -m engine.serve` and the official client: a stream cut by the kill ends
    with an error event, /health answers 503 until the new core is up, then requests succeed."""
    import openai

    from served_app import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", tiny_model_dir, "--port", str(port),
                               "--num-gpu-blocks", "64", "--num-cpu-blocks", "16"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                assert server.poll() is None, server.stderr.read()
                return False

        wait_for(healthy, "the server to come up")
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        stream = api.chat.completions.create(model=api.models.list().data[0].id, messages=QUESTION, stream=True,
                                             max_tokens=400, extra_body={"ignore_eos": True})
        next(iter(stream))
        [core_pid] = core_children(server.pid)
        os.kill(core_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="killed"):
            for _ in stream:
                pass
        statuses = set()
        wait_for(lambda: statuses.add(httpx.get(f"{base}/health", timeout=5).status_code) or 200 in statuses,
                 "the new core")
        assert 503 in statuses
        reply = api.chat.completions.create(model=api.models.list().data[0].id, messages=QUESTION, max_tokens=5)
        assert reply.choices[0].finish_reason in ("stop", "length")
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert re.search(r"^pagedchat:engine_core_restarts_total\{[^}]*\} 1\.0$", metrics, re.MULTILINE)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_app_keeps_every_stored_reply_and_chats_again_after_its_core_dies(tiny_model_dir, tmp_path):
    from gradio_client import Client

    from served_app import serve
    from storage import Store

    client = CoreProcessClient(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=32)
    store = Store(tmp_path / "chat.db")
    server, url = serve(client, store)
    user = f"anon:{uuid.uuid4().hex}"
    try:
        session = Client(url, verbose=False)
        _, conversation, _ = session.predict(user, None, "First question.", "None", "", 0.0, 1.0, 8, api_name="/send")
        assert [m["role"] for m in store.messages(user, conversation)] == ["user", "assistant"]
        first_reply = store.messages(user, conversation)[-1]["content"]

        job = session.submit(user, conversation, "Now a long answer, please.", "None", "", 0.0, 1.0, 500,
                             api_name="/send")
        wait_for(lambda: client.stats().num_running == 1, "the second reply to stream")
        wait_for(lambda: client.stats().total_generated_tokens > 20, "some of it to be written")
        os.kill(client.core_pid, signal.SIGKILL)
        chat, _, _ = job.result(timeout=60)
        shown = chat[-1]["content"]
        shown = shown if isinstance(shown, str) else " ".join(part.get("text", "") for part in shown)
        assert "killed (SIGKILL)" in shown  # the chat says what happened
        rows = store.messages(user, conversation)
        assert rows[1]["content"] == first_reply  # nothing stored before was lost
        assert [m["role"] for m in rows] == ["user", "assistant", "user", "assistant"]  # the cut reply is kept

        # Until the app's monitor has seen the new core (within its probe interval), a message is
        # refused with "try again in a moment" and nothing stored: the user tries again.
        def sent_again():
            chat, again, box = session.predict(user, conversation, "And once more.", "None", "", 0.0, 1.0, 8,
                                               api_name="/send")
            return box != "And once more." and again == conversation  # a refused message stays in the box

        wait_for(sent_again, "the app to chat again")
        assert [m["role"] for m in store.messages(user, conversation)][-2:] == ["user", "assistant"]
        assert len(store.messages(user, conversation)) == 6
        session.close()
    finally:
        server.close()
        client.close()
        store.close()
