"""Decode steps through CudaGraphs: padded to a bucket, run from static buffers (and replayed
from CUDA graphs on a GPU). On a CPU the same padded path runs eagerly, which is what must give
exactly the outputs of the ordinary path."""
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.sampling_params import StructuredOutputsParams
from engine.worker.cuda_graphs import BUCKETS, TOKEN_BUCKETS, CudaGraphs, buckets_up_to

# Every engine here names its host pool: the default (1 GiB of swap space, 131k of the tiny model's
# blocks) costs ~0.6 s of CPU to allocate, per engine.
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "Water boils at", "Knock knock."]


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(5) == [1, 2, 4, 5]
    assert buckets_up_to(256) == list(BUCKETS)
    assert buckets_up_to(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert buckets_up_to(24, TOKEN_BUCKETS) == [24]
    assert buckets_up_to(2048, TOKEN_BUCKETS) == [64, 128, 256, 512, 1024, 2048]


def test_steps_longer_than_the_largest_token_bucket_run_eagerly(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks=16, num_cpu_blocks=16, cuda_graphs=True, max_num_batched_tokens=20_000,
              max_model_len=256)
    graphs = llm.engine.runner.graphs
    assert graphs.token_buckets[-1] == TOKEN_BUCKETS[-1] == graphs.max_tokens
    assert graphs.takes_flat(TOKEN_BUCKETS[-1], 4) and not graphs.takes_flat(TOKEN_BUCKETS[-1] + 1, 4)


def count_graph_runs(monkeypatch) -> list[int]:
    sizes: list[int] = []
    run = CudaGraphs.run
    monkeypatch.setattr(CudaGraphs, "run", lambda self, ids, *a: sizes.append(len(ids)) or run(self, ids, *a))
    return sizes


def outputs(llm: LLM, tokenizer, tokens: int = 14, texts: list[str] = PROMPTS) -> list:
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=3, max_tokens=tokens // 2 + 1, ignore_eos=True,
                            logprobs=2)
    outs = llm.generate(prompts, greedy) + llm.generate(prompts[:3], seeded)
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in outs]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_padded_decode_path_equals_the_ordinary_path(tiny_model_dir, tokenizer, monkeypatch, kernels):
    monkeypatch.setenv("PAGEDCHAT_KERNELS", kernels)
    # Triton's interpreter runs each step slowly: there, 3 greedy decode steps of 3 chats (padded
    # to a bucket of 4) and 2 seeded ones of 3 x 2 samples (padded to 8).
    tokens, texts = (14, PROMPTS) if kernels == "torch" else (4, PROMPTS[:3])
    plain = outputs(LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, cuda_graphs=False), tokenizer, tokens,
                    texts)
    sizes = count_graph_runs(monkeypatch)
    padded = outputs(LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, max_num_seqs=16, cuda_graphs=True),
                     tokenizer, tokens, texts)
    assert sizes and set(sizes) - set(BUCKETS), f"no decode batch needed padding: {sorted(set(sizes))}"
    assert_same(padded, plain)


def assert_same(got, want):
    """Same tokens; log-probabilities equal up to float noise (a padded batch multiplies its
    matrices in other shapes, which moves the last bits)."""
    assert [[tokens for tokens, _ in out] for out in got] == [[tokens for tokens, _ in out] for out in want]
    for out_got, out_want in zip(got, want):
        for (_, lp_got), (_, lp_want) in zip(out_got, out_want):
            assert (lp_got is None) == (lp_want is None)
            for step_got, step_want in zip(lp_got or [], lp_want or []):
                assert step_got.keys() == step_want.keys()
                assert all(abs(step_got[k] - step_want[k]) < 1e-4 for k in step_got)


def test_under_preemption_and_beyond_the_largest_bucket(tiny_model_dir, tokenizer, monkeypatch):
    """A small pool forces swaps and recomputes; decode batches above max_batch go the ordinary way."""
    prompts = [tokenizer(f"Story number {i}: once upon a time", add_special_tokens=False).input_ids
               for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(tiny_model_dir, num_gpu_blocks=256, num_cpu_blocks=64)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    sizes = count_graph_runs(monkeypatch)
    llm = LLM(tiny_model_dir, num_gpu_blocks=24, num_cpu_blocks=64, max_num_seqs=10, cuda_graphs=True)
    llm.engine.runner.graphs = CudaGraphs(llm.engine.model, llm.engine.runner.kv_cache, 4, 64, capture=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert sizes and max(sizes) <= 4
    assert llm.stats().num_preemptions_swap + llm.stats().num_preemptions_recompute > 0


def staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int = 3) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens, the prompts arriving one every `every` steps while the earlier
    ones decode: steps that carry prompt chunks beside decodes."""
    engine, tokens = llm.engine, {str(i): () for i in range(len(prompts))}
    waiting, step = list(enumerate(prompts)), 0
    while waiting or engine.has_unfinished():
        if waiting and step % every == 0:
            i, prompt = waiting.pop(0)
            engine.add_request(str(i), prompt, params)
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))]


def test_flattened_steps_of_chunks_beside_decodes_equal_the_ordinary_path(tiny_model_dir, tokenizer, monkeypatch):
    """Steps that mix prompt chunks (some past a cached shared prefix, some long enough to be
    split over steps) with decodes, padded to a token bucket: the tokens of the ordinary path.
    (The Triton path's refilled tile list: tests/test_triton_kernels.py, and the padded-decode
    test above, whose prompts take the flattened buckets under Triton's interpreter.)"""
    system = tokenizer("You are a terse assistant. Answer in one short sentence, plainly.",
                       add_special_tokens=False).input_ids
    prompts = [system + tokenizer(t, add_special_tokens=False).input_ids for t in PROMPTS]
    prompts.append(prompts[0] * 3)  # 3 chunks of at most 24 tokens, beside the others' decodes
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(num_gpu_blocks=64, num_cpu_blocks=64, block_size=16, max_num_batched_tokens=24)
    plain = staggered(LLM(tiny_model_dir, cuda_graphs=False, **options), prompts, params)
    steps: list[tuple[int, int]] = []
    run_flat = CudaGraphs.run_flat

    def record(self, ids, positions, slots, cu_q, *rest):
        steps.append((len(ids), sum(b - a == 1 for a, b in zip(cu_q, cu_q[1:]))))
        return run_flat(self, ids, positions, slots, cu_q, *rest)
    monkeypatch.setattr(CudaGraphs, "run_flat", record)
    llm = LLM(tiny_model_dir, cuda_graphs=True, max_num_seqs=8, **options)
    assert llm.engine.runner.graphs.token_buckets == [24]
    flat = staggered(llm, prompts, params)
    assert flat == plain
    assert any(decodes and tokens > decodes for tokens, decodes in steps), f"no chunk beside decodes: {steps}"
    assert any(tokens < 24 for tokens, _ in steps), f"no step needed padding: {steps}"
    assert sum(out.num_cached_tokens for out in llm.generate(prompts[1:2], params)) >= 16  # the shared prefix


def test_padding_rows_write_nothing_and_limits_are_checked(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks=16, num_cpu_blocks=64, cuda_graphs=True)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_batch == 256
    assert graphs.captured == llm.engine.runner.kv_cache.is_cuda  # captured on a GPU only
    cache = llm.engine.runner.kv_cache
    cache.normal_()
    before = cache.clone()
    # Three sequences in a bucket of 4: one new token each, at slots 5, 21 and 40.
    logits = graphs.run([11, 12, 13], [5, 5, 8], [5, 21, 40], [6, 6, 9], [[0], [1], [2]])
    assert logits.shape == (3, llm.engine.model.shape.vocab_size) and torch.isfinite(logits).all()
    changed = (cache != before).flatten(1).any(1).nonzero().flatten().tolist()  # per block
    assert changed == [0, 1, 2]
    written = (cache != before).any(-1).any(3).any(2).any(1)  # [block, slot]: the cache is [b, layer, 2, head, slot, d]
    assert written.nonzero().tolist() == [[0, 5], [1, 5], [2, 8]]  # (block, slot in block): nothing else
    with pytest.raises(ValueError, match="does not fit"):
        graphs.run([1] * 257, [0] * 257, [-1] * 257, [1] * 257, [[0]] * 257)
    with pytest.raises(ValueError, match="longer than"):
        graphs.run([1], [0], [0], [1], [[0] * (graphs.block_table.shape[1] + 1)])
    # A 3-token chunk (positions 0-2, block 3) beside one decode (position 9, block 2), flattened
    # and padded to a bucket of 64 tokens: its slots alone are written.
    before = cache.clone()
    logits = graphs.run_flat([7, 8, 9, 14], [0, 1, 2, 9], [48, 49, 50, 41], [0, 3, 4], [3, 10], [[3], [2]], [0, 1])
    assert logits.shape == (2, llm.engine.model.shape.vocab_size) and torch.isfinite(logits).all()
    written = (cache != before).any(-1).any(3).any(2).any(1)
    assert written.nonzero().tolist() == [[2, 9], [3, 0], [3, 1], [3, 2]]
    with pytest.raises(ValueError, match="does not fit"):
        graphs.run_flat([1] * 2049, list(range(2049)), [-1] * 2049, [0, 2049], [2049], [[0]], [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a GPU")
def test_captured_graphs_replay_the_eager_outputs(tiny_model_dir, tokenizer):
    eager = outputs(LLM(tiny_model_dir, device="cuda", num_gpu_blocks=64, num_cpu_blocks=64, cuda_graphs=False),
                    tokenizer)
    llm = LLM(tiny_model_dir, device="cuda", num_gpu_blocks=64, num_cpu_blocks=64, max_num_seqs=16,
              cuda_graphs=True)
    assert llm.engine.runner.graphs.captured
    assert_same(outputs(llm, tokenizer), eager)
    # Prompt chunks beside decodes, replayed from the flattened steps' graphs
    system = tokenizer("You are a terse assistant.", add_special_tokens=False).input_ids
    prompts = [system + tokenizer(t, add_special_tokens=False).input_ids for t in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", num_gpu_blocks=64, num_cpu_blocks=64, max_num_batched_tokens=24)
    eager = staggered(LLM(tiny_model_dir, cuda_graphs=False, **options), prompts, params)
    llm = LLM(tiny_model_dir, cuda_graphs=True, max_num_seqs=8, **options)
    paths = []
    step = llm.engine.core.step
    llm.engine.core.step = lambda: (step(), paths.append(llm.engine.runner.last_path))[0]
    assert staggered(llm, prompts, params) == eager
    assert "graphs-flat" in paths and "graphs" in paths and "eager" not in paths


def test_constrained_rows_in_a_padded_decode_batch(tiny_model_dir, tokenizer, monkeypatch):
    """Constrained and free chats in one padded batch: the constrained ones keep to their grammar and
    give the ordinary path's tokens; the free ones are untouched by their neighbours' masks."""
    sentence = StructuredOutputsParams(regex=r"[a-z]{4,12}( [a-z]{2,8}){2,3}\.")
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=sentence if i % 2 else None)
              for i in range(len(PROMPTS))]

    def run(llm):
        return [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    plain = run(LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, cuda_graphs=False))
    sizes = count_graph_runs(monkeypatch)
    padded = run(LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, max_num_seqs=16, cuda_graphs=True))
    assert sizes
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
    assert all(re.fullmatch(r"[a-z]{4,12}( [a-z]{2,8}){2,3}\.", o.text) for o in padded[1::2])
