"""A constrained JSON reply closes before its max_tokens (engine/worker/structured/json_closing.py):
the tracker of a reply's open structure, the vocabulary's closing tiers as xgrammar bitmask rows,
and, through the whole engine on a tiny random model, replies that parse whatever the weights say
and however small the budget — where, with the closing turned off, the same requests are cut."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.core.sampling_params import StructuredOutputsParams
from engine.worker.structured import json_closing
from engine.worker.structured.grammar import grammar_of
from engine.worker.structured.json_closing import ClosingMasks, OpenJson, closes_string, closing_level
from engine.worker.structured.schema_costs import SchemaCosts, key_pieces, literal_pieces

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"]}
# Long required keys, an enum, a nested object that requires its own: what a reply cut by its
# budget misses most often when only its open brackets are counted.
PROFILE = {"type": "object", "additionalProperties": False,
           "properties": {"display_name": {"type": "string"}, "favourite_colour": {"enum": ["red", "green", "blue"]},
                          "year_of_birth": {"type": "integer"},
                          "home_address": {"$ref": "#/$defs/address"}, "nicknames": {"type": "array", "items": {"type": "string"}}},
           "required": ["display_name", "favourite_colour", "year_of_birth", "home_address"],
           "$defs": {"address": {"type": "object", "additionalProperties": False,
                                 "properties": {"street_name": {"type": "string"}, "postal_code": {"type": "string", "minLength": 4}},
                                 "required": ["street_name", "postal_code"]}}}
SEEDS = 3
PROMPTS = ["Describe a user as JSON.", "A wiki editor, please.", "Who runs the site?", "Give me a record."]


def opened(text: str) -> OpenJson:
    reply = OpenJson()
    reply.feed(text.encode())
    return reply


@pytest.mark.parametrize("text, pieces, whole", [
    ("", 2, False),                              # a value: `"`, `"`
    ("{", 1, False),                             # `}`
    ('{"na', 5, False),                          # `"`, `: `, `"`, `"`, `}`
    ('{"name"', 4, False),                       # `: `, `"`, `"`, `}`
    ('{"name": ', 3, False),                     # `"`, `"`, `}`
    ('{"name": "Al\\', 3, False),                # the escape's character, `"`, `}`
    ('{"name": "Al\\u00', 3, False),
    ('{"name": "say \\"hi\\" [{', 2, False),     # brackets and quotes inside a string are text
    ('{"a": [1, {"b": tr', 4, False),            # the literal, `}`, `]`, `}`
    ('{"a": [1, 2], ', 6, False),                # a key and its value after the comma, `}`
    ('{"a": [1, 2], "b": {}}', 0, True),
    ('{"a": "é✓ \\u00e9"}', 0, True),
    ("[1, 2]", 0, True),
])
def test_the_tracker_counts_what_closing_still_writes(text, pieces, whole):
    reply = opened(text)
    assert reply.pieces_to_close() == pieces and reply.whole is whole
    # Fed a token at a time (UTF-8 split anywhere), the same.
    split = OpenJson()
    for i in range(0, len(text.encode()), 3):
        split.feed(text.encode()[i:i + 3])
    assert split == reply
    twin = reply.copy()
    twin.feed(b'"')
    assert twin != reply or not text  # a copy moves on its own


def test_under_a_schema_the_tracker_counts_the_required_keys_still_to_write():
    costs = SchemaCosts(PROFILE)
    address = 2 + (1 + key_pieces("street_name") + 2) + (1 + key_pieces("postal_code") + 2 + 4)
    colour = max(literal_pieces(c) for c in ("red", "green", "blue"))  # the costliest member: the model picks
    whole = 2 + sum(1 + key_pieces(key) + value for key, value in
                    [("display_name", 2), ("favourite_colour", colour), ("year_of_birth", 1), ("home_address", address)])
    assert costs.value_pieces(PROFILE) == whole

    def pieces(text: str) -> int:
        reply = OpenJson(schema=costs)
        reply.feed(text.encode())
        return reply.pieces_to_close()

    assert pieces("") == whole and pieces("{") == whole - 1  # `{` written
    done = '{"display_name": "Al", "favourite_colour": "red", "year_of_birth": 1990, '
    # After the comma: the one key left and its object, with its own required keys, then `}`.
    assert pieces(done) == key_pieces("home_address") + address + 1
    assert pieces(done + '"home_address": ') == address + 1
    assert pieces(done + '"home_address": {"street_name": "Elm"') == 1 + key_pieces("postal_code") + 2 + 4 + 2
    assert pieces(done + '"home_address": {"street_name": "Elm", "postal_code": "1234"}}') == 0
    # A key being written is the required key it begins, not one more.
    assert pieces('{"display_na') == 1 + 1 + 3 + costs.missing_pieces(PROFILE, {"display_name"})  # `"`, `: ""`, `}`
    # Optional keys ask nothing; a copy carries the keys written and moves on its own.
    reply = OpenJson(schema=costs)
    reply.feed(done.encode())
    twin = reply.copy()
    twin.feed(b'"home_address": {"street_name": "Elm", "postal_code": "1234"}}')
    assert twin.whole and not reply.whole and reply.frames[0].keys == {"display_name", "favourite_colour", "year_of_birth"}


def test_the_costs_follow_refs_branches_and_arrays():
    """Tool calls as the API constrains them: an array of at least one call, each one of the tools
    (anyOf). Which tool the model calls is its choice, so the costliest call counts."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"const": "get_weather"}, "parameters": weather}, "required": ["name", "parameters"]},
        {"properties": {"name": {"const": "now"}, "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    costs = SchemaCosts(calls)
    items = costs.items(calls)
    parameters = 2 + 1 + key_pieces("city") + 2
    assert costs.value_pieces(costs.property(items, "parameters")) == parameters
    costliest_call = 2 + (1 + key_pieces("name") + literal_pieces("get_weather")) + (1 + key_pieces("parameters") + parameters)
    assert costs.value_pieces(calls) == 2 + 1 + costliest_call
    reply = OpenJson(schema=costs)
    reply.feed(b"[")
    assert reply.pieces_to_close() == 1 + 1 + costliest_call  # `]`, and the one call minItems asks for
    reply.feed(b'{"name": "now", "parameters": {}}')
    assert reply.pieces_to_close() == 1 and reply.margin() == 1 + costliest_call  # a comma opens another call
    loop = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                                       "required": ["next"]}}}
    assert SchemaCosts(loop).value_pieces(loop) > 0  # a schema that requires itself stops counting
    odd = {"type": "object", "required": "name", "properties": {"name": {"type": "string", "minLength": "5"}},
           "anyOf": "x", "items": 3}
    assert SchemaCosts(odd).value_pieces(odd) == 2 and SchemaCosts(odd).missing_pieces(odd, set()) == 0  # never raises


def test_closing_tokens_by_how_early_they_are_taken():
    assert [closing_level(t) for t in ("}", "]}", "}}]")] == [1] * 3
    assert [closing_level(t) for t in ('"', '"}', '"]}}')] == [2] * 3
    assert [closing_level(t) for t in (":", '": ', " }", ' "')] == [3] * 4
    assert [closing_level(t) for t in (",", '", "', ' "",', "},")] == [4] * 4  # a comma only when nothing closes
    assert [closing_level(t) for t in ("0", "12", "-", "null", " true", "false}", "1,")] == [5] * 7
    assert [closing_level(t) for t in ("", " ", "\n", "a", "{", "nullable", ",{")] == [0] * 7
    # Inside a string only the quote closes: `}` and `]` there are text.
    assert [closes_string(t) for t in ('"', '"}', '}"', "}", "]}", '": ', "a\"")] == [True, True, True] + [False] * 4


def test_the_masks_are_rows_of_xgrammars_bitmask(tokenizer):
    """Each row lets exactly its tokens through, in xgrammar's bit order: checked by applying the
    row to logits with xgrammar's own kernel."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    masks = ClosingMasks(info.decoded_vocab, info.stop_token_ids, len(tokenizer))
    texts = [t.decode("utf-8", "replace") for t in info.decoded_vocab]

    def kept(bits: torch.Tensor) -> set[int]:
        logits = torch.zeros(1, len(tokenizer))
        xgr.apply_token_bitmask_inplace(logits, bits.unsqueeze(0).clone(), vocab_size=len(tokenizer))
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    for most, bits in enumerate(masks.outside, start=1):
        assert kept(bits) == {i for i, t in enumerate(texts) if 0 < closing_level(t) <= most}
    assert tokenizer.convert_tokens_to_ids("}") in kept(masks.outside[0])
    assert kept(masks.in_string) == {i for i, t in enumerate(texts) if closes_string(t)}
    assert kept(masks.stops) == {2}


def test_a_row_narrows_only_when_the_budget_is_down_to_closing(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    masks = ClosingMasks(info.decoded_vocab, info.stop_token_ids, len(tokenizer))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(
        grammar_of(StructuredOutputsParams(json_object=True))))
    reply = OpenJson()
    for token in tokenizer.encode('{"story": "Once upon a time', add_special_tokens=False):
        assert matcher.accept_token(token)
        reply.feed(info.decoded_vocab[token])
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    grammar_row = bitmask[0].clone()
    pieces = reply.pieces_to_close()
    assert not masks.narrow_(bitmask[0], reply, pieces + 1 + json_closing.MARGIN + 1)  # 1: the stop token
    assert torch.equal(bitmask[0], grammar_row)
    assert masks.narrow_(bitmask[0], reply, pieces + 1 + json_closing.MARGIN)
    assert torch.equal(bitmask[0], grammar_row & masks.in_string)  # inside the story's string: its quote
    # Once closing, it goes on closing, whatever the budget says.
    bitmask[0] = grammar_row
    assert masks.narrow_(bitmask[0], reply, 10_000) and torch.equal(bitmask[0], grammar_row & masks.in_string)


def test_text_the_grammar_forces_while_closing_takes_its_longest_tokens(tokenizer):
    """A schema's key must be spelled whatever the budget: closing takes it in the longest
    tokens the grammar allows, not in the one-letter pieces a model may pick."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    masks = ClosingMasks(info.decoded_vocab, info.stop_token_ids, len(tokenizer))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar_of(StructuredOutputsParams(json=PROFILE))))
    reply = OpenJson(schema=SchemaCosts(PROFILE))
    for token in tokenizer.encode('{"', add_special_tokens=False):
        assert matcher.accept_token(token)
        reply.feed(info.decoded_vocab[token])
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = {i for i in range(len(tokenizer)) if bitmask[0, i // 32] >> (i % 32) & 1}
    assert min(len(info.decoded_vocab[i]) for i in allowed) == 1  # "d", "di", "dis", ... "display"
    assert masks.narrow_(bitmask[0], reply, 1)
    narrowed = {i for i in allowed if bitmask[0, i // 32] >> (i % 32) & 1}
    longest = max(len(info.decoded_vocab[i]) for i in allowed)
    assert narrowed and {len(info.decoded_vocab[i]) for i in narrowed} <= set(range(min(json_closing.LONG_TOKENS), longest + 1))
    assert all(len(info.decoded_vocab[i]) >= max(t for t in json_closing.LONG_TOKENS if t <= longest) for i in narrowed)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=64)


def requests(max_tokens: int, **structured) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                           structured_outputs=StructuredOutputsParams(**structured))
            for temperature in (0.0, 0.8, 1.2) for seed in range(SEEDS)]


def replies(llm, max_tokens: int, **structured) -> list:
    params = requests(max_tokens, **structured)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return [output.outputs[0] for output in llm.generate(prompts, params)]


@pytest.mark.parametrize("max_tokens", [6, 12, 40])
def test_json_object_replies_close_within_max_tokens(llm, max_tokens, monkeypatch):
    done = replies(llm, max_tokens, json_object=True)
    for reply in done:
        assert isinstance(json.loads(reply.text), dict), reply.text
        assert reply.finish_reason == "stop" and len(reply.token_ids) <= max_tokens, (reply.text, [llm.tokenizer.decode([t]) for t in reply.token_ids])
    # The same requests without the closing: the random weights run on until they are cut.
    monkeypatch.setattr(ClosingMasks, "narrow_", lambda *args: False)
    cut = [r for r in replies(llm, max_tokens, json_object=True) if r.finish_reason == "length"]
    assert cut and not any(_parses(r.text) for r in cut)


def valid(replies_: list, schema: dict) -> int:
    return sum(r.finish_reason == "stop" and _validates(r.text, schema) for r in replies_)


def test_a_schemas_replies_close_within_max_tokens_and_validate(llm, monkeypatch):
    closed = replies(llm, 16, json=CITY)
    assert valid(closed, CITY) == len(closed), [r.text for r in closed if not _validates(r.text, CITY)]
    monkeypatch.setattr(ClosingMasks, "narrow_", lambda *args: False)
    assert valid(replies(llm, 16, json=CITY), CITY) < len(closed)


@pytest.mark.parametrize("max_tokens", [75, 90])
def test_required_keys_are_counted_before_the_reply_runs_short(llm, max_tokens, monkeypatch):
    """The keys a schema requires, and the objects they hold, are counted before the reply runs
    short, so every reply has room to spell them. Counting only its open brackets, none does."""
    closed = replies(llm, max_tokens, json=PROFILE)
    assert valid(closed, PROFILE) == len(closed), [r.text for r in closed if not _validates(r.text, PROFILE)]
    monkeypatch.setattr(SchemaCosts, "missing_pieces", lambda *args: 0)
    monkeypatch.setattr(SchemaCosts, "value_pieces", lambda *args: 2)
    assert valid(replies(llm, max_tokens, json=PROFILE), PROFILE) < len(closed)


def test_closing_leaves_replies_with_room_as_they_were(llm, monkeypatch):
    """Far from max_tokens nothing is narrowed: a reply that ends well within its budget is the
    one the grammar alone gives."""
    choices = replies(llm, 200, json={"enum": ["yes", "no", "maybe"]})
    monkeypatch.setattr(ClosingMasks, "narrow_", lambda *args: False)
    assert [r.token_ids for r in replies(llm, 200, json={"enum": ["yes", "no", "maybe"]})] == [r.token_ids for r in choices]


def _validates(text: str, schema: dict = CITY) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
