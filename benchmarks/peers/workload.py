"""Writes the throughput workload's token ids to a JSON file, so a peer engine in another
virtualenv is fed exactly what ours is (benchmarks/throughput.py: chats sharing a 207-token
system prompt, each with its own question, SmolLM2's chat template applied).

    .venv/bin/python benchmarks/peers/workload.py /tmp/workload.json [--chats 32]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root (benchmarks/kernels.py shadows kernels)

from benchmarks.throughput import NUM_CHATS, SYSTEM_PROMPT, chat_prompt, questions  # noqa: E402


def write_workload(output: Path, chats: int = NUM_CHATS) -> list[list[int]]:
    """Writes the workload of `chats` chats to `output`; returns its prompts' token ids."""
    from engine.worker.loading.model_files import resolve_model
    from engine.worker.loading.model_loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    prompts = [chat_prompt(tokenizer, SYSTEM_PROMPT, q) for q in questions(chats)]
    Path(output).write_text(json.dumps({"model": resolve_model(None), "prompts": prompts}))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output")
    parser.add_argument("--chats", type=int, default=NUM_CHATS)
    args = parser.parse_args()
    from engine.worker.loading.model_files import resolve_model

    prompts = write_workload(Path(args.output), args.chats)
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, {min(lengths)}–{max(lengths)} tokens, model {resolve_model(None)}")
    print(json.dumps({"chats": len(prompts), "min_tokens": min(lengths), "max_tokens": max(lengths)}))


if __name__ == "__main__":
    main()
