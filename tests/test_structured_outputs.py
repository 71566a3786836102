"""Structured output through the whole engine (tiny random model): every reply a constraint allows,
whatever the weights would say, on every way a request runs — sampled, greedy, n > 1, preempted,
from the prefix cache — with its grammar compiled off the engine loop."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from waiting import poll

from engine import LLM, EngineClient, LLMEngine, SamplingParams
from engine.core.sampling_params import InvalidStructuredOutputsError, StructuredOutputsParams
from engine.worker.structured import grammar_compiler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a user as JSON.", "A wiki editor, please.", "Who runs the site?", "Give me a record."]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64)


def constrained(**options) -> SamplingParams:
    structured = {k: options.pop(k) for k in ("json", "json_object", "regex", "choice", "grammar") if k in options}
    return SamplingParams(**{"max_tokens": 200, **options}, structured_outputs=StructuredOutputsParams(**structured))


def test_a_json_schema_holds_whatever_the_weights_say(llm):
    outputs = llm.generate(PROMPTS, constrained(json=PERSON, temperature=0.8, seed=3))
    for output in outputs:
        reply = output.outputs[0]
        assert reply.finish_reason == "stop", reply.text
        jsonschema.validate(json.loads(reply.text), PERSON)
    unconstrained = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.8, seed=3, max_tokens=40))[0].outputs[0]
    with pytest.raises(ValueError):
        json.loads(unconstrained.text)  # the random weights alone write no JSON


def test_greedy_json_object_choice_regex_and_grammar(llm):
    obj = llm.generate(PROMPTS[:1], constrained(json_object=True, temperature=0.0, max_tokens=300))[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a greedy random model may write one long string: what it wrote is still the start of an object
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    choices = ["red", "green", "blue sky"]
    for prompt in PROMPTS:
        reply = llm.generate([prompt], constrained(choice=choices, temperature=1.0))[0].outputs[0]
        assert reply.text in choices and reply.finish_reason == "stop"
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    replies = llm.generate(PROMPTS, constrained(regex=pattern, temperature=1.0, seed=7))
    assert all(re.fullmatch(pattern, r.outputs[0].text) for r in replies), [r.outputs[0].text for r in replies]
    grammar = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-c]+'
    reply = llm.generate(PROMPTS[:1], constrained(grammar=grammar, temperature=1.0, seed=1, max_tokens=30))[0].outputs[0]
    assert re.fullmatch(r"\([a-c]+(, [a-c]+)*\)", reply.text) or (reply.finish_reason == "length"
                                                                   and re.fullmatch(r"\([a-c, ]*", reply.text))


def test_a_reply_cut_by_max_tokens_ends_with_length(llm):
    reply = llm.generate(PROMPTS[:1], constrained(json=PERSON, temperature=0.8, seed=3, max_tokens=5))[0].outputs[0]
    assert reply.finish_reason == "length" and len(reply.token_ids) == 5 and reply.text.startswith("{")


def test_a_completed_grammar_ends_the_reply_even_when_eos_is_ignored(llm):
    params = constrained(choice=["yes", "no"], temperature=0.0, ignore_eos=True, max_tokens=20)
    reply = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert reply.text in ("yes", "no") and reply.finish_reason == "stop"


def test_each_of_n_samples_keeps_to_the_grammar_on_its_own(llm):
    output = llm.generate(PROMPTS[:1], constrained(json=PERSON, temperature=1.0, seed=11, n=4))[0]
    assert len(output.outputs) == 4
    texts = [sample.text for sample in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # forked matchers, not one shared


def test_min_tokens_never_holds_back_the_end_a_grammar_asks_for(llm):
    reply = llm.generate(PROMPTS[:1], constrained(choice=["ok"], temperature=0.0, min_tokens=8))[0].outputs[0]
    assert reply.text == "ok" and reply.finish_reason == "stop"


def test_constrained_requests_survive_preemption_by_swap_and_by_recompute(tiny_model_dir):
    # 12 blocks of 16 tokens for 6 requests growing past 40 tokens each: some must be preempted.
    for mode in ("swap", "recompute"):
        llm = LLM(tiny_model_dir, num_gpu_blocks=12, num_cpu_blocks=64, preemption_mode=mode)
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 30, "maxItems": 30}
        outputs = llm.generate([f"{p} Count." for p in PROMPTS + PROMPTS[:2]],
                               constrained(json=schema, temperature=1.0, seed=5))
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions_swap + scheduler.num_preemptions_recompute > 0, mode
        for output in outputs:
            jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_cached_prefix_changes_nothing_for_the_grammar(llm):
    prompt = "You are a careful assistant who writes records. " * 4 + "One record, please."
    first, second = (llm.generate([prompt], constrained(json=PERSON, temperature=0.0))[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert first.outputs[0].text == second.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), PERSON)


def test_logit_bias_moves_a_greedy_choice(llm):
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    pushed = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={42: 100}))
    assert pushed[0].outputs[0].token_ids == [42]
    pulled = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={free: -100}))
    assert pulled[0].outputs[0].token_ids[0] != free


def test_a_broken_constraint_is_refused_before_anything_is_queued(llm):
    for broken in ({"json": {"type": "objec"}}, {"regex": "[a-"}, {"grammar": "root ::= "}):
        with pytest.raises(InvalidStructuredOutputsError, match="does not compile"):
            llm.generate(PROMPTS[:1], constrained(**broken))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")


def test_a_grammar_that_fails_in_the_core_fails_its_request_alone(llm):
    engine = llm.engine
    engine.core.add_request("broken", engine.encode("Hello"), constrained(json={"type": "objec"}))
    engine.core.add_request("fine", engine.encode("Hello"), SamplingParams(temperature=0.0, max_tokens=4))
    outputs = []
    while engine.core.has_unfinished():
        outputs += engine.core.step()
    ends = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert ends == {"broken": "error", "fine": "length"}
    assert "Unsupported type" in next(o.error for o in outputs if o.request_id == "broken")


def test_a_grammar_compiles_while_other_chats_stream(tiny_model_dir, monkeypatch):
    """The compiler is held until the streaming chat has had tokens after the constrained request
    arrived: were the compile on the engine loop, the stream would stop until it ended, and this
    test would time out instead of passing."""
    release = threading.Event()
    compile_ = grammar_compiler.GrammarCompiler._compile

    def held_compile(self, params):
        assert release.wait(120), "the streaming chat got no token while a grammar compiled"
        return compile_(self, params)

    monkeypatch.setattr(grammar_compiler.GrammarCompiler, "_compile", held_compile)
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=64), max_waiting=8)
    try:
        stream = client.submit("Tell me a long story.", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        assert next(stream).token_ids  # streaming
        structured = client.submit("A record.", constrained(json=PERSON, temperature=0.0))
        got = 0
        for delta in stream:
            got += len(delta.token_ids)
            if got >= 20:
                release.set()  # 20 tokens streamed while the grammar was held
                break
        reply = "".join(delta.text for delta in structured)
        jsonschema.validate(json.loads(reply), PERSON)
        stream.close()
        assert poll(lambda: client.stats().num_running == 0)
    finally:
        release.set()
        client.close()


def test_compiled_grammars_are_kept_by_their_text_within_a_byte_budget(tokenizer, monkeypatch):
    compiler = grammar_compiler.GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    first = compiler.compile(StructuredOutputsParams(json=PERSON))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON))) is first  # the same text, reordered or not
    size = first.result(timeout=120).memory_size_bytes
    monkeypatch.setattr(grammar_compiler, "CACHED_BYTES", int(2.5 * size))
    for n in range(4):
        compiler.compile(StructuredOutputsParams(json={**PERSON, "maxProperties": 5 + n})).result(timeout=120)
    kept = list(compiler._compiled.values())
    assert first not in kept and 1 <= len(kept) <= 3
    compiler.close()
