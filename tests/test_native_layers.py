"""engine/worker/quantized/native_layers.py: a batch of decoding tokens (a lone chat's, several
chats') through every layer in one native call computes what the eager forward computes over the
same quantized weights, reading and writing the same paged cache; the engine takes it for every
step whose sequences each compute one token; models it cannot serve keep the eager forward."""
from __future__ import annotations

import pytest
import torch
from gguf.quants import dequantize, quantize

import kernels
from engine import LLM, SamplingParams
from engine.worker.loading.gguf_file import load_model
from engine.worker.models.llama import NATIVE_QUERY_TOKENS, NATIVE_STEP_TOKENS, AttentionMetadata, LlamaModel
from engine.worker.quantized.native_layers import NativeLayers
from tests.test_gguf_file import T, tiny_llama_tensors, write_gguf

BLOCK_SIZE = 4
# Every layer matrix kept quantized, in three formats (the tiny model's rows are 64 or 128 wide:
# too short for the K-quants' 256), and the embedding, which is also the (tied) output head.
FORMATS = {"attn_q": T.Q8_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
           "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}


@pytest.fixture(scope="module")
def all_quantized_gguf(tmp_path_factory, tiny_hf) -> str:
    return quantized_gguf(tmp_path_factory.mktemp("lone") / "tiny-all-quantized.gguf", tiny_hf, FORMATS)


@pytest.fixture(scope="module")
def dense_head_gguf(tmp_path_factory, tiny_hf) -> str:
    """The layers quantized, the embedding and head (tied) in F32: the head then runs in torch."""
    formats = {kind: qtype for kind, qtype in FORMATS.items() if kind != "token_embd"}
    return quantized_gguf(tmp_path_factory.mktemp("lone") / "tiny-dense-head.gguf", tiny_hf, formats)


def quantized_gguf(path, tiny_hf, formats: dict) -> str:
    """The tiny model with each tensor of a kind in `formats` in that type, the embedding in F32
    when it is not among them, the rest as `tiny_llama_tensors` writes them."""
    tensors = []
    for name, array, qtype in tiny_llama_tensors(tiny_hf):
        kind = name.split(".")[-2]
        dense = dequantize(array, qtype) if qtype != T.F32 else array  # the HF weights' float copy
        if kind in formats:
            array, qtype = quantize(dense, formats[kind]), formats[kind]
        elif kind == "token_embd":
            array, qtype = dense, T.F32
        tensors.append((name, array, qtype))
    return write_gguf(path, "llama", tensors, file_type=7)


def native_model(path: str, config) -> LlamaModel:
    return LlamaModel(load_model(path, config, torch.float32, quantized=True), torch.float32, torch.device("cpu"))


def dequantized_model(path: str, config) -> LlamaModel:
    return LlamaModel(load_model(path, config, torch.float32), torch.float32, torch.device("cpu"))


def decode_logits(model: LlamaModel, sequences: list[list[int]], prompts: list[int],
                  native: NativeLayers | None, shared: int = 0, sampled: list[int] | None = None) -> torch.Tensor:
    """Logits `[steps, sequences, vocab]` of each sequence's tokens after its prompt (its first
    `prompts[i]`, prefilled alone), the sequences decoding together one token each a step, over a
    paged cache whose blocks are out of order, with `native` as the model's native decode. The
    sequences' first `shared` blocks are the same blocks (their tokens must be alike), as the
    prefix cache shares a common system prompt's. `sampled`: the sequences whose logits the
    decode steps ask for (the others' as a sequence mid-prompt's, none), all by default."""
    model.native_layers = native
    counts = [-(-len(ids) // BLOCK_SIZE) for ids in sequences]
    order = torch.randperm(2 * sum(counts) + 1, generator=torch.Generator().manual_seed(1)).int()
    cache = torch.zeros(model.kv_cache_shape(len(order), BLOCK_SIZE))
    table = torch.zeros(len(sequences), max(counts), dtype=torch.int32)
    for i, count in enumerate(counts):
        table[i, :count] = order[sum(counts[:i]):sum(counts[:i]) + count]
        table[i, :shared] = table[0, :shared]
        assert sequences[i][:shared * BLOCK_SIZE] == sequences[0][:shared * BLOCK_SIZE]
    model.rotary.ensure(max(map(len, sequences)))

    def step(rows: list[int], spans: list[tuple[int, int]], sampled: list[int] | None = None) -> torch.Tensor:
        ids, positions, slots, cu, lens = [], [], [], [0], []
        for row, (start, end) in zip(rows, spans):
            ids += sequences[row][start:end]
            positions += range(start, end)
            slots += [int(table[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            cu.append(cu[-1] + end - start)
            lens.append(end)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                                 seqused_k=torch.tensor(lens, dtype=torch.int32), block_table=table[rows])
        ends = torch.tensor(cu[1:]) - 1
        return model.forward(torch.tensor(ids), torch.tensor(positions), cache, meta,
                             ends if sampled is None else ends[sampled])

    for row, prompt in enumerate(prompts):
        step([row], [(0, prompt)])
    steps = len(sequences[0]) - prompts[0]
    assert all(len(ids) - prompt == steps for ids, prompt in zip(sequences, prompts))
    rows = list(range(len(sequences)))
    return torch.stack([step(rows, [(p + t, p + t + 1) for p in prompts], sampled) for t in range(steps)])


def random_ids(lengths: list[int], vocab: int, seed: int = 0, common: int = 0) -> list[list[int]]:
    """Random token ids of these lengths, the first `common` alike in all."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (common,), generator=generator).tolist()
    return [prefix + torch.randint(0, vocab, (n - common,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("prompts, shared", [([7], 0), ([7, 3, 12, 5], 0), ([3 + i % 6 for i in range(17)], 0),
                                             ([2 * BLOCK_SIZE + 1 + i % 6 for i in range(17)], 2)],
                         ids=["a lone chat", "4 chats", "17 chats", "17 chats sharing 2 blocks"])
@pytest.mark.parametrize("gguf", ["all_quantized_gguf", "dense_head_gguf"], ids=["quantized head", "dense head"])
def test_decoding_tokens_through_the_native_layers_are_the_eager_forward(request, gguf, tiny_hf, prompts, shared):
    """One sequence (qmatmul.c's few-row loops, a head at a time), a few, and 17 (from 8 rows the
    matmuls take qmatmul_batch.c's loops; two bands of rows over the shared blocks) of different
    lengths, blocks out of order, with and without leading blocks in common; the output head in
    the same native call (quantized) or after it in torch (dense)."""
    path = request.getfixturevalue(gguf)
    model = native_model(path, tiny_hf.config)
    assert (native_model(path, tiny_hf.config).native_layers._head is not None) == (gguf == "all_quantized_gguf")
    native = model.native_layers
    assert isinstance(native, NativeLayers)
    assert model.decodes_natively(1, 1, 1) and model.decodes_natively(40, 40, 1) and model.decodes_natively(16, 1, 16)
    assert model.decodes_natively(640, 32, 24)  # chats' short turns past a cached prompt
    assert not model.decodes_natively(33, 1, 33)  # a long prompt: the eager forward's attention
    assert not model.decodes_natively(1056, 33, 32)  # more rows than a native step takes
    sequences = random_ids([p + 26 for p in prompts], tiny_hf.config.vocab_size, common=shared * BLOCK_SIZE)
    ours = decode_logits(model, sequences, prompts, native, shared)
    assert native.shared_blocks == shared  # the last step read them once for every band of rows
    eager = decode_logits(model, sequences, prompts, None, shared)
    assert ours.shape == (26, len(prompts), tiny_hf.config.vocab_size)
    assert torch.equal(ours.argmax(-1), eager.argmax(-1))
    # Both paths round the activations (two int8 levels, or one int16 level from 8 rows) before each
    # matmul, and a float summed in another order can round to the other side: so each is held to
    # the file's dequantized weights (the exact product), and the native path must be as close to
    # them as eager is.
    exact = decode_logits(dequantized_model(path, tiny_hf.config), sequences, prompts, None, shared)
    ours_error, eager_error = float((ours - exact).abs().max()), float((eager - exact).abs().max())
    assert ours_error < 1e-3 * float(exact.abs().max()) and ours_error < 2 * eager_error


def test_a_small_prompt_step_runs_natively_each_token_over_its_own_context(all_quantized_gguf, tiny_hf):
    """A step with several tokens of one sequence (a cached prompt's last partial block, a short
    turn) beside another's decode: each token a row attending over the keys up to its own, the
    chunk's earlier tokens included; the last tokens' logits are the eager forward's."""
    model = native_model(all_quantized_gguf, tiny_hf.config)
    native = model.native_layers
    first, second = random_ids([30, 12], tiny_hf.config.vocab_size, seed=7)

    def run(decode: NativeLayers | None) -> list[torch.Tensor]:
        model.native_layers = decode
        cache = torch.zeros(model.kv_cache_shape(16, BLOCK_SIZE))
        table = torch.tensor([[9, 2, 14, 5, 11, 0, 7, 3], [4, 13, 1, 8, 0, 0, 0, 0]], dtype=torch.int32)
        model.rotary.ensure(32)

        def step(spans: list[tuple[int, int, int]]) -> torch.Tensor:  # (sequence, start, end)
            ids, positions, slots, cu, lens = [], [], [], [0], []
            for row, start, end in spans:
                ids += (first, second)[row][start:end]
                positions += range(start, end)
                slots += [int(table[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
                cu.append(cu[-1] + end - start)
                lens.append(end)
            meta = AttentionMetadata(slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                                     seqused_k=torch.tensor(lens, dtype=torch.int32),
                                     block_table=table[[row for row, _, _ in spans]])
            return model.forward(torch.tensor(ids), torch.tensor(positions), cache, meta, torch.tensor(cu[1:]) - 1)

        return [step([(0, 0, 13)]), step([(0, 13, 18), (1, 0, 11)]), step([(0, 18, 19), (1, 11, 12)]),
                step([(0, 19, 30)])]

    calls = []
    original = NativeLayers.__call__
    NativeLayers.__call__ = lambda self, hidden, *rest: calls.append(hidden.shape[0]) or original(self, hidden, *rest)
    try:
        ours = run(native)
    finally:
        NativeLayers.__call__ = original
    assert calls == [13, 16, 2, 11]  # every step natively, a row a token
    eager = run(None)
    for a, b in zip(ours, eager):
        assert a.shape == b.shape and torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max()) < 1e-3 * float(b.abs().max())


def test_a_step_that_samples_some_of_its_rows_gets_their_logits(all_quantized_gguf, tiny_hf):
    """A sequence computing one token of its prompt (a chunk of one) wants no logits: the head
    then runs in torch over the rows that do, and their logits are the eager forward's."""
    model = native_model(all_quantized_gguf, tiny_hf.config)
    native = model.native_layers
    sequences, prompts = random_ids([20, 18, 21], tiny_hf.config.vocab_size, seed=5), [6, 4, 7]
    ours = decode_logits(model, sequences, prompts, native, sampled=[0, 2])
    eager = decode_logits(model, sequences, prompts, None, sampled=[0, 2])
    everyone = decode_logits(model, sequences, prompts, native)
    assert ours.shape == (14, 2, tiny_hf.config.vocab_size)
    assert torch.equal(ours.argmax(-1), eager.argmax(-1))
    assert float((ours - eager).abs().max()) < 1e-3 * float(eager.abs().max())
    torch.testing.assert_close(ours, everyone[:, [0, 2]])  # the same rows as when all are sampled


def test_a_qkv_bias_is_added_before_the_rotation(all_quantized_gguf, tiny_hf):
    """Qwen2's q/k/v projections have a bias."""
    model = native_model(all_quantized_gguf, tiny_hf.config)
    generator = torch.Generator().manual_seed(3)
    for layer in model.layers:
        layer.qkv.bias = 0.5 * torch.randn(layer.qkv.out_features, generator=generator)
    native = NativeLayers.of(model)  # takes the biases as it is made
    sequences, prompts = random_ids([24, 22], tiny_hf.config.vocab_size, seed=3), [5, 3]
    ours, eager = decode_logits(model, sequences, prompts, native), decode_logits(model, sequences, prompts, None)
    without_bias = decode_logits(native_model(all_quantized_gguf, tiny_hf.config), sequences, prompts, None)
    assert torch.equal(ours.argmax(-1), eager.argmax(-1))
    assert float((ours - eager).abs().max()) < 1e-3 * float(eager.abs().max())
    assert float((ours - without_bias).abs().max()) > 0.05 * float(eager.abs().max())  # the bias counted


def test_models_it_cannot_serve_keep_the_eager_forward(all_quantized_gguf, tiny_hf, tmp_path):
    # q/k/v kept dense: not every layer matrix is quantized
    partly = write_gguf(tmp_path / "partly.gguf", "llama", tiny_llama_tensors(tiny_hf), file_type=7)
    assert native_model(partly, tiny_hf.config).native_layers is None
    dequantized = dequantized_model(all_quantized_gguf, tiny_hf.config)
    assert dequantized.native_layers is None and not dequantized.decodes_natively(1, 1, 1)
    in_bf16 = LlamaModel(load_model(all_quantized_gguf, tiny_hf.config, torch.bfloat16, quantized=True),
                         torch.bfloat16, torch.device("cpu"))
    assert in_bf16.native_layers is None


def test_the_engine_decodes_natively_and_greedy_replies_match_the_eager_forward(embedded_gguf, monkeypatch):
    """The embedded SmolLM2 Q4_1 through the engine: a lone chat's steps, three chats' short turns
    past a cached prompt and their decoding together take the native layers (only a long prompt
    plans torch's attention), and the greedy replies are the eager forward's, token for token."""
    llm = LLM(embedded_gguf, quantization="native", num_gpu_blocks=128, num_cpu_blocks=8, compile_decode=False)
    model = llm.engine.core.runner.model
    assert isinstance(model.native_layers, NativeLayers)
    assert all(layer.input_norm.native is not None for layer in model.layers)  # RMSNorm.native, for prompt steps
    rows = []
    native_call = NativeLayers.__call__
    monkeypatch.setattr(NativeLayers, "__call__", lambda self, hidden, *rest: rows.append(hidden.shape[0])
                        or native_call(self, hidden, *rest))
    plans = []
    plan_attention = kernels.plan_attention
    monkeypatch.setattr(kernels, "plan_attention", lambda **kw: plans.append(kw["q_lens"]) or plan_attention(**kw))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # (long enough that the three's prompt step, past the first's cached tokens, is over 16 tokens)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Name three prime numbers, then say briefly why each of them is prime."]

    def replies() -> list[list[int]]:
        alone = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
        return [alone] + [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    ours = replies()
    assert 1 in rows and 3 in rows  # the lone chat's steps, then the three's
    assert any(r > NATIVE_STEP_TOKENS for r in rows)  # the three's prompt step: short turns, natively
    assert all(max(q_lens) > 1 for q_lens in plans)  # only prompt steps planned torch's attention
    long_prompt = " ".join(["Summarise how an operating system pages memory to disk and back."] * 4)
    llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))
    assert plans and max(plans[-1]) > NATIVE_QUERY_TOKENS  # a long prompt: the eager forward's attention
    native, model.native_layers = model.native_layers, None
    try:
        eager = replies()
    finally:
        model.native_layers = native
    assert ours == eager and all(len(t) == 16 for t in ours)
