"""Structured output, logit_bias and the refusal of unknown fields through the HTTP API: a real
server on a loopback port over the tiny model, through the official `openai` client and raw
HTTP. The tiny model's weights are random: only the constraint makes its replies valid JSON, a
regex's match or one of the choices."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from benchmarks.schema_check import schema_errors
from served_api import engine_client, openai, url  # noqa: F401  (the module's server)


QUESTION = [{"role": "user", "content": "Describe the weather."}]
WEATHER = {"type": "object",
           "properties": {"sunny": {"type": "boolean"}, "sky": {"enum": ["blue", "grey", "red"]},
                          "wind": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["sunny", "sky", "wind"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
GREEDY = dict(temperature=0.0, max_tokens=48)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def chat_post(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8, **fields},
                      timeout=120)


def assert_weather(text: str) -> None:
    assert schema_errors(json.loads(text), WEATHER) == [], text


# ---- response_format ---------------------------------------------------------------------------------
def test_json_schema_on_chat_and_completions_matches_the_schema(openai):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, response_format=RESPONSE_FORMAT, **GREEDY)
    assert reply.choices[0].finish_reason == "stop"
    assert_weather(reply.choices[0].message.content)
    text = openai.completions.create(model="tiny", prompt="Weather report:", extra_body={"response_format": RESPONSE_FORMAT},
                                     **GREEDY)
    assert text.choices[0].finish_reason == "stop"
    assert_weather(text.choices[0].text)


def test_json_schema_streamed_joins_to_a_match(openai):
    chunks = openai.chat.completions.create(model="tiny", messages=QUESTION, response_format=RESPONSE_FORMAT,
                                            stream=True, **GREEDY)
    assert_weather("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_json_object_is_an_object_and_text_is_unconstrained(openai):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, response_format={"type": "json_object"},
                                           temperature=0.0, max_tokens=200)
    content = reply.choices[0].message.content
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    plain = openai.chat.completions.create(model="tiny", messages=QUESTION, **GREEDY).choices[0].message.content
    text = openai.chat.completions.create(model="tiny", messages=QUESTION, response_format={"type": "text"}, **GREEDY)
    assert text.choices[0].message.content == plain


# ---- vLLM's structured_outputs and guided_* ---------------------------------------------------------
@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
    ({"guided_regex": "(red|green) [0-9]"}, lambda t: re.fullmatch("(red|green) [0-9]", t)),
    ({"guided_grammar": 'root ::= "hello " ("world" | "there")'}, lambda t: t in ("hello world", "hello there")),
    ({"structured_outputs": {"json": WEATHER}}, lambda t: not schema_errors(json.loads(t), WEATHER)),
    ({"guided_json": WEATHER}, lambda t: not schema_errors(json.loads(t), WEATHER)),
    ({"guided_json": json.dumps(WEATHER)}, lambda t: not schema_errors(json.loads(t), WEATHER)),
], ids=["choice", "guided_choice", "regex", "guided_regex", "guided_grammar", "json", "guided_json",
        "guided_json_text"])
def test_vllm_constraints_hold_exactly(url, fields, check):
    reply = chat_post(url, temperature=0.0, **{**fields, "max_tokens": 48})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["message"]["content"]), choice


def test_a_constraint_holds_for_every_sample(openai):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, n=3, temperature=1.0, seed=7,
                                           max_tokens=8, extra_body={"guided_choice": ["up", "down"]})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(c.message.content in ("up", "down") for c in reply.choices)


# ---- refused constraints --------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param, why", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "nonsense"),
    ({"guided_json": {"$ref": "#/$defs/nowhere"}}, "guided_json", "nowhere"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "grammar"),
], ids=["schema", "ref", "regex", "grammar"])
@pytest.mark.parametrize("core", ["thread", "process"])
def test_a_constraint_that_does_not_compile_is_400_naming_its_field(url, engine_servers, core, fields, param, why):
    """Checked before it is queued (an engine on a thread) or by the engine core in its own
    process (`python -m engine.serve`, whose serving process holds no grammar library)."""
    base = url if core == "thread" else engine_servers[0].url
    for stream in (False, True):
        refused = chat_post(base, stream=stream, **fields)
        assert refused.status_code == 400, refused.text
        error = error_of(refused)
        assert error["param"] == param and why in error["message"], error
    assert chat_post(base).status_code == 200  # the server serves on


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     ("response_format", "guided_regex")),
    ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "guided_choice",
     ("structured_outputs", "guided_choice")),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", ("regex", "choice")),
    ({"structured_outputs": {}}, "structured_outputs", ("exactly one",)),
    ({"response_format": {"type": "json_schema"}}, "response_format", ("json_schema",)),
    ({"response_format": {"type": "grammar"}}, "response_format.type", ()),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", ()),
    ({"guided_choice": []}, "guided_choice", ("choice",)),
], ids=["two-fields", "structured-and-guided", "two-in-one", "none-in-one", "schema-missing", "unknown-type",
        "unknown-member", "no-choices"])
def test_malformed_or_competing_constraints_are_400(url, fields, param, words):
    refused = chat_post(url, **fields)
    assert refused.status_code == 400, refused.text
    error = error_of(refused)
    assert error["param"] == param and all(word in error["message"] for word in words), error


# ---- logit_bias ------------------------------------------------------------------------------------------
def test_a_large_logit_bias_makes_its_token_come_out(openai, tokenizer):
    token = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    reply = openai.completions.create(model="tiny", prompt="Once upon a time", temperature=0.0, max_tokens=4,
                                      logit_bias={str(token): 100})
    assert reply.choices[0].text == tokenizer.decode([token] * 4)


@pytest.mark.parametrize("bias", [{"5": 101}, {"5": -250}, {"five": 1}, {"-3": 1}, {"100000000": 1}])
def test_a_bad_logit_bias_is_400(url, bias):
    refused = chat_post(url, logit_bias=bias)
    assert refused.status_code == 400 and error_of(refused)["param"] == "logit_bias", refused.text


# ---- unknown fields ------------------------------------------------------------------------------------
def test_unknown_fields_are_refused_by_name(url):
    refused = chat_post(url, functions=[{"name": "f"}], prediction={"type": "content", "content": "x"})
    error = error_of(refused)
    assert refused.status_code == 400 and error["param"] == "functions"
    assert "unsupported field(s): functions, prediction" in error["message"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "tools": tools, "max_tokens": 2})
    assert text.status_code == 400 and "tools" in error_of(text)["message"]
    message = chat_post(url, messages=[{"role": "user", "content": "Hi", "audio": {"id": "a1"}}])
    assert message.status_code == 400 and error_of(message)["param"] == "messages.0.audio"
    whitespace = chat_post(url, guided_json=WEATHER, guided_whitespace_pattern=r"\s*")
    assert whitespace.status_code == 400 and error_of(whitespace)["param"] == "guided_whitespace_pattern"


def test_fields_harmless_to_ignore_are_taken(url, openai):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, user="u-1", store=False,
                                           metadata={"team": "tests"}, service_tier="auto", prompt_cache_key="k",
                                           safety_identifier="s-1", extra_body={"guided_decoding_backend": "xgrammar"})
    assert reply.choices[0].message.role == "assistant"
    # null says nothing: a message echoed back from an earlier reply carries `refusal: null`
    echoed = chat_post(url, messages=[*QUESTION, {"role": "assistant", "content": "Sunny.", "refusal": None,
                                                  "annotations": None}, {"role": "user", "content": "And?"}],
                       functions=None)
    assert echoed.status_code == 200, echoed.text
