"""The app in front of two real `python -m engine.serve` processes (tiny model), driven by
gradio_client users over HTTP: routing (a conversation sticks to its backend, a known system
prompt goes where it is cached), a backend killed mid-reply and brought back."""
from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from gradio_client import Client
from served_app import serve
from waiting import DEADLINE_S, wait_for

from engine import SamplingParams
from storage import Store
from ui import backends
from ui.stream import start_reply

GREEDY = (0.0, 1.0)  # temperature, top_p


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with Store(tmp_path_factory.mktemp("cluster") / "chat.db") as store:
        yield store


@pytest.fixture(scope="module")
def app(engine_servers, store):
    router = backends.remote([s.url for s in engine_servers], interval_s=0.25)
    server, url = serve(None, store, backend=router)
    try:
        yield router, url
    finally:
        server.close()


def send(url: str, user: str, text: str, preset: str = "None", conversation_id: int | None = None,
         max_tokens: int = 16, session: Client | None = None) -> tuple[list[dict], int]:
    session = session or Client(url, verbose=False)
    chat, conversation_id, _ = session.predict(user, conversation_id, text, preset, "", *GREEDY, max_tokens,
                                               api_name="/send")
    return chat, conversation_id


def at_once(url: str, users: list[str], text: str, max_tokens: int) -> dict[str, tuple]:
    """Each user sends `text` from a browser session of their own, all at the same moment."""
    sessions = [Client(url, verbose=False) for _ in users]
    jobs = [session.submit(user, None, text, "None", "", *GREEDY, max_tokens, api_name="/send")
            for user, session in zip(users, sessions)]
    return {user: tuple(job.result(timeout=DEADLINE_S)[:2]) for user, job in zip(users, jobs)}


def shown_text(chat: list[dict]) -> str:
    content = chat[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


def replies(store: Store, user: str, conversation_id: int) -> list[dict]:
    return [m for m in store.messages(user, conversation_id) if m["role"] == "assistant"]


def idle(engine_servers) -> bool:
    return all(s.running_requests() == 0 for s in engine_servers)


def router_idle(router) -> bool:
    """The router's own view: no reply in flight and no request in any backend's latest scrape."""
    return all(router.monitor.load(name) == (0, 0.0) for name in router.names)


def test_the_router_sees_both_backends_and_their_model(app, engine_servers):
    router, _ = app
    statuses = router.statuses()
    assert [s.name for s in statuses] == [s.name for s in engine_servers]
    assert all(s.up and s.model == "tiny" and s.max_model_len and s.flavor == "pagedchat" for s in statuses)


def test_users_chat_on_both_backends_and_turn_two_stays_where_turn_one_was(app, engine_servers, store):
    router, url = app
    users = [new_user() for _ in range(6)]
    results = at_once(url, users, "Tell me about paged attention.", max_tokens=200)
    first_backends = {user: replies(store, user, results[user][1])[0]["backend"] for user in users}
    assert set(first_backends.values()) == {s.name for s in engine_servers}, first_backends

    for user in users[:3]:  # turn 2: same backend, its prompt mostly from that backend's cache
        chat_view, conversation_id = send(url, user, "And then?", conversation_id=results[user][1])
        first, second = replies(store, user, conversation_id)
        assert second["backend"] == first["backend"]
        assert second["cached_tokens"] > 0 and second["prompt_tokens"] > second["cached_tokens"]
        assert f"by {first['backend']}" in shown_text(chat_view)  # the page says who wrote the reply
    wait_for(lambda: idle(engine_servers), "both backends idle")


@pytest.mark.anyio
async def test_a_known_system_prompt_goes_to_the_backend_that_cached_it(app, engine_servers, store):
    router, url = app
    await asyncio.to_thread(wait_for, lambda: router_idle(router), "the router to see both backends idle")
    first_choice = router.order()[0]
    # A reply held open on the first choice (the router counts it until it closes), so that a new
    # preset lands on the other backend and is cached there.
    held = await start_reply(router, [{"role": "user", "content": "A long story, please."}],
                             SamplingParams(temperature=0.0, max_tokens=16), user=new_user())
    try:
        assert held.backend == first_choice
        user = new_user()
        _, conversation_id = await asyncio.to_thread(send, url, user, "Review this: x = 1", "Code reviewer")
        owner = replies(store, user, conversation_id)[0]["backend"]
        assert owner != first_choice
    finally:
        await held.aclose()
    await asyncio.to_thread(wait_for, lambda: router_idle(router), "the router to see both backends idle")
    assert router.order()[0] == first_choice  # idle and even: least loaded alone would pick it

    other_user = new_user()
    _, conversation_id = await asyncio.to_thread(send, url, other_user, "Review this: y = 2", "Code reviewer")
    reply = replies(store, other_user, conversation_id)[0]
    assert reply["backend"] == owner
    assert reply["cached_tokens"] >= 16  # the preset's blocks, computed for the first user


@pytest.fixture
def victim(engine_servers):
    """The backend a test kills: running again when the test ends, however it ends, so that one
    failure never leaves the session's `engine_servers` a backend short for the tests after it."""
    yield engine_servers[0]
    if not engine_servers[0].running():
        engine_servers[0].start()


def test_a_backend_killed_mid_reply_fails_only_its_replies_and_comes_back(app, engine_servers, store, victim):
    router, url = app
    survivor = engine_servers[1]
    users = [new_user() for _ in range(4)]
    results: dict[str, tuple] = {}
    # Long enough that the victim's replies are still being written when it is killed (the wait
    # below sees them running on both), short enough that the survivor's finish soon on a busy machine.
    survivor_done = survivor.finished("length") + survivor.finished("stop")
    chats = threading.Thread(target=lambda: results.update(at_once(url, users, "Write me a very long essay.", 400)))
    chats.start()

    def on_both() -> bool:  # the survivor's may have ended already on a quick host: they count too
        survivor_had = survivor.running_requests() > 0 or \
            survivor.finished("length") + survivor.finished("stop") > survivor_done
        return survivor_had and victim.running_requests() > 0

    wait_for(on_both, lambda: f"replies on both: the victim runs {victim.running_requests()}, the survivor runs "
                              f"{survivor.running_requests()} and ended "
                              f"{survivor.finished('length') + survivor.finished('stop') - survivor_done}")
    victim.kill()
    chats.join(timeout=DEADLINE_S)
    assert not chats.is_alive(), f"the chats did not end within {DEADLINE_S:g} s"
    assert len(results) == len(users)

    failed = [u for u in users if "stopped answering mid-reply" in shown_text(results[u][0])]
    assert failed, "no reply was on the killed backend"
    for user in users:
        chat_view, conversation_id = results[user]
        rows = store.messages(user, conversation_id)
        assert rows[0]["role"] == "user" and rows[0]["content"] == "Write me a very long essay."
        if user in failed:  # what was written before the kill, marked as failed, or nothing
            assert all(r["finish_reason"] == "error" and r["backend"] == victim.name for r in rows[1:])
            assert victim.name in shown_text(chat_view)
        else:
            assert [r["backend"] for r in rows[1:]] == [survivor.name]
            assert rows[1]["finish_reason"] in ("stop", "length")
    assert not router.monitor.is_up(victim.name)

    # A new chat, and a failed one regenerated, go to the survivor.
    user = new_user()
    _, conversation_id = send(url, user, "Hello?")
    assert replies(store, user, conversation_id)[0]["backend"] == survivor.name
    session = Client(url, verbose=False)
    user, conversation_id = failed[0], results[failed[0]][1]
    session.predict(user, conversation_id, *GREEDY, 16, api_name="/regenerate")
    assert [r["backend"] for r in replies(store, user, conversation_id)] == [survivor.name]

    victim.start()  # back on its port: the monitor puts it back and routing uses it again
    wait_for(lambda: router.monitor.is_up(victim.name), "the restarted backend to be seen")
    wait_for(lambda: idle(engine_servers), "both backends idle")
    wait_for(lambda: router_idle(router), "the router to see both backends idle")
    # Four new chats at once: the least loaded rule spreads them over both (alone, each would go
    # to whichever name sorts first).
    welcomed = at_once(url, [new_user() for _ in range(4)], "Welcome back", max_tokens=8)
    served = {replies(store, user, conversation_id)[0]["backend"] for user, (_, conversation_id) in welcomed.items()}
    assert served == {victim.name, survivor.name}


@pytest.mark.anyio
async def test_closing_a_remote_reply_aborts_it_at_its_server(app, engine_servers):
    router, _ = app
    aborted_before = {s.name: s.finished("abort") for s in engine_servers}
    reply = await start_reply(router, [{"role": "user", "content": "A long story."}],
                              SamplingParams(temperature=0.0, max_tokens=2000), user=new_user())
    async for shown in reply:
        if shown.num_tokens >= 5:
            break
    assert reply.backend in {s.name for s in engine_servers}
    await reply.aclose()  # what Stop does
    await asyncio.to_thread(wait_for, lambda: idle(engine_servers), "the server to end the request")
    # Ended by the abort, not by writing its 2000 tokens out (which it might within the deadline).
    assert {s.name: s.finished("abort") - aborted_before[s.name] for s in engine_servers} == {
        s.name: float(s.name == reply.backend) for s in engine_servers}
    assert all(status.in_flight == 0 for status in router.statuses())


@pytest.mark.anyio
async def test_a_prompt_too_long_for_the_backend_is_refused_with_its_reason(app):
    router, _ = app
    with pytest.raises(ValueError, match="more than max_model_len=1024"):
        await start_reply(router, [{"role": "user", "content": "word " * 3000}], SamplingParams(max_tokens=8))
    assert all(status.in_flight == 0 for status in router.statuses())
