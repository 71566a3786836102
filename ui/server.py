"""The app's HTTP server: the chat page at / and the engine panel at /panel (Gradio) around a
chat backend and a store, and the in-process engine's OpenAI-compatible API beside them.
`app.py` starts it; the tests and the soak benchmark serve it in their own process.
"""
from __future__ import annotations

import os
import warnings

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio.routes import App as GradioApp
from starlette.routing import Mount

from engine import StreamingClient, add_openai_api, is_loopback
from storage import Store
from ui import page_script, space
from ui.backends.backend import ChatBackend
from ui.chat import build_chat
from ui.chat_input import MAX_IMPORT_BYTES
from ui.panel.feed import PanelFeed
from ui.panel.load_generator import LoadGenerator
from ui.panel.page import build_panel
from ui.sessions import Sessions, SessionWatch


SHUTDOWN_GRACE_S = 5


def build_app(backend: ChatBackend, store: Store, feed: PanelFeed | None = None,
              load: LoadGenerator | None = None, host: str | None = None,
              sessions: Sessions | None = None) -> gr.Blocks:
    """The whole app around a backend (ui/backends: the in-process engine or remote servers)
    and a store, queued but not launched: the chat at / and the engine panel at /panel. `feed`
    and `load` watch and drive an in-process engine (the panel's detail and load generator);
    the caller stops them. `host`: the address it will be launched on (default: Gradio's,
    $GRADIO_SERVER_NAME or 127.0.0.1); on a loopback address whoever reaches the app may run
    the load generator. `sessions`: the ones `build_server` watches, so that a reply whose
    browser disconnects is cancelled at once (see ui/sessions.py)."""
    if feed is not None:
        feed.start()
    demo = build_chat(backend, store, sessions)
    with demo.route("Engine panel", "panel"):
        build_panel(backend, feed, load, host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    # Streaming events set concurrency_limit=None themselves; the rest (storage calls) are quick.
    demo.queue(default_concurrency_limit=64)
    quiet_queue(demo)
    return demo


# Gradio's queue looks for new events every millisecond, and for progress to send every 10 ms:
# ~1,100 wake-ups a second, 7% of a core on a 2-core CPU with nothing to do, and each one takes a
# core from the engine's threads mid-step. Every 10 ms (and progress, which we never report,
# every 0.5 s) costs a new event at most 10 ms before it starts.
QUEUE_POLL_S = 0.01
PROGRESS_POLL_S = 0.5


def quiet_queue(demo: gr.Blocks) -> None:
    queue = demo._queue  # no public setting for these (Gradio 6)
    queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, PROGRESS_POLL_S)


def build_server(demo: gr.Blocks, client: StreamingClient | None, sessions: Sessions, host: str,
                 api_key: str | None = None) -> FastAPI:
    """The HTTP server: the in-process engine's OpenAI-compatible API (when there is one and
    `api_enabled`) at /v1, /metrics, /health, /tokenize and /detokenize, and the Gradio app at /
    (its routes come after the API's)."""
    server = FastAPI(title="PagedChat", docs_url=None, redoc_url=None)
    server.add_middleware(SessionWatch, sessions=sessions)
    if client is not None and api_enabled(host, api_key):
        add_openai_api(server, client, api_key=api_key)
    with warnings.catch_warnings():
        # Gradio warns that SSR is off for a multi-page app; it is off by our choice anyway.
        warnings.filterwarnings("ignore", message="SSR mode is not supported", category=UserWarning)
        # Gradio refuses a larger upload (413) as it streams in, and deletes what it had written;
        # the only upload the page takes is a chat to import.
        return gr.mount_gradio_app(server, demo, path="/", ssr_mode=False, head=page_script.HEAD, css=page_script.CSS,
                                   max_file_size=MAX_IMPORT_BYTES)


class AppServer(uvicorn.Server):
    """uvicorn's server that, when shutdown begins, ends the event streams each open page holds
    (Gradio's session heartbeats never end on their own): otherwise uvicorn waits out the whole
    grace period for them and then cancels them, logging a traceback for each."""

    async def shutdown(self, sockets=None) -> None:
        for route in self.config.app.routes:
            if isinstance(route, Mount) and isinstance(route.app, GradioApp):
                route.app.stop_event.set()
        await super().shutdown(sockets)


def api_enabled(host: str, api_key: str | None) -> bool:
    """The API is served with a key, or without one only where nobody else can reach it; even
    then each request must prove it was made on this machine (engine/api/access.py)."""
    return bool(api_key) or (is_loopback(host) and not space.on_space())
