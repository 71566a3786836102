"""The compiled decode steps (engine/worker/compiled_decode.py): built in the background while the
eager path serves, then the same greedy tokens as the eager path: a lone chat's through buffer
growth, batch-to-lone hand-overs and moved blocks, a batch's with and without a shared prefix;
the real model against transformers."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker import compiled_decode
from engine.worker.compiled_decode import CAPACITY_STEP, CompiledDecode, package_path
from hf_reference import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
BUILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Compiled packages go to a folder of this module's own (not the machine's cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDCHAT_COMPILED_DIR", str(tmp_path_factory.mktemp("compiled")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tiny_compiled(packages, tiny_model_dir):
    """An fp32 engine on the tiny model whose compiled step was built by the engine itself, in
    the background, and what it served eagerly meanwhile."""
    assert not package_path(tiny_model_dir, torch.float32).exists()
    llm = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=8, compile_decode=True)
    compiled = llm.engine.compiled
    served = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids
    not_ready_while_serving = not compiled.ready
    assert compiled.wait(BUILD_TIMEOUT_S), compiled.error
    return llm, served, not_ready_while_serving


def count_calls(monkeypatch, compiled: CompiledDecode, method: str = "decode") -> list:
    calls = []
    decode = getattr(compiled, method)

    def spy(tokens, *args):
        calls.append(tokens)
        return decode(tokens, *args)

    monkeypatch.setattr(compiled, method, spy)
    return calls


def test_the_engine_serves_eagerly_while_the_step_builds(tiny_compiled, tiny_model_dir):
    llm, served, not_ready_while_serving = tiny_compiled
    assert not_ready_while_serving and len(served) == 4
    assert package_path(tiny_model_dir, torch.float32).exists()
    assert package_path(tiny_model_dir, torch.float32, "batch").exists()
    eager = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    assert eager.engine.compiled is None
    assert eager.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids == served


def test_lone_chats_decode_the_eager_tokens(tiny_compiled, tiny_model_dir, tokenizer, monkeypatch):
    """Greedy fp32: the same tokens as the eager engine, for a chat long enough that its K/V
    buffer grows twice, and for a batch whose longer chat goes on alone (its buffer gathered
    from the paged cache when the other one ends)."""
    llm = tiny_compiled[0]
    calls = count_calls(monkeypatch, llm.engine.compiled)
    eager = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    prompt = tokenizer("In a hole in the ground there lived a hobbit.", add_special_tokens=False).input_ids
    long = SamplingParams(max_tokens=2 * CAPACITY_STEP + 10, **GREEDY)
    ours = llm.generate([prompt], long)[0].outputs[0].token_ids
    assert ours == eager.generate([prompt], long)[0].outputs[0].token_ids
    assert len(calls) == long.max_tokens - 1  # every step after the prompt's

    calls.clear()
    batch = [prompt, tokenizer("Once", add_special_tokens=False).input_ids]
    params = [SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=12, **GREEDY)]
    ours = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert len(calls) == 40 - 12  # only the steps the longer chat took alone
    assert llm.engine.compiled._buffer is None  # and nothing is held once idle


def test_decode_batches_decode_the_eager_tokens(tiny_compiled, tiny_model_dir, tokenizer, monkeypatch):
    """Greedy fp32: batches of decodes through the compiled batch step give the eager engine's
    tokens, for chats that share a system prompt of whole blocks (read once for all of them),
    chats that share nothing, and chats of different lengths that drop out one by one."""
    llm = tiny_compiled[0]
    batch_calls = count_calls(monkeypatch, llm.engine.compiled, "decode_batch")
    eager = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    system = tokenizer("You are a helpful assistant who answers in one short sentence. " * 4,
                       add_special_tokens=False).input_ids
    assert len(system) >= 2 * 16  # two whole blocks every chat shares
    questions = ["Why is the sky blue?", "Name a prime.", "Hello there", "What is a hobbit?"]
    shared = [system + tokenizer(q, add_special_tokens=False).input_ids for q in questions]
    alone = [tokenizer(q, add_special_tokens=False).input_ids for q in questions[:3]]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (30, 9, 21, 14)]
    for prompts in (shared, alone):
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params[:len(prompts)])]
        assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params[:len(prompts)])]
    assert len(batch_calls) >= 2 * 20 and {len(tokens) for tokens in batch_calls} >= {2, 3, 4}


def test_a_sequence_whose_blocks_moved_is_gathered_afresh(tiny_compiled):
    """The step keeps one sequence's K/V between calls only while the sequence goes on in the
    same blocks: the same context in other blocks (a swap, a copy) is read from them again, and
    gives the same logits as a fresh start."""
    from engine.core.scheduler_output import SchedulerOutput

    llm = tiny_compiled[0]
    runner, compiled = llm.engine.runner, llm.engine.compiled
    cache, bs = runner.kv_cache, runner.block_size
    torch.manual_seed(1)
    cache[:8].copy_(torch.randn_like(cache[:8]))
    cache[8:16].copy_(cache[:8])  # the same K/V in blocks 8..15

    def step(blocks, length, fresh=False):
        if fresh:
            compiled.forget()
        logits, best = compiled.decode(11, length - 1, blocks, length, cache, bs)
        assert torch.equal(best, logits.argmax(-1))  # the graph's argmax, which greedy sampling takes
        return logits

    first = step(list(range(8)), 3 * bs + 1, fresh=True)
    kept = compiled._buffer
    assert torch.equal(step(list(range(8)), 3 * bs + 1), first)  # the same step again, from the kept buffer
    step(list(range(8)), 3 * bs + 2)  # and the next one
    assert compiled._buffer is kept
    moved = step(list(range(8, 16)), 3 * bs + 1)  # the same context in other blocks: gathered from them
    assert compiled._buffer is not kept and torch.equal(moved, first)
    runner.execute(SchedulerOutput(blocks_to_copy=[(63, 63)]))  # any block move forgets it
    assert compiled._buffer is None


def test_a_failed_build_leaves_the_engine_eager(packages, tiny_model_dir, deep_model_dir, monkeypatch):
    llm = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=16, compile_decode=False)
    broken = CompiledDecode(tiny_model_dir, torch.float16, llm.engine.model).start()  # no fp16 build exists
    assert not broken.wait(BUILD_TIMEOUT_S)
    assert "exited with 2" in broken.error and "float16" in broken.error
    monkeypatch.setattr(compiled_decode, "BUILD_TIMEOUT_S", 0.5)  # a build that hangs is stopped
    slow = CompiledDecode(deep_model_dir, torch.float32, llm.engine.model)
    assert not slow.wait(60) and "took over 0.5 s" in slow.error
    assert not package_path(deep_model_dir, torch.float32).exists()
    assert compiled_decode.supported(torch.device("cpu"), torch.float16) is not None
    assert compiled_decode.supported(torch.device("meta"), torch.float32) is not None


def test_packages_are_keyed_by_model_and_dtype(packages, tiny_model_dir, deep_model_dir):
    paths = {package_path(m, d) for m in (tiny_model_dir, deep_model_dir) for d in (torch.float32, torch.bfloat16)}
    assert len(paths) == 4 and all(p.suffix == ".pt2" for p in paths)
    assert package_path(tiny_model_dir, torch.float32) == package_path(tiny_model_dir, torch.float32)


def test_real_model_compiled_greedy_equals_transformers(packages, smol_hf, monkeypatch):
    """The default model in fp32: lone decode steps through the compiled lone-chat graph, then the
    same chats together, their steps through the compiled batch graph."""
    llm = LLM(dtype="float32", num_gpu_blocks=128, num_cpu_blocks=0, compile_decode=True)
    assert llm.engine.compiled.wait(BUILD_TIMEOUT_S), llm.engine.compiled.error
    calls = count_calls(monkeypatch, llm.engine.compiled)
    batch_calls = count_calls(monkeypatch, llm.engine.compiled, "decode_batch")
    chats = ([{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}])
    prompts = [llm.engine.encode(llm.engine.apply_chat_template(chat)) for chat in chats]
    expected = [hf_greedy(smol_hf, ids, 24) for ids in prompts]
    for ids, tokens in zip(prompts, expected):
        assert llm.generate([ids], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].token_ids == tokens
    assert len(calls) == 2 * 23 and not batch_calls
    together = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert [o.outputs[0].token_ids for o in together] == expected
    assert len(batch_calls) == 23


def test_a_hub_models_package_follows_its_revision(packages, tmp_path, monkeypatch):
    """A hub id is keyed by the snapshot the engine loaded (huggingface_hub's cache): a new
    revision of the model is a new package, not the old one's weights."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--tiny-chat"
    for revision, width in (("a" * 40, 64), ("b" * 40, 128)):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").write_text(f'{{"hidden_size": {width}}}')
    (repo / "refs").mkdir()
    paths = []
    for revision in ("a" * 40, "b" * 40):
        (repo / "refs" / "main").write_text(revision)
        paths.append(package_path("someone/tiny-chat", torch.float32))
    assert paths[0] != paths[1] and all(p.name.startswith("decode-tiny-chat-float32-") for p in paths)


def run_forward_ab(model: str, dtype: str, monkeypatch, chats: int = 1) -> dict:
    """benchmarks/forward_ab.py with the compiled-step variant on one captured step of `model`
    with `chats` chats: its figures for the compiled side (building the packages first when there
    are none)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("MODEL", model)
    done = subprocess.run([sys.executable, "benchmarks/forward_ab.py", "--model", model, "--dtype", dtype,
                           "--chats", str(chats), "--tokens", "24", "--step", "12", "--rounds", "2", "--repeat", "1",
                           "--variant", "benchmarks/variants/compiled_step.py"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["base_unchanged"]
    return figures["sides"]["compiled"]


def test_forward_ab_variant_runs_the_compiled_step(tiny_compiled, tiny_model_dir, monkeypatch):
    """benchmarks/variants/compiled_step.py times the compiled step against the eager forward on
    one captured step, a lone chat's and a batch's: their logits match the eager forward's (fp32),
    and the base is left as it was."""
    for chats in (1, 3):
        compiled = run_forward_ab(tiny_model_dir, "float32", monkeypatch, chats)
        assert compiled["same_greedy"] and compiled["max_abs_diff"] < 1e-4


def test_bf16_step_matches_eager(packages, tiny_model_dir, monkeypatch):
    """bf16: the compiled lone step (its weight matmuls loops of its own over `MatVec` blocks,
    summed in fp32) gives the eager forward's greedy token and its logits up to bf16 rounding on
    a captured step."""
    compiled = run_forward_ab(tiny_model_dir, "bfloat16", monkeypatch)
    # bf16 keeps 8 significant bits: this model's logits (tens) round to steps of 0.125 or 0.25.
    assert compiled["same_greedy"] and compiled["max_abs_diff"] <= 0.5


@pytest.mark.parametrize("rows, bias", [(64, False), (70, True), (5, True)])
def test_matvec_blocks_multiply_like_linear(rows, bias):
    """`MatVec` keeps a weight in blocks of one cache line of output features (16 in fp32),
    padding the last block: one row times it is `linear`'s result, whatever the row count."""
    from engine.worker.models.decode_step import MatVec

    torch.manual_seed(0)
    weight, b = torch.randn(rows, 48), torch.randn(rows) if bias else None
    x = torch.randn(1, 48)
    layer = MatVec(weight, b)
    assert layer.blocks.shape == (-(-rows // 16), 48, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
