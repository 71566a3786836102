"""The flat step (engine/worker/compiled/flat_step.py, fed by engine/worker/flat_batch.py): a step of
any mix of prompt chunks and decodes as one batch gives the tokens of the separate paths. Here it
runs as the torch module its package is compiled from, installed where the engine would load the
package; tests/test_compiled_decode.py runs the compiled package on the real model's weights."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.compiled.steps import CompiledSteps
from engine.worker.flat_batch import FlatSequence, flat_batch
from engine.worker.compiled.flat_step import FlatStep
from hf_reference import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 16


def flat_engine(model_dir: str, **options) -> tuple[LLM, list[tuple[int, int, int]]]:
    """An fp32 engine whose steps (but a lone chat's decode) go through the flat step, and the
    shape of each flat step it runs: (decodes, prompt chunks, chunks with a cached past)."""
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks=96, num_cpu_blocks=16, compile_decode=False, **options)
    core = llm.engine.core
    compiled = CompiledSteps(model_dir, torch.float32, core.model, ("flat",))
    compiled.install("flat", FlatStep(core.model).eval())
    core.runner.compiled = compiled
    shapes = []
    run_flat = compiled.run_flat

    def spy(sequences, *args):
        chunks = [s for s in sequences if len(s.tokens) > 1]
        shapes.append((len(sequences) - len(chunks), len(chunks), sum(s.start > 0 for s in chunks)))
        return run_flat(sequences, *args)

    compiled.run_flat = spy
    return llm, shapes


def eager_engine(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", num_gpu_blocks=96, num_cpu_blocks=16, compile_decode=False, **options)


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_mixed_steps_give_the_separate_paths_tokens(tiny_model_dir, tokenizer):
    """Prompts chunked by a small token budget run beside the decodes of earlier ones: steps with
    decodes and chunks, chunks with a past in the cache (a shared system prompt hit, a prompt's
    later chunk), prompts alone. Greedy tokens equal the eager engine's."""
    system = tokenizer("You are a careful assistant. Answer briefly and plainly. " * 3, add_special_tokens=False).input_ids
    assert len(system) >= 2 * BLOCK
    questions = ["Why is the sky blue?", "Name a prime number larger than ten, please.", "Hello",
                 "What is a hobbit, and where does one live?", "Count to five."]
    prompts = [system + tokenizer(q, add_special_tokens=False).input_ids for q in questions]
    prompts.append(tokenizer("A prompt of its own, sharing nothing with the others at all. " * 2,
                             add_special_tokens=False).input_ids)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 5, 20, 9, 14, 7)]
    options = dict(max_num_batched_tokens=40, max_step_ms=None)
    flat, shapes = flat_engine(tiny_model_dir, **options)
    assert tokens_of(flat, prompts, params) == tokens_of(eager_engine(tiny_model_dir, **options), prompts, params)
    assert any(d and c for d, c, _ in shapes), shapes          # decodes beside prompt chunks
    assert any(cached for _, _, cached in shapes), shapes      # chunks past a cached prefix or an earlier chunk
    assert any(not d and c for d, c, _ in shapes), shapes      # prompts alone
    assert any(d > 1 and not c for d, c, _ in shapes), shapes  # decodes alone


def test_mixed_steps_give_transformers_greedy_tokens(tiny_model_dir, tiny_hf, tokenizer):
    """Requests that arrive while others decode: each reply is transformers' greedy one."""
    flat, shapes = flat_engine(tiny_model_dir, max_num_batched_tokens=24, max_step_ms=None)
    engine = flat.engine
    texts = ["In a hole in the ground there lived a hobbit.", "The quick brown fox", "Paged attention keeps keys"]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    expected = [hf_greedy(tiny_hf, p, 10) for p in prompts]
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=10, **GREEDY))
    outputs: dict[str, list[int]] = {}
    added = 1
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        if added < len(prompts):  # the next arrives while the earlier ones decode
            engine.add_request(f"r{added}", prompts[added], SamplingParams(max_tokens=10, **GREEDY))
            added += 1
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert any(d and c for d, c, _ in shapes), shapes


def test_stand_in_rows_are_neither_stored_nor_sampled():
    """A step without decodes (or without chunks) carries one stand-in row in that group: its
    K/V is not stored and no logits row is its."""
    rotary = torch.zeros(64, 2, 4)
    chunk = FlatSequence([7, 8, 9], 16, [3, 5], True)
    only_chunks = flat_batch([chunk], BLOCK, rotary)
    assert only_chunks.stored_rows.tolist() == [1, 2, 3]  # row 0: the stand-in decode
    assert only_chunks.blocks.tolist() == [5, 5, 5] and only_chunks.offsets.tolist() == [0, 1, 2]
    assert only_chunks.layout[-1].tolist() == [3]  # the chunk's last token samples
    decode = FlatSequence([4], 17, [3, 5], True)
    quiet = FlatSequence([4], 20, [3, 6], False)
    only_decodes = flat_batch([quiet, decode], BLOCK, rotary)
    assert only_decodes.stored_rows.tolist() == [0, 1]  # row 2: the stand-in chunk
    assert only_decodes.blocks.tolist() == [6, 5] and only_decodes.offsets.tolist() == [4, 1]
    assert only_decodes.layout[-1].tolist() == [1]
