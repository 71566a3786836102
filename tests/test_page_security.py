"""What the page's server keeps for whoever calls it, over real HTTP to the served app: an upload
over the import limit is refused as it arrives and nothing of it is kept, exports leave no
folders behind (and Gradio's copies go when the server stops), and the per-session state that
lets a reply stop when its browser leaves does not grow with every call. (The copy button's
hole is in the page: tests/test_browser.py.)"""
from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("gradio")
import httpx  # noqa: E402
from served_app import Served  # noqa: E402
from waiting import wait_for  # noqa: E402

from benchmarks.gradio_http import fn_index, submit  # noqa: E402
from storage import Store  # noqa: E402
from ui.chat_input import MAX_IMPORT_BYTES  # noqa: E402
from ui.sessions import Sessions  # noqa: E402


@dataclass
class App:
    url: str
    store: Store
    sessions: Sessions
    uploads: Path  # Gradio's temporary folder: uploads and the files handlers return
    temp: Path  # the process's temporary folder (tempfile's) while the app runs


@contextmanager
def served_page(model: str, root: Path) -> Iterator[App]:
    """The app around an engine on `model` (as tests/served_app.serve builds it, keeping its
    `Sessions`), with Gradio's and tempfile's temporary folders under `root`, so that what it
    leaves there can be counted while other tests run."""
    from ui.server import build_app, build_server
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from ui import backends
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator

    uploads, temp = root / "gradio", root / "tmp"
    temp.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_TEMP_DIR", str(uploads))
        patch.setattr(tempfile, "tempdir", str(temp))
        client = EngineClient(LLMEngine(model, num_gpu_blocks=64, num_cpu_blocks=16))
        store = Store(root / "chat.db")
        backend, feed, load = backends.in_process(client), PanelFeed(client), LoadGenerator(client)
        sessions = Sessions()
        demo = build_app(backend, store, feed, load, sessions=sessions)
        server = Served(build_server(demo, client, sessions, "127.0.0.1"), [load.stop, feed.close, backend.close])
        try:
            yield App(server.url, store, sessions, uploads, temp)
        finally:
            server.close()
            client.close()
            store.close()


@pytest.fixture(scope="module")
def app(tiny_model_dir, tmp_path_factory) -> Iterator[App]:
    with served_page(tiny_model_dir, tmp_path_factory.mktemp("page-security")) as served:
        yield served


def new_user() -> str:
    return f"anon:{uuid.uuid4().hex}"


def files_under(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file()} if folder.exists() else set()


# ---- uploads ----------------------------------------------------------------------------------------
def test_an_upload_over_the_import_limit_is_refused_and_nothing_of_it_is_kept(app):
    before = files_under(app.uploads)
    too_big = b" " * MAX_IMPORT_BYTES + b"{}"
    refused = httpx.post(f"{app.url}gradio_api/upload", files={"files": ("chat.json", too_big, "application/json")},
                         timeout=60)
    assert refused.status_code == 413, (refused.status_code, refused.text[:200])
    assert f"{MAX_IMPORT_BYTES}" in refused.text  # the error says what the limit is
    assert files_under(app.uploads) == before

    fits = httpx.post(f"{app.url}gradio_api/upload", files={"files": ("chat.json", b"{}", "application/json")},
                      timeout=60)
    assert fits.status_code == 200, fits.text[:200]
    [stored] = fits.json()
    assert Path(stored).read_bytes() == b"{}" and Path(stored).is_relative_to(app.uploads)


# ---- exports ----------------------------------------------------------------------------------------
def export_event_index(url: str) -> int:
    """The Export button's event: it has no public API name, so it is found as the page finds it."""
    return fn_index(url, "on_export")


def export(url: str, fn: int, user: str, conversation_id: int) -> list[dict]:
    """One click on Export from a fresh browser session: the files the page is given."""
    event = submit(url, fn, [user, conversation_id])
    try:
        for message in event.messages():
            if message.get("msg") == "process_completed":
                assert message["success"], message
                return message["output"]["data"][0]["value"]
    finally:
        event.leave()
    raise AssertionError("the export never completed")


def a_chat(store: Store) -> tuple[str, int]:
    user = new_user()
    conversation = store.create_conversation(user, "Export me")
    store.add_message(user, conversation["id"], "user", "Keep this")
    return user, conversation["id"]


def test_many_exports_leave_no_folders_behind(app):
    user, conversation_id = a_chat(app.store)
    fn = export_event_index(app.url)
    before = files_under(app.uploads)

    for _ in range(25):
        files = export(app.url, fn, user, conversation_id)
    assert sorted(Path(f["path"]).suffix for f in files) == [".json", ".md"]
    markdown = next(f for f in files if f["path"].endswith(".md"))
    served = httpx.get(httpx.URL(app.url).join(markdown["url"]), timeout=30)
    assert served.status_code == 200 and "Keep this" in served.text

    left = sorted(path.name for path in app.temp.iterdir())
    assert left == [], f"{len(left)} entries left in the temporary folder after 25 exports: {left[:3]}"
    # Gradio keeps one copy per distinct file it has handed out: the same chat, the same two.
    assert len(files_under(app.uploads) - before) == 2


def test_the_files_gradio_handed_out_are_deleted_when_the_server_stops(tiny_model_dir, tmp_path):
    with served_page(tiny_model_dir, tmp_path) as app:
        user, conversation_id = a_chat(app.store)
        files = export(app.url, export_event_index(app.url), user, conversation_id)
        assert all(Path(f["path"]).exists() for f in files)
        uploaded = httpx.post(f"{app.url}gradio_api/upload", files={"files": ("chat.json", b"{}")}, timeout=60).json()
        assert Path(uploaded[0]).exists()
    assert files_under(app.uploads) == set()


# ---- per-session state ------------------------------------------------------------------------------
def rest_send(url: str, user: str, text: str) -> str:
    """A Send through Gradio's REST API (`/gradio_api/call/send`, as curl would): no browser
    session, so no event stream of the page's own. Returns the final event's name."""
    with httpx.Client(base_url=url, timeout=60) as http:
        posted = http.post("gradio_api/call/send", json={"data": [user, None, text, "None", "", 0.0, 1.0, 2]})
        posted.raise_for_status()
        event = None
        with http.stream("GET", f"gradio_api/call/send/{posted.json()['event_id']}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line.removeprefix("event:").strip()
                if event in ("complete", "error") and line.startswith("data:"):
                    json.loads(line.removeprefix("data:"))
                    return event
    raise AssertionError(f"the call ended without a result (last event {event!r})")


def test_calls_leave_no_session_state_behind(app):
    user = new_user()
    for i in range(60):
        assert rest_send(app.url, user, f"Call {i}") == "complete"
    # What the server does after a reply has been read, such as ending a closed stream, may take it a moment.
    wait_for(lambda: len(app.sessions) == 0, lambda: f"no session held; {len(app.sessions)} held after 60 REST calls")

    # As a browser calls (its own event stream), when each event has completed.
    send = fn_index(app.url, "send")
    for i in range(5):
        event = submit(app.url, send, [user, None, f"Browser call {i}", "None", "", 0.0, 1.0, 2])
        try:
            assert any(m.get("msg") == "process_completed" and m["success"] for m in event.messages())
        finally:
            event.leave()
    wait_for(lambda: len(app.sessions) == 0, lambda: f"no session held; {len(app.sessions)} held, no stream open")
