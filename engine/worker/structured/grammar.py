"""A request's constraint as an xgrammar `Grammar`: the one place that reads StructuredOutputsParams
for the grammar library, so the frontend's check at the edge and the engine's compile agree.

Converting is cheap (well under a millisecond for a typical schema) and needs no vocabulary; it
is what finds a broken schema, regex or grammar. Compiling against the vocabulary (the token
masks) is the costly part, done on the engine's side off its loop (grammar_compiler.py)."""
from __future__ import annotations

import json

import xgrammar as xgr

from engine.core.sampling_params import InvalidStructuredOutputsError, StructuredOutputsParams

# With `disable_any_whitespace`, JSON separators as json.dumps writes them: one space after each
# ',' and ':', none elsewhere.
JSON_SEPARATORS = (", ", ": ")
# xgrammar (0.2) writes a string with minLength or maxLength as characters of this class, which
# lets raw control characters through (JSON allows none: a strict parser refuses the reply); its
# plain strings use the JSON class. As EBNF text, the first becomes the second.
LENIENT_STRING_CHARACTER = r'[^\"\\\r\n]'
JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def grammar_of(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar a reply must match; InvalidStructuredOutputsError names the field and the fault."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return _json_strings_without_control_characters(xgr.Grammar.from_json_schema(schema, **json_layout(params)))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **json_layout(params))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        raise InvalidStructuredOutputsError(f"the {kind} constraint does not compile: {_reason(error)}") from None


def json_layout(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"any_whitespace": False, "separators": JSON_SEPARATORS}
    return {"any_whitespace": True}


def _json_strings_without_control_characters(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if LENIENT_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(LENIENT_STRING_CHARACTER, JSON_STRING_CHARACTER))


def _reason(error: Exception) -> str:
    """xgrammar's message without its source location ("[12:00:00] /project/cpp/x.cc:42: ...")."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else text
