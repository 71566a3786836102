"""The engine client: many concurrent callers, streaming, abort, disconnects, snapshots."""
import asyncio
import gc
import threading
import time

import pytest
from waiting import DEADLINE_S, wait_for

from engine import SamplingParams
from engine.runtime.thread_client import EngineClient
from engine.runtime.process_client import CoreProcessClient
from engine.runtime.llm_engine import LLMEngine
from engine.core.scheduler import PromptTooLongError

QUESTIONS = [f"Question {i}: tell me something about the number {i * 7}." for i in range(8)]


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, tiny_model_dir):
    """Both clients keep one contract: the engine on a thread here, or its core in a process of its own."""
    options = dict(num_gpu_blocks=96, num_cpu_blocks=64, max_num_seqs=16)
    if request.param == "thread":
        client = EngineClient(LLMEngine(tiny_model_dir, **options))
    else:
        client = CoreProcessClient(tiny_model_dir, **options)
    yield client
    client.close()


def wait_until_idle(client, generated: int = 0):
    """Until a stats snapshot reads idle, taken once the engine had generated `generated` tokens
    in all (a snapshot from before a request was admitted also reads idle, and the thread client
    routes a step's deltas before it publishes that step's stats)."""
    def idle():
        stats = client.stats()
        return stats if stats.total_generated_tokens >= generated and stats.device_blocks_used == 0 \
            and stats.num_running + stats.num_waiting + stats.num_swapped == 0 else None
    return wait_for(idle, lambda: f"the engine idle; still busy: {client.stats()}")


def test_concurrent_callers_each_get_their_own_complete_reply(client, tiny_model_dir):
    from engine import LLM
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(tiny_model_dir, num_gpu_blocks=256).generate(QUESTIONS, params)]
    results: dict[int, list] = {}

    def chat(i):
        results[i] = list(client.submit(QUESTIONS[i], params))

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    for i, deltas in results.items():
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 40
        assert "".join(d.text for d in deltas) == expected[i]
        assert sum(len(d.token_ids) for d in deltas) == 40
    assert len(results) == len(QUESTIONS)
    assert client.stats().num_running == 0


def test_a_caller_that_stops_reading_frees_its_blocks(client):
    stream = client.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    first = [next(stream), next(stream)]
    assert all(d.finish_reason is None for d in first)
    assert client.stats().device_blocks_used > 0
    stream.close()  # what Python does when a consumer breaks out or disconnects
    wait_until_idle(client)


def test_abort_ends_the_stream_and_frees_its_blocks(client):
    stream = client.submit(QUESTIONS[1], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
                           request_id="to-abort")
    next(stream)
    client.abort("to-abort")
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    wait_until_idle(client)


def test_bad_prompts_raise_at_submit_and_others_keep_streaming(client):
    good = client.submit(QUESTIONS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    limit = client.info().max_model_len
    with pytest.raises(PromptTooLongError, match=f"max_model_len={limit}"):
        client.submit(list(range(5, 5 + limit + 1)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        client.submit("", SamplingParams(max_tokens=4))
    deltas = list(good)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 30


def test_usage_and_snapshots_while_streaming(client):
    system = "You are a helpful assistant that answers in one short sentence. " * 4
    list(client.submit(system + "Hi!", SamplingParams(temperature=0, max_tokens=4)))
    stream = client.submit(system + "Hello!", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    next(stream)
    block_map = client.block_map()
    used = [b for b in block_map.device if b.state.value == "used"]
    assert used and all(b.owners for b in used)
    assert len(block_map.device) == client.info().num_device_blocks
    final = list(stream)[-1]
    assert final.usage.cached_tokens >= 16 and final.usage.prompt_tokens > final.usage.cached_tokens
    assert 0 < final.usage.ttft_s <= final.usage.duration_s


def test_chat_messages_and_n_samples_through_the_client(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    deltas = list(client.submit(messages, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)))
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1]
    wait_until_idle(client)


def test_info_describes_the_engine(client):
    info = client.info()
    assert (info.device, info.dtype, info.kernels, info.on_cpu) == ("cpu", "float32", "torch", True)
    assert (info.block_size, info.num_device_blocks, info.num_host_blocks) == (16, 96, 64)


def test_first_tokens_are_recorded_once_per_request_with_their_wait(client):
    before = {f.request_id for f in client.recent_first_tokens()}
    started = time.time()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        deltas = list(client.submit(QUESTIONS[i], params, request_id=f"ttft-{i}"))
        assert deltas[-1].usage is not None
    recent = [f for f in client.recent_first_tokens() if f.request_id not in before]
    assert [f.request_id for f in recent] == ["ttft-0", "ttft-1", "ttft-2"]
    for f in recent:
        assert started <= f.timestamp <= time.time()
        assert 0 < f.ttft_s < 10
    # An aborted request (with or without a token by then) leaves nothing waiting for one.
    stream = client.submit(QUESTIONS[3], SamplingParams(max_tokens=500), request_id="aborted")
    client.abort("aborted")
    assert [d.finish_reason for d in stream][-1] == "abort"
    wait_until_idle(client)
    assert [f.request_id for f in client.recent_first_tokens()].count("aborted") <= 1
    assert client._submitted == {}


def test_users_share_the_preset_system_prompt_blocks_and_nothing_after_them(client, tokenizer):
    system = {"role": "system", "content": "You are a careful assistant for a team of engineers. " * 6}
    turn = [system, {"role": "user", "content": "Explain how a paged KV cache stores the keys and values, " * 3}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def cached(user: str) -> int:
        deltas = list(client.submit(turn, params, cache_salt=user, num_shared_messages=1))
        return deltas[-1].usage.cached_tokens

    def count(messages, generation_prompt: bool) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    shared_tokens = count([system], False)
    preset_blocks_tokens = shared_tokens // 16 * 16
    prompt_tokens = count(turn, True)
    assert preset_blocks_tokens >= 16 and prompt_tokens >= preset_blocks_tokens + 32
    cached("ada")  # her blocks, salted with "ada" after the preset
    assert cached("ada") == (prompt_tokens - 1) // 16 * 16   # all her own full blocks
    # the same text: only the preset, its whole blocks and its last tokens (copied from ada's block)
    assert cached("bob") == shared_tokens
    assert cached("bob") == (prompt_tokens - 1) // 16 * 16   # his own, now cached
    wait_until_idle(client)


# ---- the async side: what a web server's handlers use ------------------------------------------
async def read_all(stream) -> list:
    return [delta async for delta in stream]


def test_many_async_readers_on_one_event_loop_thread_get_the_same_text_as_blocking_ones(client):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = ["".join(d.text for d in client.submit(q, params)) for q in QUESTIONS]
    threads_before = set(threading.enumerate())

    async def main():
        streams = [await client.asubmit(q, params) for q in QUESTIONS]
        threads_while_waiting = set(threading.enumerate())
        return await asyncio.gather(*(read_all(s) for s in streams)), threads_while_waiting

    replies, threads_while_waiting = asyncio.run(main())
    # Eight waiting readers, no thread each (a thread that merely came and went meanwhile is no reader's).
    new_threads = threads_while_waiting - threads_before
    assert len(new_threads) < len(QUESTIONS), [t.name for t in new_threads]
    assert ["".join(d.text for d in deltas) for deltas in replies] == expected
    assert all(deltas[-1].finish_reason == "length" for deltas in replies)
    wait_until_idle(client)


def test_async_bad_prompts_raise_at_submit(client):
    async def main():
        with pytest.raises(PromptTooLongError):
            await client.asubmit("word " * 3000, SamplingParams(max_tokens=8))

    asyncio.run(main())


@pytest.mark.parametrize("when", ["before the first token", "mid-stream"])
def test_a_cancelled_async_reader_aborts_its_request(client, when):
    """What a web server does when its client leaves: cancel the task reading the reply."""
    reasons = final_reasons(client)
    request_id = f"cancelled-reader-{when}"

    async def main():
        stream = await client.asubmit(QUESTIONS[1], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
                                      request_id=request_id)

        async def read():
            async for delta in stream:
                if when == "mid-stream" and delta.token_ids:
                    reading.set()
            raise AssertionError("the reply ended by itself")

        reading = asyncio.Event()
        task = asyncio.create_task(read())
        if when == "mid-stream":
            await asyncio.wait_for(reading.wait(), DEADLINE_S)
        else:
            await asyncio.sleep(0)  # the reader waits; the request may not have its first token yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_for_abort(client, reasons, request_id)  # ended by the abort, not by writing its 900 tokens out


def test_a_caller_cancelled_while_its_submit_is_queued_leaves_nothing_running(client):
    async def main():
        params = SamplingParams(max_tokens=900, ignore_eos=True)
        task = asyncio.create_task(client.asubmit(QUESTIONS[2], params, request_id="queued-then-cancelled"))
        await asyncio.sleep(0)  # the submit is in the loop's inbox, its answer not yet back
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        client.abort("queued-then-cancelled")  # the loop answered first (rare): not what we test
        return False

    cancelled = any(asyncio.run(main()) for _ in range(5))  # stops at the first cancel that landed
    wait_until_idle(client)
    # The thread client's submit waits for the loop thread, the process client's for its tokenizer
    # thread: a cancel can land in either, and leaves nothing running.
    assert cancelled


def test_a_reader_that_falls_behind_gets_the_queued_tokens_merged_in_order(client):
    """Deltas that wait for a slow reader reach it merged (a chunk per wake-up, not per token),
    every character in order, and the final delta still carries the finish and the usage."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = "".join(d.text for d in client.submit(QUESTIONS[3], params))
    generated = client.stats().total_generated_tokens
    stream = client.submit(QUESTIONS[3], params)
    first = next(stream)
    wait_until_idle(client, generated + 59)  # the whole reply (the first token is the prefill's) is queued
    rest = list(stream)
    assert first.text + "".join(d.text for d in rest) == expected
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 60
    assert len(rest) == 1 and rest[0].finish_reason == "length" and rest[0].usage.completion_tokens == 60


def test_an_async_reader_that_falls_behind_gets_them_merged_too(client):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)

    async def main():
        generated = client.stats().total_generated_tokens
        stream = await client.asubmit(QUESTIONS[4], params)
        first = await anext(stream)
        await asyncio.to_thread(wait_until_idle, client, generated + 39)
        return [first] + [d async for d in stream]

    deltas = asyncio.run(main())
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 40 and len(deltas) == 2
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)  # one entry per token, still aligned


def test_prompts_are_tokenized_on_the_callers_side_never_on_the_engine_loop(tiny_model_dir, monkeypatch):
    """A long text takes seconds to tokenize: on the thread that steps the engine, every stream
    would wait for it; on the event loop, every reply of the server would."""
    from engine.frontend.input_processor import InputProcessor

    threads: list[str] = []
    encode = InputProcessor.encode

    def recorded(self, prompt):
        threads.append(threading.current_thread().name)
        return encode(self, prompt)

    monkeypatch.setattr(InputProcessor, "encode", recorded)
    client = EngineClient(LLMEngine(tiny_model_dir, device="cpu", num_gpu_blocks=64, num_cpu_blocks=16))
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        assert len(list(client.submit("Hello there", params))) >= 1

        async def chat() -> str:
            loop_thread = threading.current_thread().name
            deltas = [d async for d in await client.asubmit([{"role": "user", "content": "Hi"}], params)]
            assert deltas
            return loop_thread

        loop_thread = asyncio.run(chat())
    finally:
        client.close()
    assert threads and "engine-loop" not in threads, threads
    assert threads[0] == threading.current_thread().name  # submit: the caller's own thread
    assert loop_thread not in threads[1:]  # asubmit: not the event loop's


# ---- a stream the caller lets go of: the client aborts its request, however it was let go ------
def final_reasons(client) -> dict[str, str]:
    """request id -> its final delta's finish reason, as the client routes them (a request that
    ran out by itself says "length"; one the client aborted says "abort")."""
    reasons: dict[str, str] = {}

    def listen(delta, now: float) -> None:
        if delta.finish_reason is not None:
            reasons.setdefault(delta.request_id, delta.finish_reason)
    client.add_listener(listen)
    return reasons


def wait_for_abort(client, reasons: dict[str, str], request_id: str) -> None:
    """The request ended by an abort (not by running out) and the engine holds nothing: the
    deadline is generous; the finish reason shows it was the abort that ended it."""
    wait_for(lambda: request_id in reasons, f"request {request_id} to end")
    assert reasons[request_id] == "abort", reasons[request_id]
    wait_until_idle(client)


@pytest.mark.parametrize("when", ["before the first delta", "mid-stream"])
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_stream_let_go_of_aborts_its_request(client, how, when):
    reasons = final_reasons(client)
    request_id = f"let-go-sync-{how}-{when}"
    stream = client.submit(QUESTIONS[5], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
                           request_id=request_id)
    if when == "mid-stream":
        next(stream)
    if how == "closed":
        stream.close()
    else:
        del stream
        gc.collect()
    wait_for_abort(client, reasons, request_id)


@pytest.mark.parametrize("when", ["before the first delta", "mid-stream"])
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_an_async_stream_let_go_of_aborts_its_request(client, how, when):
    reasons = final_reasons(client)
    request_id = f"let-go-async-{how}-{when}"

    async def main():
        stream = await client.asubmit(QUESTIONS[6], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
                                      request_id=request_id)
        if when == "mid-stream":
            await anext(stream)
        if how == "closed":
            await stream.aclose()
        else:
            del stream
            gc.collect()
        await asyncio.to_thread(wait_for_abort, client, reasons, request_id)

    asyncio.run(main())
