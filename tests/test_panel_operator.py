"""The load generator and the block map's owners and hashes are the operator's: the decision
(ui/panel/operator.py), and through a real server whose visitors are not the operator, the
load generator's refusal and a block map without them."""
from __future__ import annotations

import json
import re
import uuid

import pytest
from waiting import wait_for

from ui.panel.operator import OWNER_ENV, TOKEN_ENV, is_loopback, may_operate

TOKEN = "s3cret-token"
DIRECT = ("127.0.0.1", {})  # a request made on this machine: a loopback peer, no proxy's header
ELSEWHERE = ("203.0.113.7", {})


def operates(host, profile_username=None, given_token=None, env=None, request=DIRECT) -> bool:
    peer, headers = request
    return may_operate(host, peer, headers, profile_username, given_token, env or {})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_an_app_bound_to_loopback_is_the_operators_own(host):
    assert is_loopback(host) and operates(host) and operates(host, request=("::1", {}))


@pytest.mark.parametrize("headers", [{"X-Forwarded-For": "203.0.113.7"}, {"x-forwarded-for": "127.0.0.1"},
                                     {"Forwarded": "for=203.0.113.7"}, {"X-Real-IP": "203.0.113.7"},
                                     {"X-Forwarded-Host": "chat.example.com"}, {"X-Forwarded-Proto": "https"}])
def test_a_request_through_a_proxy_on_this_machine_is_a_visitor(headers):
    # nginx or Caddy in front of an app on 127.0.0.1: the peer is loopback, the request anyone's.
    assert not operates("127.0.0.1", request=("127.0.0.1", headers))
    assert operates("127.0.0.1", given_token=TOKEN, env={TOKEN_ENV: TOKEN}, request=("127.0.0.1", headers))


def test_on_a_loopback_bind_a_peer_from_elsewhere_is_a_visitor():
    for peer in ("203.0.113.7", "10.0.0.2", "testclient", "", None):
        assert not operates("127.0.0.1", request=(peer, {}))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.com", "", None])
def test_an_app_bound_elsewhere_lets_in_no_one_by_default(host):
    assert not is_loopback(host)
    assert not operates(host)  # not even a request from this machine
    assert not operates(host, "someone", "a guess", request=ELSEWHERE)


def test_the_spaces_owner_may_operate_and_no_one_else():
    env = {OWNER_ENV: "ada"}
    assert operates("0.0.0.0", "ada", env=env, request=ELSEWHERE)
    for other in ("Ada", "ada2", "", None):
        assert not operates("0.0.0.0", other, env=env, request=ELSEWHERE)
    assert not operates("0.0.0.0", "ada", env={OWNER_ENV: ""})  # no owner set: no one by that way


def test_on_a_space_a_loopback_bind_makes_no_visitor_the_operator():
    env = {"SPACE_ID": "ada/pagedchat", OWNER_ENV: "ada"}
    assert not operates("127.0.0.1", env=env) and not operates("127.0.0.1", "bob", env=env)
    assert operates("127.0.0.1", "ada", env=env)


def test_the_admin_token_lets_in_whoever_gives_it():
    env = {TOKEN_ENV: TOKEN}
    assert operates("0.0.0.0", None, TOKEN, env, ELSEWHERE)
    for wrong in (TOKEN + " ", TOKEN[:-1], "", None, "\ud800"):
        assert not operates("0.0.0.0", None, wrong, env, ELSEWHERE)
    assert not operates("0.0.0.0", None, "", {TOKEN_ENV: ""})  # an empty token is no token
    assert not operates("0.0.0.0", "ada", TOKEN, {})


# ---- through a real server ------------------------------------------------------------------------
gr = pytest.importorskip("gradio")
import httpx  # noqa: E402
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from served_app import served_with_load  # noqa: E402


@pytest.fixture(scope="module")
def public_app(tiny_model_dir, tmp_path_factory):
    """The app as a public server would run it (decided as bound to 0.0.0.0), though the test
    reaches it on 127.0.0.1."""
    with served_with_load(tiny_model_dir, tmp_path_factory.mktemp("public") / "chat.db", 64, 32,
                          host="0.0.0.0") as served:
        yield served


def test_a_visitor_cannot_start_or_stop_the_load_generator(public_app, monkeypatch):
    client, load, url = public_app
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    session = Client(url, verbose=False)
    with pytest.raises(AppError, match="The load generator is for the operator"):
        session.predict(4, "Helpful assistant", 16, "", api_name="/start_load")
    with pytest.raises(AppError, match="The load generator is for the operator"):
        session.predict("", api_name="/stop_load")

    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # a token set, but a wrong one given
    with pytest.raises(AppError, match="The load generator is for the operator"):
        session.predict(4, "Helpful assistant", 16, "not the token", api_name="/start_load")
    # start() sets the status before it returns: a start that got through would show already.
    assert not load.status().running and load.status().users == 0
    assert client.stats().num_running + client.stats().num_waiting == 0
    session.close()


def test_the_admin_token_starts_and_stops_it(public_app, monkeypatch):
    client, load, url = public_app
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    session = Client(url, verbose=False)
    status = session.predict(2, "Helpful assistant", 16, TOKEN, api_name="/start_load")
    assert 'data-running="true"' in status and load.status().running and load.status().users == 2
    # A visitor without the token cannot stop the operator's run.
    with pytest.raises(AppError, match="The load generator is for the operator"):
        session.predict("", api_name="/stop_load")
    assert load.status().running
    status = session.predict(TOKEN, api_name="/stop_load")
    assert 'data-running="false"' in status and not load.status().running
    session.close()


def panel_tick(url: str, session: str, token: str) -> str | dict:
    """What one tick of the panel sends a page for its block map: the HTML, or Gradio's "no
    change" update. The tick is hidden from gradio_client, so this asks for it as a page does,
    through the queue; the server keeps the page's State per `session`."""
    with httpx.Client(base_url=url, timeout=60) as http:
        config = http.get("config").json()
        block_map = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == "block-map")
        tick = next(d for d in config["dependencies"] if block_map in d["outputs"])
        http.post("gradio_api/queue/join", json={"data": [False, None, token], "fn_index": tick["id"],
                                                 "trigger_id": tick["targets"][0][0], "session_hash": session})
        with http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as events:
            for line in events.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                if message.get("msg") == "process_completed":
                    assert message["success"], message
                    return message["output"]["data"][tick["outputs"].index(block_map)]
    pytest.fail("the tick never finished")


IN_USE = r'class="kv-cell kv-(used|shared)[" ]'  # a block map cell in use, as the panel writes it


def short_hashes(client) -> set[str]:
    """The hashes of the engine's blocks as the operator's block map writes them."""
    snapshot = client.block_map()
    return {f"{b.block_hash & 0xFFFFFFFFFFFFFFFF:016x}"[:8] for b in (*snapshot.device, *snapshot.host)
            if b.block_hash is not None}


def test_a_visitor_sees_no_owners_or_hashes_in_the_block_map(public_app, monkeypatch):
    client, load, url = public_app
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    load_ids = re.compile(r"load\d+-u\d+")  # the load generator's request ids (its conversations)
    load.start(4, max_tokens=32)
    try:  # while blocks are in use: the operator sees whose they are, a visitor does not
        def both_views() -> tuple[str, str] | None:
            visitor, operator = panel_tick(url, uuid.uuid4().hex, ""), panel_tick(url, uuid.uuid4().hex, TOKEN)
            in_use = re.search(IN_USE, visitor) and "owners load" in operator
            return (visitor, operator) if in_use else None
        visitor, operator = wait_for(both_views, "under load, a block map in use for a visitor with owners for "
                                                 "the operator", interval=0.2)
    finally:
        load.stop()
    assert "hash " in operator and load_ids.search(operator)
    titles = re.findall(r'title="([^"]*)"', visitor)
    assert titles and not any("owners" in t or "hash" in t for t in titles) and not load_ids.search(visitor)
    assert "Owners and hashes are shown to the operator only." in visitor

    # Idle, the blocks keep their hashes. One page: a visitor's map, then nothing new while it
    # stays the same, then the operator's map as soon as the admin token is given.
    wait_for(lambda: not client.stats().device_blocks_used, "the engine's blocks freed")
    # The panel's shared snapshot catches up within a feed interval: until a page of its own shows
    # no block in use, it may still be the one taken under load.
    wait_for(lambda: not re.search(IN_USE, panel_tick(url, uuid.uuid4().hex, "")),
             "the panel's block map to show the idle engine", interval=0.2)
    page, hashes = uuid.uuid4().hex, short_hashes(client)
    visitor = panel_tick(url, page, "")
    assert isinstance(visitor, str) and hashes
    assert not isinstance(panel_tick(url, page, ""), str)  # unchanged: not resent
    operator = panel_tick(url, page, TOKEN)
    assert isinstance(operator, str) and all(f"hash {h}" in operator for h in hashes)
    assert not any(h in visitor for h in hashes)
