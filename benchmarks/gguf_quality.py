"""A GGUF file served natively (its quantized weights multiplied as they are, activations rounded
to int8 per 32 as llama.cpp does) against the same file dequantized to float32 (the path that
equals transformers): how often the next-token choice agrees, and how many greedy replies are
the same.

- teacher-forced top-1 agreement: chat texts (the chat template around questions and answers
  written out) run through both models once; at every position, is the native model's most
  likely next token the dequantized one's? Positions where the dequantized model's top two are
  within 1e-3 of each other (a tie float noise decides) are counted apart. The texts run through
  the native model twice: as one prompt (its matmuls over many rows at a time) and one token a
  step, as a lone chat decodes (each matmul over one row: the few-row loops, qmatmul.c).
- greedy replies: each question answered by both engines, greedy, `--max-tokens` tokens; equal
  replies counted, and for the others the first token where they part.

    .venv/bin/python benchmarks/gguf_quality.py FILE.gguf [FILE.gguf ...] [--max-tokens 32]

Files default to the embedded SmolLM2 Q4_1. Prints a table per file, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: the repository root first (benchmarks/kernels.py shadows kernels)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about green tea.", "Explain paged attention in two sentences.",
    "How do I reverse a list in Python?", "What causes the seasons on Earth?", "Give me three tips for a job interview.",
    "Why is the sky blue?", "What is the difference between a virus and a bacterium?",
    "Summarise the plot of Romeo and Juliet.", "How does a hash table work?", "Name five prime numbers.",
    "What should I pack for a weekend hiking trip?", "Translate 'good morning' into Spanish and French.",
    "What is SQLite good for?", "Describe a cat to someone who has never seen one.", "How do vaccines work?",
]
ANSWERS = [
    "The capital of France is Paris, which is also its largest city.",
    "Steam over the cup, a quiet leaf unfolding, spring in a warm sip.",
    "Paged attention stores the key-value cache in fixed-size blocks, like pages of virtual memory. "
    "Requests then share and reuse blocks without copying, so many more chats fit in memory.",
    "Use my_list.reverse() to reverse it in place, or my_list[::-1] for a reversed copy.",
    "The seasons come from the tilt of Earth's axis: each hemisphere leans toward the Sun for part of the year.",
]


def chat_texts(tokenizer) -> list[list[int]]:
    """Token ids of conversations written out with the model's chat template: a question, its
    answer, a follow-up question."""
    texts = []
    for i, question in enumerate(QUESTIONS):
        answer = ANSWERS[i % len(ANSWERS)]
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                {"role": "user", "content": QUESTIONS[(i + 5) % len(QUESTIONS)]}]
        texts.append(encode_chat(tokenizer, chat))
    return texts


def encode_chat(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Float32 logits at every position of `ids`, one prefill through the engine's decoder
    (engine/worker/models/llama.LlamaModel) over a paged cache of its own."""
    from engine.worker.models.llama import AttentionMetadata

    n, device = len(ids), model.device
    blocks = -(-n // block_size)
    cache = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=model.dtype, device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
                             seqused_k=torch.tensor([n], dtype=torch.int32, device=device),
                             block_table=torch.arange(blocks, dtype=torch.int32, device=device)[None])
    model.rotary.ensure(n)
    positions = torch.arange(n, device=device)
    return model.forward(torch.tensor(ids, device=device), positions, cache, meta, positions).cpu()


@torch.inference_mode()
def stepwise_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """The same logits computed one token a step, each step one row through the decoder (a lone
    chat's decode: the native layers, where the model has them)."""
    from engine.worker.models.llama import AttentionMetadata

    n, device = len(ids), model.device
    blocks = -(-n // block_size)
    cache = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=model.dtype, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    model.rotary.ensure(n)
    rows = []
    for t in range(n):
        meta = AttentionMetadata(slot_mapping=torch.tensor([t], device=device),
                                 cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device),
                                 seqused_k=torch.tensor([t + 1], dtype=torch.int32, device=device), block_table=table)
        rows.append(model.forward(torch.tensor(ids[t:t + 1], device=device), torch.tensor([t], device=device),
                                  cache, meta, torch.tensor([0], device=device)).cpu())
    return torch.cat(rows)


def agreement(native: torch.Tensor, dense: torch.Tensor, tie: float = 1e-3) -> dict:
    """Top-1 agreement of two models' logits over the same positions."""
    top2 = dense.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tie
    same = native.argmax(-1) == dense.argmax(-1)
    return {"positions": len(same), "agree": int(same.sum()), "clear_positions": int(clear.sum()),
            "clear_agree": int((same & clear).sum())}


def decoder(path: str, quantization: str):
    from engine.worker.loading.model_loader import load_hf_model
    from engine.worker.models.llama import LlamaModel

    hf_model, tokenizer = load_hf_model(path, torch.float32, quantized=quantization == "native")
    return LlamaModel(hf_model, torch.float32, torch.device("cpu")), tokenizer


def measure(path: str, max_tokens: int, prompts: int | None = None, positions: int | None = None,
            stepwise_too: bool = True) -> dict:
    """Both comparisons for the file at `path`. `prompts`: how many of the chat texts and questions
    (all unless given); `positions`: each text cut to its first that many tokens; `stepwise_too`:
    also the one-token-a-step pass (its figures are None without it)."""
    from engine import LLM, SamplingParams
    from engine.worker.loading.gguf_file import inspect_gguf

    info = inspect_gguf(path)
    native, tokenizer = decoder(path, "native")
    dense, _ = decoder(path, "dequantize")
    texts = [ids[:positions] for ids in chat_texts(tokenizer)[:prompts]]
    totals = {"positions": 0, "agree": 0, "clear_positions": 0, "clear_agree": 0}
    stepwise = dict.fromkeys(totals, 0)
    for ids in texts:
        reference = teacher_forced_logits(dense, ids)
        for key, value in agreement(teacher_forced_logits(native, ids), reference).items():
            totals[key] += value
        if stepwise_too:
            for key, value in agreement(stepwise_logits(native, ids), reference).items():
                stepwise[key] += value
    del native, dense
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:prompts]]
    replies = {}
    for quantization in ("native", "dequantize"):
        llm = LLM(path, dtype="float32", quantization=quantization, compile_decode=False)
        replies[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        del llm
    equal = sum(a == b for a, b in zip(replies["native"], replies["dequantize"]))
    parted = sorted(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                    for a, b in zip(replies["native"], replies["dequantize"]) if a != b)
    return {"file": Path(path).name, "type": info.file_type, "parameters": info.num_parameters, **totals,
            "top1": totals["agree"] / totals["positions"], "top1_clear": totals["clear_agree"] / max(totals["clear_positions"], 1),
            "top1_stepwise": stepwise["agree"] / stepwise["positions"] if stepwise_too else None,
            "top1_stepwise_clear": stepwise["clear_agree"] / max(stepwise["clear_positions"], 1) if stepwise_too else None,
            "greedy_prompts": len(prompts), "greedy_equal": equal, "greedy_tokens": max_tokens,
            "first_difference_at": parted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    files = args.files
    if not files:
        from engine.worker.loading.embedded_model import embedded_gguf_path
        files = [embedded_gguf_path()]
    started = time.perf_counter()
    rows = [measure(path, args.max_tokens) for path in files]
    cpu = cpu_model()
    print(f"GGUF native against dequantized (float32), teacher-forced and greedy, on {cpu}")
    print(f"| file | type | positions | top-1 agree | top-1, clear winners | top-1, one token a step (clear) "
          f"| greedy replies equal ({args.max_tokens} tokens) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['type']} | {r['positions']} | {r['top1']:.2%} | {r['top1_clear']:.2%} "
              f"({r['clear_positions']}) | {r['top1_stepwise']:.2%} ({r['top1_stepwise_clear']:.2%}) "
              f"| {r['greedy_equal']} of {r['greedy_prompts']} "
              f"(others part at token {r['first_difference_at']}) |")
    print(json.dumps({"benchmark": "gguf_quality", "cpu": cpu, "seconds": round(time.perf_counter() - started, 1),
                      "results": rows}))


if __name__ == "__main__":
    main()
