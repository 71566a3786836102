"""PagedChat's engine on the peers' workload file, measured as `vllm_offline.py` measures vLLM:
start-up to first token (from process start: imports, weights, first step), then all chats at
once, then one chat alone; greedy, EOS ignored, token ids as given. The compiled decode steps
(engine/worker/compiled/: a lone chat's and the flat step) load in the background after
start-up, or are built there the first time on a machine (~2.5 min): the chats are timed once
they are ready, and the time they were ready at is reported beside the start-up.

`--model` names another model than the embedded default: a GGUF file (compare.py --gguf) or a
transformers folder (--dense); `--dtype auto` is the engine's own choice, reported as the dtype
it ran. `--quantization native|dequantize|auto` is passed to `LLM` only when given (the engine's
default otherwise), and the JSON line says which the engine used (`quantization_used`).

    .venv/bin/python benchmarks/peers/engine_offline.py /tmp/workload.json [--dtype bfloat16]
        [--model FILE.gguf|FOLDER] [--quantization native]
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root (benchmarks/kernels.py shadows kernels)

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.peers.offline_run import measure_and_report, parse_args  # noqa: E402


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--model", default=None, help="GGUF file or model folder (default: the embedded SmolLM2)")
        parser.add_argument("--quantization", default=None, help="LLM's quantization option (not passed unless given)")

    args, workload = parse_args(__doc__, options)
    prompts = workload["prompts"]

    from engine import LLM, SamplingParams

    extra = {} if args.quantization is None else {"quantization": args.quantization}
    llm = LLM(args.model, dtype=args.dtype, **extra)
    dtype = str(llm.engine.dtype).removeprefix("torch.")  # what "auto" chose
    # native or dequantize, as the engine resolved the option (None on an engine without it)
    used = getattr(getattr(llm.engine, "core", None), "quantization", None)
    llm.generate([prompts[-1]], SamplingParams(temperature=0, max_tokens=1))
    startup = time.perf_counter() - STARTED
    compiled = llm.engine.compiled
    if compiled is not None and not compiled.wait():
        print(f"no compiled decode step: {compiled.error}", file=sys.stderr)
    ready = time.perf_counter() - STARTED
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    def generate(batch: list[list[int]]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]

    measure_and_report("engine", "PagedChat engine", dtype, cpu_model(), startup, generate, prompts,
                       args.output_tokens, extra={"model": args.model, "quantization": args.quantization, "quantization_used": used,
                                                  "compiled_ready_s": round(ready, 1),
                                                  "compiled": bool(compiled is not None and compiled.ready),
                                                  "compiled_flat": bool(compiled is not None and compiled.flat_ready)})

if __name__ == "__main__":
    main()
