"""The native row attention (engine/worker/models/layers/row_attention.py): every new token a row
over the paged cache with its own context. An fp32 engine's eager steps take it, decodes and
prompt chunks together; its greedy tokens are those of torch's attention and of transformers."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.worker.models.layers.row_attention import MAX_QUERY, row_inputs
from hf_reference import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_each_token_gets_its_sequences_table_and_its_own_context():
    table = torch.tensor([[4, 5, 0], [7, 8, 9]], dtype=torch.int32)
    tables, contexts = row_inputs([1, 3], [20, 35], table)
    assert tables.tolist() == [[4, 5, 0], [7, 8, 9], [7, 8, 9], [7, 8, 9]]
    assert contexts.tolist() == [20, 33, 34, 35]  # the chunk's tokens see up to themselves
    decodes, lengths = row_inputs([1, 1], [20, 35], table)
    assert decodes is table and lengths.tolist() == [20, 35]


def engine(model_dir: str, native: bool) -> tuple[LLM, list[str]]:
    """An fp32 engine whose prompts are chunked beside decodes, with or without the native
    attention, and the path of each step it runs."""
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks=96, num_cpu_blocks=16, compile_decode=False,
              max_num_batched_tokens=40, max_step_ms=None)
    runner = llm.engine.runner
    if not native:
        runner.model.row_attention = None
    paths = []
    execute = runner.execute

    def spy(out):
        sampled = execute(out)
        if out.scheduled:
            paths.append(runner.last_path)
        return sampled

    runner.execute = spy
    return llm, paths


def test_decodes_and_chunks_give_torch_attentions_tokens(tiny_model_dir, tokenizer):
    system = tokenizer("You are a careful assistant. Answer briefly and plainly. " * 3, add_special_tokens=False).input_ids
    questions = ["Why is the sky blue?", "Name a prime number larger than ten, please.", "Hello",
                 "What is a hobbit, and where does one live?"]
    prompts = [system + tokenizer(q, add_special_tokens=False).input_ids for q in questions]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 5, 20, 9)]
    native, paths = engine(tiny_model_dir, native=True)
    assert native.engine.runner.model.row_attention is not None
    ours = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    torch_attention, torch_paths = engine(tiny_model_dir, native=False)
    assert ours == [o.outputs[0].token_ids for o in torch_attention.generate(prompts, params)]
    assert set(paths) == {"eager-native"} and set(torch_paths) == {"eager"}


def test_greedy_tokens_are_transformers(tiny_model_dir, tiny_hf, tokenizer):
    llm, paths = engine(tiny_model_dir, native=True)
    texts = ["In a hole in the ground there lived a hobbit.", "The quick brown fox", "Paged attention keeps keys"]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(tiny_hf, p, 10) for p in prompts]
    assert set(paths) == {"eager-native"}


def test_a_chunk_longer_than_max_query_takes_torchs_attention(tiny_model_dir, tokenizer):
    llm, paths = engine(tiny_model_dir, native=True)
    llm.engine.core.scheduler.config.max_num_batched_tokens = 4 * MAX_QUERY
    long = tokenizer("word " * (2 * MAX_QUERY), add_special_tokens=False).input_ids
    llm.generate([long], SamplingParams(max_tokens=3, **GREEDY))
    assert paths[0] == "eager" and paths[1:] == ["eager-native"] * 2
