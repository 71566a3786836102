"""Throughput: PagedChat's engine against transformers on one chat workload, plus prefix-caching TTFT.

Workload: 32 chats that share one ~200-token system prompt, each with its own user question
(10-30 tokens), rendered with the model's chat template; 128 output tokens each, greedy, EOS
ignored. Systems, all from one run, same weights (SmolLM2-135M-Instruct) and dtype:

  (a) transformers `generate`, one chat at a time (a subset of the chats, reported as tokens/s)
  (b) transformers `generate`, one left-padded batch of all 32
  (c) transformers continuous batching, `model.generate_batch` (default attention, sdpa on CPU)
  (d) our engine, all 32 submitted in one `LLM.generate` call

Also measured in the same run: the machine's matmul roofline (best of large square matmuls on
all cores) and our engine's share of it, 2 * parameters * tokens/s / measured FLOP/s; and the
time to first token of a new chat whose ~1,000-token system prompt is already in the prefix
cache, against the same with prefix caching off (median of 3).

    .venv/bin/python benchmarks/throughput.py [--dtype bfloat16] [--sequential-chats 4] [--skip-engine]

Prints a table, the TTFT lines, then one JSON line of the figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch

from engine.model_loader import load_hf_model

NUM_CHATS = 32
OUTPUT_TOKENS = 128
LONG_SYSTEM_TOKENS = 1000
# A budget like the engine's: KV room for every chat at once, 2,048 tokens per step, 64 sequences.
MAX_NUM_SEQS = 64
MAX_BATCH_TOKENS = 2048

SYSTEM_PROMPT = (
    "You are Pagey, the assistant inside PagedChat, a chat app that runs its own small language model. "
    "Answer the user's questions clearly, accurately and kindly. Keep answers short by default: a few "
    "sentences or a brief list, unless the user asks for more detail. When a question is ambiguous, state "
    "the most likely reading and answer it, then offer to cover the other. When you are not sure of a fact, "
    "say so plainly instead of guessing, and suggest where the user could check it. For code, give a small "
    "working example in a fenced block with the language named, and explain only the parts that are not "
    "obvious. For math, show the key steps and put the final result on its own line. Use plain words rather "
    "than jargon, and define any technical term the first time you use it. Never invent quotes, citations, "
    "prices or statistics. Refuse requests that are harmful or illegal, briefly and without lecturing. Do "
    "not mention these instructions unless the user asks how you were set up."
)  # 207 tokens

QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "How do I reverse a string in JavaScript?",
    "Can you explain what a hash table is and why lookups are fast?",
    "What causes the seasons on Earth, and why are they reversed in the southern hemisphere?",
    "Give me three tips for writing a good cover letter.",
    "How does compound interest work? Please include a short example with numbers.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "How do I center a div horizontally and vertically with CSS?",
    "Explain recursion to a ten-year-old who likes building with Lego.",
    "What is the difference between TCP and UDP, and when would I pick each one?",
    "How many minutes should I boil an egg for a soft yolk?",
    "Write a haiku about autumn rain falling on an empty city street.",
    "What does the git rebase command do, and when should I avoid it?",
    "Why is the sky blue during the day but red and orange at sunset?",
    "How can I improve my sleep if I keep waking up at 3 a.m.?",
    "What is a closure in programming? Show me a tiny example in Python.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the derivative of x squared times sine of x?",
    "How do vaccines train the immune system to recognize a virus it has never seen?",
    "Suggest a simple vegetarian dinner I can cook in twenty minutes.",
    "What is the difference between weather and climate, in simple terms?",
    "How do I read a CSV file with pandas and print the first five rows?",
    "What are prime numbers, and is 91 prime?",
    "Explain what a SQL JOIN does with a small example.",
    "How does a refrigerator keep food cold when the room around it is warm?",
    "What is the best way to learn a new language as an adult?",
    "Why do cats purr, and does purring always mean that they are happy?",
    "What is Big O notation and what does O(n log n) mean?",
    "How do solar panels turn sunlight into electricity, and why do they lose efficiency in heat?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "What is the difference between RAM and storage on a laptop?",
    "Can you explain what inflation is and what usually causes it?",
]  # 10-18 tokens each

# Appended to SYSTEM_PROMPT, cycling, until the long system prompt reaches LONG_SYSTEM_TOKENS.
HANDBOOK = [
    "Formatting: use Markdown. Use headings only for answers longer than three paragraphs. Prefer numbered "
    "lists for steps that must happen in order and bullet lists for everything else.",
    "Tone: be warm but not gushing. Do not open with praise of the question. Do not apologize unless you "
    "made a mistake, and when you did, say what was wrong and give the corrected answer.",
    "Safety: for medical, legal or financial questions, give general information, say that it is not "
    "professional advice, and suggest seeing a qualified person when the stakes are high.",
    "Privacy: never ask for passwords, card numbers or other secrets. If the user shares one, tell them to "
    "change it and do not repeat it back.",
    "Languages: answer in the language the user writes in. If they mix languages, use the one most of the "
    "message is written in, and keep code identifiers and commands unchanged.",
    "Length: if the user asks for a specific length, such as one sentence or three bullet points, follow it "
    "exactly even if you think more would help.",
]


# ----------------------------------------------------------------------------- workload


def chat_prompt(tokenizer, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def long_system_prompt(tokenizer, target: int = LONG_SYSTEM_TOKENS) -> str:
    """SYSTEM_PROMPT followed by numbered handbook notes, until it is at least `target` tokens."""
    text, i = SYSTEM_PROMPT, 0
    while num_tokens(tokenizer, text) < target:
        text += f"\n\nNote {i + 1}. {HANDBOOK[i % len(HANDBOOK)]}"
        i += 1
    return text


# ----------------------------------------------------------------------------- roofline


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, tries: int = 5) -> float:
    """Best FLOP/s over `tries` timings of `repeats` n x n @ n x n matmuls, on all of torch's threads."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 2 * n ** 3 / best


class OtherLoad:
    """Share of the machine's CPU time that other processes (and the hypervisor) took since construction.
    This benchmark needs every core: one busy neighbour slows torch's parallel regions many times over."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def share(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall, busy, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / (wall * os.cpu_count()))


# ----------------------------------------------------------------------------- systems


def result(seconds: float, generated: list[list[int]], chats: int, note: str = "") -> dict:
    tokens = sum(len(g) for g in generated)
    expected = chats * OUTPUT_TOKENS
    if tokens != expected:
        note = f"{note}; {tokens} of {expected} tokens generated".lstrip("; ")
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "chats": chats,
            "outputs": generated, "note": note}


def hf_greedy_config(max_new_tokens: int = OUTPUT_TOKENS) -> dict:
    # min_new_tokens = max_new_tokens keeps EOS from being sampled: every chat produces exactly that many.
    return dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)


def hf_sequential(model, prompts: list[list[int]], num_chats: int) -> dict:
    """(a) `generate` on one chat at a time, over the first `num_chats` chats."""
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **hf_greedy_config(4))  # warm-up
        generated = []
        t0 = time.perf_counter()
        for prompt in prompts[:num_chats]:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 **hf_greedy_config())
            generated.append(out[0, len(prompt):].tolist())
        seconds = time.perf_counter() - t0
    return result(seconds, generated, num_chats, f"timed on {num_chats} of {len(prompts)} chats")


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_batch(model, prompts: list[list[int]], pad_id: int) -> dict:
    """(b) `generate` on one left-padded batch of every chat."""
    ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        model.generate(ids[:4], attention_mask=mask[:4], pad_token_id=pad_id, **hf_greedy_config(2))  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, pad_token_id=pad_id, **hf_greedy_config())
        seconds = time.perf_counter() - t0
    generated = out[:, ids.shape[1]:].tolist()
    return result(seconds, generated, len(prompts), f"padded to {ids.shape[1]} prompt tokens")


def hf_generate_batch(model, prompts: list[list[int]], warmup_prompt: list[int], pad_id: int) -> dict:
    """(c) transformers continuous batching: `generate_batch`, with its default attention and a budget like ours."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    max_len = max(len(p) for p in prompts) + OUTPUT_TOKENS
    cb_config = ContinuousBatchingConfig(
        num_blocks=NUM_CHATS * -(-max_len // 256),  # room for every chat at once, in default 256-token pages
        max_batch_tokens=MAX_BATCH_TOKENS, max_requests_per_batch=MAX_NUM_SEQS)
    # eos_token_id=-1 disables EOS (generate_batch has no min_new_tokens): every chat runs to max_new_tokens.
    gen_config = GenerationConfig(max_new_tokens=OUTPUT_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    kwargs = dict(generation_config=gen_config, continuous_batching_config=cb_config, persistent_manager=True)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "the manager will be kept alive"
    # generate_batch runs the model on its own thread under torch.no_grad (inference_mode is thread-local).
    # Warm-up on an unrelated prompt; the persistent manager (cache, threads) is reused by the timed call.
    model.generate_batch([warmup_prompt], max_new_tokens=2, **kwargs)
    try:
        t0 = time.perf_counter()
        outputs = model.generate_batch(prompts, **kwargs)
        seconds = time.perf_counter() - t0
    finally:
        model.destroy_cached_continuous_batching_manager()
    generated = [o.generated_tokens for o in outputs.values()]  # in input order
    failed = sum(o.error is not None for o in outputs.values()) + len(prompts) - len(outputs)
    note = f"{model.config._attn_implementation}, page 256"
    return result(seconds, generated, len(prompts), note + (f"; {failed} failed" if failed else ""))


def make_llm(dtype: str, prefix_caching: bool = True):
    from engine import LLM
    return LLM(model=None, dtype=dtype, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCH_TOKENS,
               enable_prefix_caching=prefix_caching)


def engine_generate(llm, prompts: list[list[int]], max_tokens: int):
    from engine import SamplingParams
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def engine_throughput(llm, prompts: list[list[int]], warmup_prompt: list[int]) -> dict:
    """(d) our engine, every chat submitted in one `generate` call."""
    engine_generate(llm, [warmup_prompt], 4)  # warm-up, on an unrelated prompt (its blocks share nothing)
    t0 = time.perf_counter()
    outs = engine_generate(llm, prompts, OUTPUT_TOKENS)
    seconds = time.perf_counter() - t0
    generated = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens for o in outs)
    return result(seconds, generated, len(prompts), f"{cached} prompt tokens from the prefix cache")


def engine_ttft(llm, warm_prompt: list[int], timed_prompts: list[list[int]], unrelated_prompt: list[int]) -> float:
    """Median wall time of a 1-token generate for each of `timed_prompts`, after `warm_prompt` ran once."""
    engine_generate(llm, [unrelated_prompt], 1)  # one-time costs
    engine_generate(llm, [warm_prompt], 1)  # puts the shared system prompt in the prefix cache (when on)
    times = []
    for prompt in timed_prompts:  # a different question each time, so only the system prompt is shared
        t0 = time.perf_counter()
        engine_generate(llm, [prompt], 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- report


def matching_chats(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def print_table(rows: list[tuple[str, dict | None]], engine: dict | None) -> None:
    print(f"{'system':<44} {'tok/s':>8} {'ours vs it':>10}  notes")
    for name, r in rows:
        if r is None:
            print(f"{name:<44} {'-':>8} {'-':>10}  skipped")
            continue
        ratio = f"{engine['tok_s'] / r['tok_s']:9.2f}x" if engine else f"{'-':>10}"
        print(f"{name:<44} {r['tok_s']:8.1f} {ratio}  {r['note']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--sequential-chats", type=int, default=4, help="chats timed one at a time in (a)")
    parser.add_argument("--skip-engine", action="store_true", help="run only the transformers systems")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if not args.skip_engine:
        from engine import LLM  # noqa: F401  (fail now, not after the transformers runs)

    model, tokenizer = load_hf_model(None, dtype=dtype)
    num_parameters = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    prompts = [chat_prompt(tokenizer, SYSTEM_PROMPT, q) for q in QUESTIONS[:NUM_CHATS]]
    warmup_prompt = chat_prompt(tokenizer, "You are a terse assistant.", "Say hello.")
    long_system = long_system_prompt(tokenizer)
    long_prompts = [chat_prompt(tokenizer, long_system, q) for q in QUESTIONS[:4]]
    lens = [len(p) for p in prompts]
    print(f"{NUM_CHATS} chats, system prompt {num_tokens(tokenizer, SYSTEM_PROMPT)} tokens, prompts "
          f"{min(lens)}-{max(lens)} tokens, {OUTPUT_TOKENS} output tokens each, greedy, EOS ignored; "
          f"{args.dtype}, {num_parameters / 1e6:.1f}M parameters, {torch.get_num_threads()} threads\n")

    others = OtherLoad()
    flops = measure_matmul_flops(dtype)
    seq = hf_sequential(model, prompts, args.sequential_chats)
    batch = hf_batch(model, prompts, tokenizer.pad_token_id)
    cb = hf_generate_batch(model, prompts, warmup_prompt, tokenizer.pad_token_id)
    del model

    ours = ttft_cached = ttft_uncached = None
    if not args.skip_engine:
        llm = make_llm(args.dtype, prefix_caching=True)
        ours = engine_throughput(llm, prompts, warmup_prompt)
        ours["note"] += (f"; greedy outputs equal to (a) on {matching_chats(ours['outputs'], seq['outputs'])}"
                         f"/{seq['chats']} chats")
        ttft_cached = engine_ttft(llm, long_prompts[0], long_prompts[1:], warmup_prompt)
        del llm
        llm = make_llm(args.dtype, prefix_caching=False)
        ttft_uncached = engine_ttft(llm, long_prompts[0], long_prompts[1:], warmup_prompt)
        del llm

    others_share = others.share()
    print_table([("(a) transformers generate, one chat at a time", seq),
                 ("(b) transformers generate, batch of 32", batch),
                 ("(c) transformers generate_batch (CB)", cb),
                 ("(d) PagedChat engine, 32 at once", ours)], ours)
    share = 2 * num_parameters * ours["tok_s"] / flops if ours else None
    print(f"\nmatmul roofline ({args.dtype}, 2048^3, best of 5): {flops / 1e9:.1f} GFLOP/s"
          + (f"; engine at {2 * num_parameters * ours['tok_s'] / 1e9:.1f} GFLOP/s = {share:.1%} of it" if ours else ""))
    if ours:
        print(f"TTFT, new chat with a cached {num_tokens(tokenizer, long_system)}-token system prompt "
              f"({len(long_prompts[1])}-token prompt), median of 3: {ttft_cached * 1e3:.1f} ms")
        print(f"TTFT, same with prefix caching off, median of 3: {ttft_uncached * 1e3:.1f} ms "
              f"({ttft_uncached / ttft_cached:.1f}x)")

    if others_share is not None and others_share > 0.05:
        print(f"WARNING: other processes used {others_share:.0%} of this machine's CPU during the run: "
              "these figures are unreliable (torch's threads stall when a core is taken); rerun on a quiet machine")

    def tok_s(r: dict | None) -> float | None:
        return round(r["tok_s"], 2) if r else None

    def ratio(r: dict) -> float | None:
        return round(ours["tok_s"] / r["tok_s"], 3) if ours else None

    print(json.dumps({
        "engine_tok_s": tok_s(ours), "hf_sequential_tok_s": tok_s(seq), "hf_batch_tok_s": tok_s(batch),
        "hf_generate_batch_tok_s": tok_s(cb),
        "engine_vs_hf_batch": ratio(batch), "engine_vs_hf_generate_batch": ratio(cb),
        "engine_vs_hf_sequential": ratio(seq),
        "roofline_share": round(share, 4) if share is not None else None,
        "ttft_cached_s": round(ttft_cached, 4) if ours else None,
        "ttft_uncached_s": round(ttft_uncached, 4) if ours else None,
        "measured_gflops": round(flops / 1e9, 1), "dtype": args.dtype, "num_parameters": num_parameters,
        "other_processes_cpu_share": round(others_share, 3) if others_share is not None else None,
        "chats": NUM_CHATS, "output_tokens": OUTPUT_TOKENS, "hf_sequential_chats_timed": seq["chats"],
    }))


if __name__ == "__main__":
    main()
