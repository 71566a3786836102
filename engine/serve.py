"""`python -m engine.serve`: the engine alone behind its OpenAI-compatible API, with uvicorn.

    python -m engine.serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m engine.serve --model path/to/llama --host 0.0.0.0 --api-key "$KEY"

Then any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=...)`.
On an address other than loopback the API needs a key (`--api-key` or $PAGEDCHAT_API_KEY), as
the chat app's does: an open engine on a network is anyone's.
"""
from __future__ import annotations

import argparse
import os

from fastapi import FastAPI

from engine.api import add_openai_api
from engine.api.access import is_loopback
from engine.client import EngineClient


def build_server(client: EngineClient, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The API over `client` as an app of its own."""
    app = FastAPI(title="PagedChat engine", docs_url=None, redoc_url=None)
    add_openai_api(app, client, model_name, api_key)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=env("MODEL"), help="hub id or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=env("PAGEDCHAT_API_KEY"), help="required Bearer token ($PAGEDCHAT_API_KEY)")
    parser.add_argument("--device", default=env("PAGEDCHAT_DEVICE"))
    parser.add_argument("--dtype", default=env("PAGEDCHAT_DTYPE", "auto"), help="auto, float32, bfloat16 or float16")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="device KV pool size in blocks")
    parser.add_argument("--num-cpu-blocks", type=int, default=None, help="host swap pool size in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests that may wait at once; beyond it 503 with Retry-After")
    args = parser.parse_args(argv)
    if not args.api_key and not is_loopback(args.host):
        parser.error(f"--host {args.host} is reachable from other machines: set --api-key (or $PAGEDCHAT_API_KEY)")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from engine.llm_engine import LLMEngine

    args = parse_args(argv)
    engine = LLMEngine(args.model, args.device, args.dtype, num_gpu_blocks=args.num_gpu_blocks,
                       num_cpu_blocks=args.num_cpu_blocks, max_num_seqs=args.max_num_seqs)
    client = EngineClient(engine, max_waiting=args.max_waiting)
    try:
        uvicorn.run(build_server(client, args.served_model_name, args.api_key), host=args.host, port=args.port,
                    log_level="warning")
    finally:
        client.close()


if __name__ == "__main__":
    main()
