"""What the page's server keeps for whoever calls it, over real HTTP to the served app: an upload
over the import limit is refused as it arrives and nothing of it is kept, exports leave no
folders behind (and Gradio's copies go when the server stops), and the per-session state that
lets a reply stop when its browser leaves does not grow with every call. (The copy button's
hole is in the page: tests/test_browser.py.)"""
from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("gradio")
import httpx  # noqa: E402
from served_app import Served  # noqa: E402

from benchmarks.gradio_http import fn_index, submit  # noqa: E402
from storage import Store  # noqa: E402
from ui.conversation import MAX_IMPORT_BYTES  # noqa: E402
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
    from app import build_app, build_server
    from engine.client import EngineClient
    from engine.llm_engine import LLMEngine
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


def within(seconds: float, condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within `seconds` (what the server does after a reply has been
    read, such as ending a closed stream, may take it a moment)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
