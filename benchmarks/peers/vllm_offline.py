"""vLLM CPU on the throughput workload, offline (`vllm.LLM`): start-up to first token, then all
chats at once, then one chat alone; greedy, EOS ignored. Run with the vLLM venv's python and the
environment `vllm_cpu.sh` sets (of ours it imports only offline_run.py, standard library):

    .venv/bin/python benchmarks/peers/workload.py /tmp/workload.json
    bash benchmarks/peers/vllm_cpu.sh run benchmarks/peers/vllm_offline.py /tmp/workload.json --dtype bfloat16
"""
from __future__ import annotations

import platform
import time

from offline_run import measure_and_report, parse_args  # this folder: the script's own

STARTED = time.perf_counter()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return next(line.split(":", 1)[1].strip() for line in file if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    args, workload = parse_args(__doc__)
    prompts = workload["prompts"]

    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=workload["model"], dtype=args.dtype, max_model_len=2048, enable_prefix_caching=True,
              max_num_seqs=64)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[-1])], SamplingParams(temperature=0, max_tokens=1))
    startup = time.perf_counter() - STARTED

    def generate(batch: list[list[int]]) -> list[list[int]]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    measure_and_report("vllm", "vLLM CPU", args.dtype, cpu_model(), startup, generate, prompts, args.output_tokens)

if __name__ == "__main__":
    main()
