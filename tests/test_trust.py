"""Whom the app trusts, decided from what each request proves, through the real servers and a real
reverse proxy on this machine (tests/reverse_proxy.py, as nginx in front of an app on 127.0.0.1):
- a request through the proxy is no operator: it cannot run the load generator or see the block
  map's owners, and the API without a key answers it 401, while direct requests keep working;
- an API caller's `cache_salt` is its own, never a chat user's: naming a user's salt and
  replaying their message hits no more of the prefix cache than any other salt does, in the app
  and across the boundary to a remote `engine.serve`;
- replies in progress are limited per page (Gradio session) and per client address, not only per
  user id, which a script mints at will."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from reverse_proxy import ReverseProxy, from_address
from served_app import Served, serve, served_with_load
from test_panel_operator import panel_tick

from engine.api.access import client_address, made_here
from engine.serve import build_server
from storage import Store
from ui import backends
from ui.backends.backend import Reply
from ui.turns import MAX_REPLIES_PER_ADDRESS, MAX_REPLIES_PER_SESSION, TOO_MANY_FROM_ADDRESS, TOO_MANY_IN_PAGE
from ui.panel.operator import OWNER_ENV, SPACE_ENV, TOKEN_ENV
from ui.presets import PRESETS

PRESET = "Helpful assistant"
KEY = "engine-key"


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def no_operator_settings(monkeypatch):
    for name in (TOKEN_ENV, OWNER_ENV, SPACE_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def app(tiny_model_dir, tmp_path_factory):
    """The app bound (and told it is bound) to 127.0.0.1, its API on without a key, as
    `python app.py` runs it on a machine of one's own: (engine client, load generator, URL)."""
    with served_with_load(tiny_model_dir, tmp_path_factory.mktemp("trust") / "chat.db", 256, 64,
                          host="127.0.0.1") as served:
        yield served


@pytest.fixture(scope="module")
def proxy(app):
    forwarding = ReverseProxy(app[2])
    yield forwarding
    forwarding.close()


# ---- 1. behind a reverse proxy, no visitor is the operator ----------------------------------------
def test_what_a_request_proves_about_where_it_comes_from():
    assert made_here("127.0.0.1", {}) and made_here("::1", {})
    assert not made_here("127.0.0.1", {"X-Forwarded-For": "127.0.0.1"}) and not made_here("203.0.113.7", {})
    # Behind a proxy here: the address it appended last (those before are the client's to write).
    assert client_address("127.0.0.1", {"X-Forwarded-For": "10.9.9.9, 203.0.113.7"}) == "203.0.113.7"
    assert client_address("127.0.0.1", {"Forwarded": 'for=10.9.9.9, for="203.0.113.7";proto=https'}) == "203.0.113.7"
    assert client_address("127.0.0.1", {"X-Real-IP": "203.0.113.7"}) == "203.0.113.7"
    # A client reaching the server directly cannot choose its address, unless the peer is a trusted front.
    assert client_address("198.51.100.4", {"X-Forwarded-For": "203.0.113.7"}) == "198.51.100.4"
    assert client_address("10.0.0.2", {"X-Forwarded-For": "203.0.113.7"}, proxy_trusted=True) == "203.0.113.7"
    assert client_address("127.0.0.1", {}) == "127.0.0.1"


def test_through_a_local_proxy_no_visitor_may_run_the_load_generator(app, proxy):
    client, load, url = app
    visitor = Client(proxy.url, verbose=False)
    with pytest.raises(AppError, match="The load generator is for the operator"):
        visitor.predict(4, PRESET, 16, "", api_name="/start_load")
    assert not load.status().running and load.status().users == 0

    operator = Client(url, verbose=False)  # the same app, reached directly on this machine
    status = operator.predict(2, PRESET, 16, "", api_name="/start_load")
    try:
        assert 'data-running="true"' in status and load.status().running
        with pytest.raises(AppError, match="The load generator is for the operator"):
            visitor.predict("", api_name="/stop_load")  # nor stop the operator's run
        assert load.status().running
        # While the load runs: owners in the operator's block map, none in the visitor's.
        deadline = time.monotonic() + 60
        while True:
            direct, forwarded = panel_tick(url, uuid.uuid4().hex, ""), panel_tick(proxy.url, uuid.uuid4().hex, "")
            if "owners load" in direct:
                break
            assert time.monotonic() < deadline, "under load, no owners in the operator's block map"
        assert "Owners and hashes are shown to the operator only." in forwarded and "owners load" not in forwarded
    finally:
        status = operator.predict("", api_name="/stop_load")
    assert 'data-running="false"' in status and not load.status().running
    visitor.close()
    operator.close()


def api_calls(base: str, http: httpx.Client, headers: dict | None = None) -> list[httpx.Response]:
    """The API's routes that want a key, called without one."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    return [http.get(f"{base}v1/models", headers=headers), http.get(f"{base}v1/kv_cache", headers=headers),
            http.post(f"{base}v1/chat/completions", json=body, headers=headers),
            http.post(f"{base}v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=headers)]


def assert_refused_as_forwarded(responses: list[httpx.Response]) -> None:
    for response in responses:
        assert response.status_code == 401, (response.request.url, response.status_code, response.text[:200])
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and "proxy" in error["message"] and "--api-key" in error["message"]


def test_without_a_key_the_api_answers_only_requests_made_on_this_machine(app, proxy):
    client, _, url = app
    engine_alone = Served(build_server(client, "tiny"))  # `python -m engine.serve` on 127.0.0.1, no key
    engine_proxy = ReverseProxy(engine_alone.url)
    try:
        with httpx.Client(timeout=60) as http:
            for direct, forwarded in ((url, proxy.url), (engine_alone.url, engine_proxy.url)):
                assert_refused_as_forwarded(api_calls(forwarded, http))
                # A proxy header sent by hand counts as well: whoever sends one says it is forwarded.
                assert_refused_as_forwarded(api_calls(direct, http, {"X-Forwarded-For": "127.0.0.1"}))
                assert_refused_as_forwarded(api_calls(direct, http, {"Forwarded": "for=127.0.0.1"}))
                assert [r.status_code for r in api_calls(direct, http)] == [200] * 4
                assert http.get(f"{forwarded}health").status_code == 200  # open, as on vLLM's server
    finally:
        engine_proxy.close()
        engine_alone.close()


# ---- 2. an API caller's cache salt is its own ------------------------------------------------------
def cached_tokens(base: str, user: str, message: str, salt: str | None, api_key: str | None = None) -> tuple[int, int]:
    """(cached, prompt) tokens of an API request replaying `message` on the chat page's preset,
    with `cache_salt` and the preset shared, as the chat page sends its users' turns."""
    body = {"messages": [{"role": "system", "content": PRESETS[PRESET]}, {"role": "user", "content": message}],
            "max_tokens": 1, "temperature": 0.0, "cache_salt": salt, "num_shared_messages": 1}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{base.rstrip('/')}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def chat_turn(url: str, user: str, message: str, conversation_id: int | None = None) -> int:
    """One turn on the chat page (greedy, 8 tokens, the preset): the conversation's id."""
    session = Client(url, verbose=False)
    try:
        _, conversation_id, _ = session.predict(user, conversation_id, message, PRESET, "", 0.0, 1.0, 8,
                                                api_name="/send")
    finally:
        session.close()
    return conversation_id


def private_message() -> str:
    return (f"My account number is {uuid.uuid4().int % 10**12:012d} and my address is 12 Rue des Lilas; "
            "please help me write a letter to my bank about the overdraft fee they charged me last month.")


def test_an_api_caller_cannot_name_a_chat_users_salt(app):
    client, _, url = app
    user, message = new_user(), private_message()
    chat_turn(url, user, message)
    named, prompt = cached_tokens(url, user, message, salt=user)
    other, _ = cached_tokens(url, user, message, salt=new_user())
    assert 0 < other < prompt - 16  # the preset's blocks, shared by design; the message is not
    assert named == other, f"naming the chat user's salt hit {named} of {prompt} tokens, another salt {other}"
    # An API caller's own salt still works for itself.
    assert cached_tokens(url, user, message, salt="mine")[0] == other
    assert cached_tokens(url, user, message, salt="mine")[0] > other


@pytest.fixture(scope="module")
def remote_app(app, tmp_path_factory):
    """The app in front of `python -m engine.serve` (with an API key) over the same engine:
    (engine URL, app URL, store)."""
    engine = Served(build_server(app[0], "tiny", api_key=KEY))
    store = Store(tmp_path_factory.mktemp("remote") / "chat.db")
    server, url = serve(None, store, backend=backends.remote([engine.url], [KEY], interval_s=0.25))
    try:
        yield engine.url, url, store
    finally:
        server.close()
        engine.close()
        store.close()


def test_across_a_remote_engine_a_user_keeps_their_cache_and_a_key_holder_cannot_name_it(remote_app):
    engine_url, url, store = remote_app
    user, message = new_user(), private_message()
    conversation_id = chat_turn(url, user, message)
    chat_turn(url, user, "And make it polite, please.", conversation_id)
    first, second = [m for m in store.messages(user, conversation_id) if m["role"] == "assistant"]
    assert first["backend"] == second["backend"]  # the remote engine wrote both

    named, prompt = cached_tokens(engine_url, user, message, salt=user, api_key=KEY)
    other, _ = cached_tokens(engine_url, user, message, salt=new_user(), api_key=KEY)
    assert 0 < other < prompt - 16
    # Turn two hit the user's own first turn, beyond the preset: the salt works across the boundary.
    assert second["cached_tokens"] >= prompt - 16 > other
    assert named == other, f"naming the chat user's salt hit {named} of {prompt} tokens, another salt {other}"


# ---- 3. replies in progress, per page and per client address ---------------------------------------
class HeldReplies:
    """A backend whose replies are held before their first token until `release` is set, so that
    each stays in progress (its turn taken) for as long as the test needs."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def start(self, *args, **kwargs) -> Reply:
        reply = await self._backend.start(*args, **kwargs)
        return Reply(_Held(reply.deltas, self.release), reply.backend)


class _Held:
    def __init__(self, deltas, release: threading.Event) -> None:
        self._deltas = deltas
        self._release = release

    def __aiter__(self):
        return self._after_release()

    async def _after_release(self):
        while not self._release.is_set():
            await asyncio.sleep(0.02)
        async for delta in self._deltas:
            yield delta

    async def aclose(self) -> None:
        await self._deltas.aclose()


@pytest.fixture
def held_app(app, tmp_path):
    """The chat page over the engine with every reply held, behind the reverse proxy:
    (held backend, app URL, proxy URL)."""
    held = HeldReplies(backends.in_process(app[0]))
    store = Store(tmp_path / "chat.db")
    server, url = serve(None, store, backend=held)
    forwarding = ReverseProxy(url)
    try:
        yield held, url, forwarding.url
    finally:
        held.release.set()
        forwarding.close()
        server.close()
        store.close()


class Page:
    """One browser page (a Gradio session) on the chat, over Gradio's own protocol (POST
    queue/join, then the session's event stream), from a client address of the test's choosing."""

    def __init__(self, url: str, fn_index: int, address: str = "127.0.0.1") -> None:
        self.http = from_address(address, base_url=url, timeout=60)
        self.fn_index = fn_index
        self.session = uuid.uuid4().hex[:11]
        self._events = None

    def send(self, user: str) -> str:
        """Send a message as `user`; the event's id."""
        joined = self.http.post("gradio_api/queue/join", json={
            "data": [user, None, "Hello there", "None", "", 0.0, 1.0, 16], "fn_index": self.fn_index,
            "session_hash": self.session, "event_data": None, "trigger_id": None})
        joined.raise_for_status()
        return joined.json()["event_id"]

    def outcomes(self, count: int, timeout: float = 60.0) -> dict[str, str]:
        """How `count` of the events sent so far began: "replying" (the first view came) or the
        error the page shows."""
        if self._events is None:
            self._stream = self.http.send(self.http.build_request(
                "GET", "gradio_api/queue/data", params={"session_hash": self.session}), stream=True)
            self._events = self._stream.iter_lines()
        found: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(found) < count:
            assert time.monotonic() < deadline, f"only {found} of {count} events began"
            line = next(self._events)
            message = json.loads(line[5:]) if line.startswith("data:") else {}
            event = message.get("event_id")
            if message.get("msg") == "process_generating":
                found.setdefault(event, "replying")
            elif message.get("msg") == "process_completed":
                found.setdefault(event, "finished" if message.get("success") else message["output"].get("error"))
        return found

    def close(self) -> None:
        if self._events is not None:
            self._stream.close()
        self.http.close()


def send_fn_index(url: str) -> int:
    config = httpx.get(f"{url}config", timeout=30).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == "send")


def test_one_address_minting_user_ids_is_limited_and_others_are_not(held_app):
    held, url, proxied = held_app
    fn = send_fn_index(url)
    pages = []

    def page(base: str, address: str) -> Page:
        pages.append(Page(base, fn, address))
        return pages[-1]

    try:
        for _ in range(MAX_REPLIES_PER_ADDRESS):  # each from a page and a user id of its own
            one = page(proxied, "127.0.0.2")
            one.send(new_user())
            assert list(one.outcomes(1).values()) == ["replying"]
        one_more = page(proxied, "127.0.0.2")
        one_more.send(new_user())
        assert list(one_more.outcomes(1).values()) == [TOO_MANY_FROM_ADDRESS]
        # Another client address through the same proxy, and this machine itself, go on.
        elsewhere = page(proxied, "127.0.0.3")
        elsewhere.send(new_user())
        assert list(elsewhere.outcomes(1).values()) == ["replying"]
        here = page(url, "127.0.0.1")
        here.send(new_user())
        assert list(here.outcomes(1).values()) == ["replying"]
    finally:
        held.release.set()
        for one in pages:
            one.close()


def test_one_page_minting_user_ids_is_limited(held_app):
    held, url, proxied = held_app
    page = Page(url, send_fn_index(url))
    try:
        for _ in range(MAX_REPLIES_PER_SESSION + 1):
            page.send(new_user())
        outcomes = sorted(page.outcomes(MAX_REPLIES_PER_SESSION + 1).values())
        assert outcomes == sorted(["replying"] * MAX_REPLIES_PER_SESSION + [TOO_MANY_IN_PAGE])
    finally:
        held.release.set()
        page.close()
