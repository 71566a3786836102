"""Tool calls: the parsers on strings (whole and delta by delta, tags split anywhere), the prompt
a chat with tools becomes (a template without tools, SmolLM2's; and a tiny one that takes them),
and `tools` / `tool_choice` through a real server over the tiny model with the official client.
The tiny model's weights are random: its calls are what the constraint of `tool_choice` makes of
them (or, for `auto`, a choice constraint that spells a Hermes block)."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from benchmarks.schema_check import schema_errors
from served_api import engine_client, openai, url  # noqa: F401  (the module's server)

from engine.api.completions import Completions
from engine.api.tool_call_parser import (CallArguments, CallArrayParser, CallStart, Content, FunctionArgumentsParser,
                                         HermesParser, parse_reply)
from engine.api.tool_prompt import TOOLS_SECTION, chat_prompt, hermes_messages, template_takes_tools

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
CALL_ARRAY = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F", "note": "a } and a \\" in it"}}, '
              '{"name": "get_time", "parameters": {"zone": "UTC"}}]')


def streamed(parser, text: str, size: int, stopped: bool = True) -> list:
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    return events + parser.finish(stopped)


def folded(events: list) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a client assembles from streamed events."""
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls) and event.id.startswith("call_") and len(event.id) == 29
            calls.append([event.name, ""])
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.text
    return "".join(e.text for e in events if isinstance(e, Content)), [tuple(call) for call in calls]


# ---- the parsers ----------------------------------------------------------------------------------------
def test_hermes_reply_whole():
    parsed = parse_reply(HermesParser(), HERMES_REPLY, stopped=True)
    assert parsed.content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert parse_reply(HermesParser(), "Just text.", stopped=True).tool_calls == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_hermes_streamed_in_any_pieces_says_what_the_whole_says(size):
    whole = parse_reply(HermesParser(), HERMES_REPLY, stopped=True)
    content, calls = folded(streamed(HermesParser(), HERMES_REPLY, size))
    assert content == whole.content
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]


def test_hermes_holds_back_only_what_may_be_a_tag():
    parser = HermesParser()
    assert parser.feed("Sure <tool") == [Content("Sure")]  # the space waits: a call may follow
    assert parser.feed("box> is a word") == [Content(" <toolbox> is a word")]
    assert parser.finish(stopped=True) == []
    tail = HermesParser()
    assert tail.feed("a <tool_c") == [Content("a")] and tail.finish(stopped=True) == [Content(" <tool_c")]


def test_hermes_blocks_that_are_not_calls_stay_text():
    text = 'A <tool_call>{"name": 3}</tool_call> B <tool_call>not json</tool_call>'
    assert parse_reply(HermesParser(), text, stopped=True).content == text
    assert folded(streamed(HermesParser(), text, 4))[0] == text
    unclosed = 'A\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert len(parse_reply(HermesParser(), unclosed, stopped=True).tool_calls) == 1  # eos may end a block
    cut = parse_reply(HermesParser(), unclosed, stopped=False)  # max_tokens: what was written stays text
    assert cut.tool_calls == [] and cut.content == unclosed
    only_first = parse_reply(HermesParser(max_calls=1), HERMES_REPLY, stopped=True)
    assert [c["function"]["name"] for c in only_first.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_call_array_streamed_in_any_pieces(size):
    whole = parse_reply(CallArrayParser(), CALL_ARRAY, stopped=True)
    assert whole.content is None and [c["function"]["name"] for c in whole.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(whole.tool_calls[0]["function"]["arguments"])["note"] == 'a } and a " in it'
    content, calls = folded(streamed(CallArrayParser(), CALL_ARRAY, size))
    assert content == "" and calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]


def test_call_array_cut_short_or_not_an_array():
    cut = CALL_ARRAY[:60]
    assert parse_reply(CallArrayParser(), cut, stopped=False) == parse_reply(CallArrayParser(), cut, stopped=True)
    assert parse_reply(CallArrayParser(), cut, stopped=False).content == cut
    assert folded(streamed(CallArrayParser(), cut, 5, stopped=False))[1] == [("get_weather", cut[cut.index('{"city'):])]
    second = CALL_ARRAY.index('{"name": "get_time"')
    past_first = parse_reply(CallArrayParser(), CALL_ARRAY[:second + 20], stopped=False)  # cut in the second call
    whole = parse_reply(CallArrayParser(), CALL_ARRAY, stopped=True)
    assert past_first.content is None and past_first.tool_calls[0]["function"] == whole.tool_calls[0]["function"]
    assert len(past_first.tool_calls) == 1  # the one it completed
    assert parse_reply(CallArrayParser(), "no calls", stopped=True).content == "no calls"
    assert folded(streamed(CallArrayParser(), "no calls", 2)) == ("no calls", [])
    assert len(parse_reply(CallArrayParser(max_calls=1), CALL_ARRAY, stopped=True).tool_calls) == 1


def test_named_function_arguments():
    text = '{"zone": "UTC"}'
    whole = parse_reply(FunctionArgumentsParser("get_time"), text, stopped=True)
    assert whole.content is None and whole.tool_calls[0]["function"] == {"name": "get_time", "arguments": text}
    assert folded(streamed(FunctionArgumentsParser("get_time"), text, 2)) == ("", [("get_time", text)])
    assert parse_reply(FunctionArgumentsParser("get_time"), '{"zone": "U', stopped=False).content == '{"zone": "U'


# ---- the prompt ------------------------------------------------------------------------------------------
FOLLOW_UP = [{"role": "system", "content": "You are terse."}, *QUESTION,
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
                             {"id": "call_2", "type": "function",
                              "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
             {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]


def as_template_takes_them(messages: list[dict]) -> list[dict]:
    """FOLLOW_UP as ChatCompletionRequest.chat() gives it: text content, arguments as objects."""
    out = []
    for message in copy.deepcopy(messages):
        message["content"] = message["content"] or ""
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def test_a_template_without_tools_gets_them_written_in_hermes_style(tokenizer):
    assert not template_takes_tools(tokenizer)  # SmolLM2's ChatML
    messages, added = hermes_messages(as_template_takes_them(FOLLOW_UP), TOOLS)
    tool_lines = "\n".join(json.dumps(tool) for tool in TOOLS)
    assert added == 0 and messages[0] == {"role": "system",
                                          "content": "You are terse.\n\n" + TOOLS_SECTION.format(tools=tool_lines)}
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
                           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, clear\n</tool_response>\n"
                                                      "<tool_response>\n14:05\n</tool_response>"}
    assert len(messages) == 4 and all(set(m) == {"role", "content"} for m in messages)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + tool_lines + "\n</tools>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert "# Tools" in rendered and "<|im_start|>user\n<tool_response>" in rendered
    # without a system message one is added in front, and counted among the shared ones
    first, added = hermes_messages(as_template_takes_them(QUESTION), TOOLS)
    assert added == 1 and first[0]["content"].startswith("# Tools") and first[1] == QUESTION[0]
    assert chat_prompt(tokenizer, as_template_takes_them(QUESTION), TOOLS, 1) == (first, 2)


def test_a_template_that_takes_tools_renders_them(tokenizer):
    own = copy.deepcopy(tokenizer)
    own.chat_template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}{{ '\\n' }}"
        "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
        "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    assert template_takes_tools(own)
    prompt, shared = chat_prompt(own, as_template_takes_them(FOLLOW_UP), TOOLS, 1)
    assert shared == 0 and prompt == (
        "TOOLS get_weather,get_time\nsystem: You are terse.\nuser: What is the weather in Paris?\n"
        'assistant: [get_weather {"city": "Paris", "unit": "C"}][get_time {"zone": "CET"}]\n'
        "tool: 18 C, clear (call_1)\ntool: 14:05 (call_2)\nassistant:")


# ---- through the server ----------------------------------------------------------------------------------
def assert_valid_calls(calls: list[tuple[str, str]], most: int | None = None) -> None:
    assert calls and (most is None or len(calls) <= most), calls
    for name, arguments in calls:
        assert schema_errors(json.loads(arguments), SCHEMAS[name]) == [], (name, arguments)


def collected(chunks) -> tuple[str, list[tuple[str, str]], list[str | None]]:
    """A streamed reply's content, calls and finish reasons, assembled as a client does."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None
                    calls[call.index][1] += call.function.arguments
            finishes.append(choice.finish_reason) if choice.finish_reason else None
    return content, [tuple(calls[i]) for i in sorted(calls)], finishes


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_gives_valid_calls(openai, parallel):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=0.0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert all(call.type == "function" and call.id.startswith("call_") for call in choice.message.tool_calls)
    assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                       None if parallel else 1)
    content, calls, finishes = collected(openai.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        temperature=0.0, max_tokens=200, stream=True))
    assert content == "" and finishes == ["tool_calls"]
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_named_function_gives_its_arguments(openai):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=named,
                                           temperature=0.0, max_tokens=64)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert_valid_calls([(call.function.name, call.function.arguments)])
    content, calls, finishes = collected(openai.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=0.0, max_tokens=64, stream=True))
    assert (content, calls, finishes) == ("", [("get_time", call.function.arguments)], ["tool_calls"])


def test_each_sample_is_read_on_its_own(openai):
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           n=2, temperature=1.0, seed=3, max_tokens=200)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


def test_auto_reads_hermes_blocks_out_of_the_reply(openai):
    """A choice constraint makes the random model write a Hermes reply, which `auto` reads."""
    spelled = {"guided_choice": [HERMES_REPLY]}
    reply = openai.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0.0,
                                           max_tokens=120, extra_body=spelled)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    content, calls, finishes = collected(openai.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, temperature=0.0, max_tokens=120, stream=True,
        extra_body=spelled))
    assert content == "Let me look." and finishes == ["tool_calls"]
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_and_none_leave_plain_text_as_content(openai):
    """The random model writes no call: its text is the content, as without tools."""
    for tool_choice in ("auto", "none"):
        reply = openai.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                               temperature=0.0, max_tokens=8)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
        assert reply.choices[0].message.content


def test_a_conversation_goes_on_after_its_calls(openai, tokenizer):
    reply = openai.chat.completions.create(model="tiny", messages=FOLLOW_UP, tools=TOOLS, temperature=0.0,
                                           max_tokens=4)
    assert reply.choices[0].message.role == "assistant"
    messages, _ = hermes_messages(as_template_takes_them(FOLLOW_UP), TOOLS)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, "messages"),
], ids=["choice-without-tools", "unknown-function", "empty-tools", "same-name-twice", "unknown-choice",
        "schema-does-not-compile", "with-response-format", "calls-on-a-user-message", "arguments-not-json"])
def test_inconsistent_tool_requests_are_400(url, fields, param):
    body = {"messages": QUESTION, "max_tokens": 4, **fields}
    refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param, refused.json()


def test_auto_keeps_special_tool_tags_in_the_text_it_reads(tokenizer):
    """A tokenizer holding `<tool_call>` as a special token (Hermes-2-Pro's) would lose the tags
    when decoding skips special tokens: with tools on auto, they are kept, as vLLM's Hermes parser
    does. SmolLM2's tokenizer has no such token, so its replies decode as asked."""
    assert not Completions(None, tokenizer, "tiny")._tool_tags_are_special
    hermes = copy.deepcopy(tokenizer)
    hermes.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert Completions(None, hermes, "tiny")._tool_tags_are_special
