"""The load generator is the operator's: the decision (ui/panel/operator.py), and its refusal
through a real server whose visitors are not the operator."""
from __future__ import annotations

import time

import pytest

from ui.panel.operator import OWNER_ENV, TOKEN_ENV, is_loopback, may_operate

TOKEN = "s3cret-token"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_an_app_bound_to_loopback_is_the_operators_own(host):
    assert is_loopback(host) and may_operate(host, None, None, {})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.com", "", None])
def test_an_app_bound_elsewhere_lets_in_no_one_by_default(host):
    assert not is_loopback(host)
    assert not may_operate(host, None, None, {})
    assert not may_operate(host, "someone", "a guess", {})


def test_the_spaces_owner_may_operate_and_no_one_else():
    env = {OWNER_ENV: "ada"}
    assert may_operate("0.0.0.0", "ada", None, env)
    for other in ("Ada", "ada2", "", None):
        assert not may_operate("0.0.0.0", other, None, env)
    assert not may_operate("0.0.0.0", "ada", None, {OWNER_ENV: ""})  # no owner set: no one by that way


def test_the_admin_token_lets_in_whoever_gives_it():
    env = {TOKEN_ENV: TOKEN}
    assert may_operate("0.0.0.0", None, TOKEN, env)
    for wrong in (TOKEN + " ", TOKEN[:-1], "", None, "\ud800"):
        assert not may_operate("0.0.0.0", None, wrong, env)
    assert not may_operate("0.0.0.0", None, "", {TOKEN_ENV: ""})  # an empty token is no token
    assert not may_operate("0.0.0.0", "ada", TOKEN, {})


# ---- through a real server ------------------------------------------------------------------------
gr = pytest.importorskip("gradio")
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
    time.sleep(0.2)
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
