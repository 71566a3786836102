"""`python -m engine.serve`: the engine alone behind its OpenAI-compatible API, with uvicorn.

    python -m engine.serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m engine.serve --model path/to/llama --host 0.0.0.0 --api-key "$KEY"
    python -m engine.serve --model bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M  # a GGUF from the hub

Then any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=...)`.
The engine core runs in a process of its own (engine/runtime/process_client.py), so the server's Python
never holds up a step; `--engine-in-process` runs it on a thread of this process instead.
On an address other than loopback the API needs a key (`--api-key` or $PAGEDCHAT_API_KEY), as
the chat app's does: an open engine on a network is anyone's. Without one it answers only requests
made on this machine: one through a reverse proxy here (it carries X-Forwarded-For) gets 401.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Callable

from fastapi import FastAPI

from engine.api import add_openai_api
from engine.api.access import is_loopback
from engine.core.block_hash import DEFAULT_HASH_ALGO, HASH_ALGOS
from engine.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_STEP_MS
from engine.runtime.streaming_client import StreamingClient
from engine.worker.loading.quantization_choice import QUANTIZATIONS


def build_server(client: StreamingClient, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The API over `client` as an app of its own."""
    app = FastAPI(title="PagedChat engine", docs_url=None, redoc_url=None)
    add_openai_api(app, client, model_name, api_key)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=env("MODEL"), help="hub id, folder, .gguf file or hub GGUF (user/repo:Q4_K_M) (default: SmolLM2-135M-Instruct)")
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
    parser.add_argument("--print-config", action="store_true",
                        help="print what the engine decides from these options and this machine (JSON), and exit")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if not args.api_key and not is_loopback(args.host):
        parser.error(f"--host {args.host} is reachable from other machines: set --api-key (or $PAGEDCHAT_API_KEY)")
    return args


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine serves: its step-time target, its prefix cache's hash and where it runs (the
    app takes them too)."""
    env = os.environ.get
    parser.add_argument("--max-step-ms", type=float, default=float(env("PAGEDCHAT_MAX_STEP_MS", DEFAULT_MAX_STEP_MS)),
                        help="step-time target: prompts are computed in chunks that keep every streaming reply's "
                             f"steps under it; 0 turns it off ($PAGEDCHAT_MAX_STEP_MS; default {DEFAULT_MAX_STEP_MS:g})")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=int(env("PAGEDCHAT_MAX_NUM_BATCHED_TOKENS", DEFAULT_MAX_NUM_BATCHED_TOKENS)),
                        help="the most tokens one step computes, prompt chunks and decodes together "
                             f"($PAGEDCHAT_MAX_NUM_BATCHED_TOKENS; default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-model-len", type=int, default=_optional_int(env("PAGEDCHAT_MAX_MODEL_LEN")),
                        help="the longest context, prompt and reply, a request may have ($PAGEDCHAT_MAX_MODEL_LEN; "
                             "default: the model's, or what the KV pool holds if less)")
    parser.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS,
                        default=env("PAGEDCHAT_PREFIX_CACHING_HASH_ALGO", DEFAULT_HASH_ALGO),
                        help="the prefix cache's block hash: xxh3 (fast, unkeyed) or sha256 (no collision can be "
                             "searched for, where users may attack each other) ($PAGEDCHAT_PREFIX_CACHING_HASH_ALGO; "
                             f"default {DEFAULT_HASH_ALGO})")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=env("PAGEDCHAT_QUANTIZATION", "auto"),
                        help="a GGUF file's quantized weights: native keeps them quantized and multiplies them "
                             "natively (CPU), dequantize makes them dense at load, auto picks native on a CPU for a "
                             "file 1 GiB or more dense ($PAGEDCHAT_QUANTIZATION; default auto)")
    parser.add_argument("--engine-in-process", action="store_true",
                        default=env("PAGEDCHAT_ENGINE_IN_PROCESS", "") not in ("", "0"),
                        help="run the engine on a thread of the server's process, not in a process of its own "
                             "($PAGEDCHAT_ENGINE_IN_PROCESS=1)")


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None


def start_engine(args: argparse.Namespace, max_waiting: int, **options) -> StreamingClient:
    """The engine client that `args` ask for: the engine core in its own process (the default)
    or on a thread of this one. `options`: more of the engine's."""
    return begin_engine(args, max_waiting, **options)()


def begin_engine(args: argparse.Namespace, max_waiting: int, **options) -> Callable[[], StreamingClient]:
    """`start_engine` in two halves: the engine core's process starts loading the model now, and
    what is returned finishes the client when called, so the caller's own start-up runs meanwhile."""
    options = {"num_gpu_blocks": args.num_gpu_blocks, "num_cpu_blocks": args.num_cpu_blocks,
               "max_step_ms": args.max_step_ms or None, "max_num_batched_tokens": args.max_num_batched_tokens,
               "max_model_len": args.max_model_len, "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
               "quantization": args.quantization, **options}
    if args.engine_in_process:
        from engine.runtime.thread_client import EngineClient
        from engine.runtime.llm_engine import LLMEngine

        threads = options.pop("num_threads", None)
        if threads:
            import torch
            torch.set_num_threads(threads)
        def finish() -> StreamingClient:
            engine = LLMEngine(args.model, args.device, args.dtype, **options)
            engine.core.load_compiled_steps_if_built()  # as the core's process does: before requests
            return EngineClient(engine, max_waiting=max_waiting)

        return finish
    from engine.runtime.process_client import CoreProcessClient

    return CoreProcessClient.starting(args.model, args.device, args.dtype, max_waiting=max_waiting, **options)


def freeze_startup_heap() -> None:
    """Move what start-up made (torch, the tokenizer, the app) out of the collector's reach: an
    oldest-generation collection then scans only what requests made since, where scanning the
    whole heap held up every stream for 20-140 ms (engine/runtime/core_process.py does the same)."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    client = start_engine(args, args.max_waiting, max_num_seqs=args.max_num_seqs)
    if args.print_config:
        try:
            print(json.dumps(client.info().config.as_dict(), indent=2))
        finally:
            client.close()
        return
    app = build_server(client, args.served_model_name, args.api_key)
    freeze_startup_heap()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        client.close()


if __name__ == "__main__":
    main()
