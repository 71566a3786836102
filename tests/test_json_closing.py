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

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"]}
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


def test_closing_tokens_by_how_early_they_are_taken():
    assert [closing_level(t) for t in ("}", "]}", "}}]")] == [1] * 3
    assert [closing_level(t) for t in ('"', '"}', '"]}}')] == [2] * 3
    assert [closing_level(t) for t in (":", '": ', " }", ' "')] == [3] * 4
    assert [closing_level(t) for t in ("0", "12", "-", "null", " true", "false}")] == [4] * 6
    assert [closing_level(t) for t in ("", " ", "\n", ",", "a", '", "', "{", "nullable")] == [0] * 8
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


def test_a_schemas_replies_mostly_close_within_max_tokens_and_validate(llm, monkeypatch):
    """A schema's keys are spelled as it says (a key's name may take several tokens the tracker
    does not count): closing is best effort there, and still turns cut replies into valid ones."""
    def valid(replies_: list) -> int:
        return sum(r.finish_reason == "stop" and _validates(r.text) for r in replies_)

    closed = replies(llm, 16, json=CITY)
    assert valid(closed) >= len(closed) - 1
    monkeypatch.setattr(ClosingMasks, "narrow_", lambda *args: False)
    assert valid(replies(llm, 16, json=CITY)) < valid(closed)


def test_closing_leaves_replies_with_room_as_they_were(llm, monkeypatch):
    """Far from max_tokens nothing is narrowed: a reply that ends well within its budget is the
    one the grammar alone gives."""
    choices = replies(llm, 200, json={"enum": ["yes", "no", "maybe"]})
    monkeypatch.setattr(ClosingMasks, "narrow_", lambda *args: False)
    assert [r.token_ids for r in replies(llm, 200, json={"enum": ["yes", "no", "maybe"]})] == [r.token_ids for r in choices]


def _validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), CITY)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
