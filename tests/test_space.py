"""The app started as a Hugging Face Space starts it: `python app.py` in a subprocess with the
variables a Space sets (OAuth on, `SYSTEM=spaces`), signing in through Gradio's real OAuth routes
and authlib against a fake OpenID provider (tests/fake_openid.py), in Debian's chromium.

Left out of the Space's variables: `SPACE_HOST`. With it, Gradio sends the provider the callback
`https://$SPACE_HOST/login/callback`, which on a Space is Hugging Face's TLS proxy; there is no
such proxy here, so the callback is built from the request's own URL, as it is off a Space.
"""
from __future__ import annotations

import os
import pathlib
import secrets
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest
from fake_openid import FakeOpenID
from playwright.sync_api import expect
from served_app import Served, free_port
from waiting import DEADLINE_S
from web_browser import Browser, browser, send, set_params  # noqa: F401  (the module's chromium)


ROOT = pathlib.Path(__file__).resolve().parents[1]
OWNER = "owner"
CLIENT_ID = "pagedchat-space"
CLIENT_SECRET = secrets.token_urlsafe(16)
START_TIMEOUT_S = 120
DONE = "prompt tokens cached"  # the metrics line under a finished reply
REPLY_TIMEOUT_MS = int(DEADLINE_S * 1000)  # a reply on a busy machine: a bound on a hang


@pytest.fixture(scope="module")
def provider():
    fake = FakeOpenID(CLIENT_ID, CLIENT_SECRET, ["alice", "bob", OWNER])
    served = Served(fake.app)
    fake.issuer = served.url.rstrip("/")
    yield fake
    served.close()


def space_environment(provider_url: str, port: int, model: str, db: pathlib.Path) -> dict[str, str]:
    """What a Space gives the app (less SPACE_HOST, see above), on a loopback port."""
    return {
        "SYSTEM": "spaces", "SPACE_ID": f"{OWNER}/pagedchat", "SPACE_AUTHOR_NAME": OWNER,
        "SPACE_REPO_NAME": "pagedchat", "SPACE_TITLE": "PagedChat", "SPACE_CREATOR_USER_ID": "0" * 24,
        "CPU_CORES": "2", "MEMORY": "16Gi",
        "OAUTH_CLIENT_ID": CLIENT_ID, "OAUTH_CLIENT_SECRET": CLIENT_SECRET, "OAUTH_SCOPES": "openid profile",
        "OPENID_PROVIDER_URL": provider_url,
        "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
        "MODEL": model, "PAGEDCHAT_DB": str(db), "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="module")
def space(provider, tiny_model_dir, tmp_path_factory):
    """`python app.py` as a Space runs it; yields (url, database path, log path, process)."""
    folder = tmp_path_factory.mktemp("space")
    port, db, log_path = free_port(), folder / "pagedchat.db", folder / "app.log"
    env = {**os.environ, **space_environment(provider.issuer, port, tiny_model_dir, db)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"app.py exited at start: {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"app.py did not serve within {START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, db, log_path, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def sign_in(visitor: Browser, page, provider: FakeOpenID, username: str) -> None:
    """Through the login button, the provider's page and Gradio's callback, back to the chat."""
    signed_in = len(provider.signed_in)
    with navigating(visitor):
        page.get_by_role("button", name="Sign in with Hugging Face").click()
        page.get_by_role("link", name=f"Sign in as {username}").click()
        page.get_by_role("button", name=f"Logout ({username})").wait_for()
    assert provider.signed_in[signed_in:] == [username]


def sign_out(visitor: Browser, page, username: str) -> None:
    with navigating(visitor):
        page.get_by_role("button", name=f"Logout ({username})").click()
        page.get_by_role("button", name="Sign in with Hugging Face").wait_for()


@contextmanager
def navigating(visitor: Browser):
    """Leaving the page cuts Gradio's open event streams, which its client logs as errors."""
    visitor.reloading = True
    try:
        yield
    finally:
        visitor.reloading = False


def page_errors(visitor: Browser) -> list[str]:
    """The browser's errors, less those of a machine with no internet: on a Space, Gradio's page
    loads Google's fonts and asks huggingface.co about the Space for its header."""
    offline = ("console: Failed to load resource: net::ERR_NAME_NOT_RESOLVED", "console: Space not found")
    return [error for error in visitor.errors if error not in offline]


def chat_titles(page) -> list[str]:
    """The sidebar's list of this user's chats."""
    return page.evaluate("() => [...document.querySelectorAll('input[type=radio]')]"
                         ".map(radio => radio.closest('label').innerText.trim())")


def chat(page, text: str) -> None:
    """A message sent and answered in a new chat (the tiny model's reply is gibberish, but a reply,
    of 8 tokens: at the default 512 each chat took ~15 s of the Space's streaming here)."""
    set_params(page, max_tokens=8)
    page.get_by_role("button", name="New chat").click()
    expect(page.locator('[data-testid="user"]')).to_have_count(0)  # the new chat shown before sending into it
    send(page, text)
    expect(page.locator('[data-testid="bot"]').last).to_contain_text(DONE, timeout=REPLY_TIMEOUT_MS)
    expect(page.get_by_role("radio", name=text)).to_be_visible()  # listed once the turn ends


def owners(db: pathlib.Path) -> dict[str, int]:
    """Conversations per user id, read from the app's database file."""
    with sqlite3.connect(db) as connection:
        return dict(connection.execute("select user_id, count(*) from conversations group by user_id").fetchall())


def test_sign_in_as_two_users_and_the_owner(space, provider, browser):  # noqa: F811
    url, db, log_path, _ = space
    visitor = Browser(browser, url)
    page = visitor.open()

    # Anonymous visitors chat (see README: a public Space should not turn people away at the door).
    chat(page, "Hello from nobody in particular")
    (anonymous_id, chats), = owners(db).items()
    assert anonymous_id.startswith("anon:") and chats == 1

    # Signing in takes the browser's anonymous chats into the account.
    sign_in(visitor, page, provider, "alice")
    expect(page.get_by_role("radio", name="Hello from nobody in particular")).to_be_visible()
    chat(page, "Alice writes this one signed in")
    assert chat_titles(page) == ["Alice writes this one signed in", "Hello from nobody in particular"]
    assert owners(db) == {"hf:alice": 2}

    # Signed out, the browser is anonymous again and shows nothing of Alice's.
    sign_out(visitor, page, "alice")
    expect(page.get_by_role("radio")).to_have_count(0)

    # Bob, in the same browser, sees none of Alice's chats and gets no load generator.
    sign_in(visitor, page, provider, "bob")
    chat(page, "Bob's own question")
    assert chat_titles(page) == ["Bob's own question"]
    panel = visitor.context.new_page()
    panel.goto(url + "panel")
    expect(panel.locator("#panel-header")).to_be_visible()
    expect(panel.locator("#load-start")).to_be_hidden()
    panel.close()
    sign_out(visitor, page, "bob")

    # The Space's owner signs in on the panel itself and gets its load generator.
    panel = visitor.context.new_page()
    panel.goto(url + "panel")
    expect(panel.locator("#panel-header")).to_be_visible()
    expect(panel.locator("#load-start")).to_be_hidden()
    sign_in(visitor, panel, provider, OWNER)
    expect(panel.locator("#load-start")).to_be_visible()
    assert panel.url.rstrip("/").endswith("/panel")
    panel.close()
    visitor.reload(page)
    expect(page.get_by_role("button", name=f"Logout ({OWNER})")).to_be_visible()
    assert chat_titles(page) == []

    assert owners(db) == {"hf:alice": 2, "hf:bob": 1}
    assert page_errors(visitor) == []
    log = log_path.read_text()
    assert not [word for word in ("Traceback", "ERROR", "Error", "Warning") if word in log], log[-3000:]


def test_sigterm_stops_the_app_cleanly(space):
    """A Space stops its app with SIGTERM: the app exits 0 through its own shutdown (the engine
    stopped, the last database backup taken), not killed by the signal uvicorn re-raises. The
    open pages' event streams are ended at once, not cancelled after the grace period."""
    *_, log_path, process = space
    process.terminate()
    assert process.wait(timeout=DEADLINE_S) == 0
    log = log_path.read_text()
    # Uvicorn logs "... timeout graceful shutdown exceeded" when it cancels what outlived the
    # grace period: its absence, not a stopwatch, says the streams were ended at once.
    assert "Traceback" not in log and "timeout graceful shutdown" not in log, log[-4000:]
