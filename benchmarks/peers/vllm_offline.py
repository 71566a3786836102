"""vLLM CPU on the throughput workload, offline (`vllm.LLM`): start-up to first token, then all
chats at once, then one chat alone; greedy, EOS ignored. Run with the vLLM venv's python and the
environment `vllm_cpu.sh` sets (it prints nothing of ours: this file imports only vLLM):

    .venv/bin/python benchmarks/peers/workload.py /tmp/workload.json
    bash benchmarks/peers/vllm_cpu.sh run benchmarks/peers/vllm_offline.py /tmp/workload.json --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import platform
import time

STARTED = time.perf_counter()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return next(line.split(":", 1)[1].strip() for line in file if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    workload = json.load(open(args.workload))
    prompts = workload["prompts"]

    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=workload["model"], dtype=args.dtype, max_model_len=2048, enable_prefix_caching=True,
              max_num_seqs=64)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[-1])], SamplingParams(temperature=0, max_tokens=1))
    startup = time.perf_counter() - STARTED

    def timed(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == len(batch) * args.output_tokens, f"{tokens} tokens generated"
        return tokens / seconds

    many = timed(prompts)
    single = timed([prompts[0]])
    print(f"vLLM CPU, {cpu_model()}, {args.dtype}: start-up to first token {startup:.1f} s; "
          f"{len(prompts)} chats {many:.1f} tok/s; one chat {single:.1f} tok/s")
    print(json.dumps({"system": "vllm", "dtype": args.dtype, "cpu": cpu_model(), "startup_s": round(startup, 1),
                      "tok_s": round(many, 2), "single_tok_s": round(single, 2), "chats": len(prompts)}))


if __name__ == "__main__":
    main()
