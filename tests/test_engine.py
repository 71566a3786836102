"""The engine against transformers, and against itself under every memory and batching regime."""
import pytest

from engine import LLM, SamplingParams
from engine.worker.loading.architectures import UnsupportedModelError
from hf_reference import check_close, hf_logprobs

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Every tiny engine here names its host pool: the default (1 GiB of swap space, 131k of the tiny
# model's blocks) costs ~0.6 s of CPU to allocate, per engine.


def prompts_of(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def transformers_picks(model, prompt: list[int], ours: list[int]) -> list[int]:
    """transformers' greedy pick after the prompt and after each prefix of `ours`, from one
    teacher-forced forward: `hf_greedy(model, prompt, len(ours))` up to the first token where the
    two differ, and so `ours` itself exactly when transformers decodes `ours` greedily. One forward
    costs what 3-5 of `generate`'s steps do on SmolLM2 (which were most of these tests)."""
    return hf_logprobs(model, prompt + ours[:-1])[len(prompt) - 1:].argmax(-1).tolist()


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
    "and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat: it was a",
    "1, 2, 3, 5, 8,",
    "Once",
    "Translate to French: I would like a cup of coffee, please. ->",
]


def test_real_model_greedy_equals_transformers(smol_llm, smol_hf):
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}]]
    for chat in chats:
        ids = smol_llm.engine.encode(smol_llm.engine.apply_chat_template(chat))
        ours = smol_llm.generate([ids], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].token_ids
        assert len(ours) == 24 and ours == transformers_picks(smol_hf, ids, ours)


def test_real_model_chat_reply_reads_right(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in out.outputs[0].text


def test_real_model_in_bf16_follows_the_fp32_model(smol_hf):
    """bf16 (the default on CPUs that compute it) cannot equal fp32 token for token, but every
    token it picks must be one the fp32 model ranks near the top: six chats sharing a system
    prompt decode together (the shared-prefix attention path), then one chat alone."""
    import os

    import torch

    llm = LLM(dtype="bfloat16", num_gpu_blocks=256, num_cpu_blocks=0)
    # Each chat after the first computes its prompt from the end of the last whole block they
    # share, and bf16 prefill is slow on a CPU without bf16 instructions (~0.1 s a token on Zen 1):
    # a system prompt that fills one block and a token keeps those tails short.
    system = {"role": "system", "content": "You are a concise assistant for a bakery."}
    questions = ["Do you sell rye bread?", "When do you open?", "Can I order a birthday cake?", "Is there parking?",
                 "Do you have gluten-free options?", "What is your best pastry?"]
    prompts = [llm.engine.encode(llm.engine.apply_chat_template([system, {"role": "user", "content": q}]))
               for q in questions]
    assert len(os.path.commonprefix(prompts)) >= 16  # at least one whole block to share
    params = SamplingParams(max_tokens=10, **GREEDY)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    outputs.append(llm.generate(prompts[:1], params)[0].outputs[0].token_ids)
    top1 = total = 0
    for ids, out in zip(prompts + prompts[:1], outputs):
        with torch.no_grad():
            logits = smol_hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
        ranks = (logits > logits.gather(1, torch.tensor(out)[:, None])).sum(1)
        assert int(ranks.max()) < 5, f"a token the fp32 model ranks {int(ranks.max()) + 1}th"
        top1 += int((ranks == 0).sum())
        total += len(out)
    assert top1 >= 0.9 * total


def test_tiny_model_greedy_equals_transformers_one_prompt_at_a_time(tiny_model_dir, tiny_hf, tokenizer):
    llm = LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64)
    for ids in prompts_of(tokenizer, TEXTS):
        ours = llm.generate([ids], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].token_ids
        assert len(ours) == 40 and ours == transformers_picks(tiny_hf, ids, ours)


def test_mixed_length_batch_agrees_with_transformers(tiny_model_dir, tiny_hf, tokenizer, smol_llm, smol_hf):
    for llm, hf in ((LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64), tiny_hf), (smol_llm, smol_hf)):
        prompts = prompts_of(tokenizer, TEXTS)
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, logprobs=5, **GREEDY))
        for ids, out in zip(prompts, outs):
            ours = out.outputs[0].token_ids
            check_close(ours, out.outputs[0].logprobs, transformers_picks(hf, ids, ours), hf, ids)


def run_all(llm, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(**params))
    return [o.outputs[0].token_ids for o in outs]


# Tokens each request of the workload decodes; a 16-block pool still preempts in every mode.
WORKLOAD_TOKENS = 24


@pytest.fixture(scope="module")
def workload(tokenizer):
    system = ("You are a careful assistant. Answer briefly and cite the facts you rely on. " * 3)
    return prompts_of(tokenizer, [system + t for t in TEXTS] + TEXTS)


@pytest.fixture(scope="module")
def unconstrained(tiny_model_dir, workload):
    llm = LLM(tiny_model_dir, num_gpu_blocks=512, num_cpu_blocks=64, enable_prefix_caching=False)
    return {"greedy": run_all(llm, workload, max_tokens=WORKLOAD_TOKENS, **GREEDY),
            "seeded": run_all(llm, workload, max_tokens=WORKLOAD_TOKENS, temperature=0.9, top_p=0.95, seed=7,
                              ignore_eos=True)}


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_tiny_pool_preemption_gives_identical_outputs(tiny_model_dir, workload, unconstrained, mode):
    llm = LLM(tiny_model_dir, num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode=mode, max_num_batched_tokens=64)
    assert run_all(llm, workload, max_tokens=WORKLOAD_TOKENS, **GREEDY) == unconstrained["greedy"]
    stats = llm.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
    if mode == "recompute":
        assert stats.num_preemptions_swap == 0
    seeded = run_all(llm, workload, max_tokens=WORKLOAD_TOKENS, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    assert seeded == unconstrained["seeded"]
    assert llm.stats().device_blocks_used == 0 and llm.stats().host_blocks_used == 0


def test_prefix_caching_and_chunked_prefill_give_identical_outputs(tiny_model_dir, workload, unconstrained):
    cached = LLM(tiny_model_dir, num_gpu_blocks=512, num_cpu_blocks=64, enable_prefix_caching=True)
    assert run_all(cached, workload, max_tokens=WORKLOAD_TOKENS, **GREEDY) == unconstrained["greedy"]
    again = cached.generate(workload, SamplingParams(max_tokens=4, **GREEDY))
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    # Past the whole blocks, each prompt's last block comes from the cache too (its tokens copied
    # from the block the first run filled), so all but the last prompt token are cached: the
    # replies are still the same.
    assert all(o.num_cached_tokens == len(o.prompt_token_ids) - 1 for o in again)
    assert [o.outputs[0].token_ids for o in again] == [g[:4] for g in unconstrained["greedy"]]
    chunked = LLM(tiny_model_dir, num_gpu_blocks=512, num_cpu_blocks=64, max_num_batched_tokens=16)
    assert run_all(chunked, workload, max_tokens=WORKLOAD_TOKENS, **GREEDY) == unconstrained["greedy"]


def test_n_samples_share_the_prompt_and_are_reproducible(tiny_model_dir, tokenizer):
    llm = LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64)
    prompt = prompts_of(tokenizer, [TEXTS[2]])[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert len(first.outputs) == 3 and all(len(o.token_ids) == 12 for o in first.outputs)
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    second = llm.generate([prompt], params)[0]
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    assert llm.stats().device_blocks_used == 0


def test_stop_strings_and_max_tokens_finish_with_the_right_reason(tiny_model_dir, tokenizer):
    llm = LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64)
    prompt = prompts_of(tokenizer, [TEXTS[0]])[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop = free.text[len(free.text) // 2:][:3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0].outputs[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text) and len(cut.text) <= free.text.index(stop)


def test_refuses_what_it_cannot_serve(tiny_model_dir, tmp_path):
    llm = LLM(tiny_model_dir, num_gpu_blocks=8, num_cpu_blocks=64, block_size=16)
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([list(range(5, 200))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        LLM(str(tmp_path))


def test_a_lone_chat_goes_on_from_the_last_steps_plan_until_blocks_move(tiny_model_dir, tokenizer, monkeypatch):
    """One chat decoding alone keeps its gathered K/V from step to step (kernels/reference.py
    `LoneDecode`): each step's plan is made from the last one. A step that swaps or copies blocks
    starts afresh, whatever the blocks now hold, and an idle engine keeps none of it. (torch's
    attention, as a bf16 or GPU engine runs it: a float32 one's eager steps take the native rows.)"""
    import kernels
    from engine.core.scheduler_output import SchedulerOutput

    llm = LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=8)
    runner = llm.engine.runner
    runner.model.row_attention = None
    handed = []
    plan_attention = kernels.plan_attention

    def spy(*args, previous=None, **kwargs):
        handed.append(previous)
        return plan_attention(*args, previous=previous, **kwargs)

    monkeypatch.setattr(kernels, "plan_attention", spy)
    ids = prompts_of(tokenizer, TEXTS[2:3])
    lone = llm.generate(ids, SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0].token_ids
    assert len(handed) == 8 and handed[0] is None and all(plan is not None for plan in handed[1:])
    assert handed[-1].short.lone.layers  # the step before the last kept this chat's K/V for it
    assert runner._last_plan is None  # and with nothing left to run, none of it is held
    llm.engine.add_request("again", ids[0], SamplingParams(max_tokens=8, **GREEDY))
    llm.engine.step()
    llm.engine.step()
    assert runner._last_plan.short.lone is not None
    runner.execute(SchedulerOutput(blocks_to_copy=[(63, 63)]))  # a copy onto itself: moves nothing real
    assert runner._last_plan is None
    llm.engine.abort_request("again")
    # The same chat in a batch (gathered every step) decodes the same tokens.
    batch = llm.generate(ids + prompts_of(tokenizer, TEXTS[:1]), SamplingParams(max_tokens=8, **GREEDY))
    assert batch[0].outputs[0].token_ids == lone


def test_a_step_on_another_path_drops_the_kept_k_v(tiny_model_dir, tokenizer):
    """Whatever path writes the cache (here the padded decode-graph path, which a CPU runs
    eagerly), the eager path's kept K/V of a lone chat is dropped at once, not kept stale: one
    rule for every writer (ModelRunner._wrote)."""
    llm = LLM(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=64, max_num_seqs=4, cuda_graphs=True)
    runner = llm.engine.runner
    runner.model.row_attention = None  # torch's attention keeps a lone chat's K/V; the native rows keep none
    assert runner.graphs is not None
    ids = prompts_of(tokenizer, TEXTS[2:3])
    llm.engine.add_request("lone", ids[0], SamplingParams(max_tokens=8, **GREEDY))
    graphs, runner.graphs = runner.graphs, None
    llm.engine.step()  # the prompt, eagerly: its plan is kept
    runner.graphs = graphs
    assert runner.last_path == "eager" and runner._last_plan is not None
    llm.engine.step()  # one decode: the decode-graph path writes the cache
    assert runner.last_path == "graphs"
    assert runner._last_plan is None
