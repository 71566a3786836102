"""A constrained JSON reply that nears its max_tokens closes instead of being cut.

A small model sampling at a high temperature can run on inside one string, or repeat a key, until
its max_tokens: the reply is then cut mid-structure and is not JSON, although the grammar allowed
every token of it. So once the tokens a reply has left are only just enough to close what it has
open (a string, a key waiting for its value, its objects and arrays, and under a schema the
required keys it has not written, schema_costs.py), its next token is narrowed, within what the
grammar allows, to tokens that close. Inside a string, tokens with its closing quote (inside a
string `}` and `]` are text). Outside one: first tokens made only of `}` and `]`; where the grammar
allows none of those (a key must come, a value must begin), tokens of those and `"`; then also
`:` and spaces; then also `,`; then also digits and the literals; only then anything the grammar allows (a
schema's required key is spelled as its grammar says). Once the JSON is whole, the stop tokens.
The reply ends at its grammar's end, as any JSON reply does, a few tokens shorter than the model
would have written it; what it wrote before is untouched.

OpenJson follows a reply's text byte by byte (the structural characters are ASCII, so a token that
splits a UTF-8 character needs no decoding) and says how many tokens closing it takes at most.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.worker.structured.schema_costs import SchemaCosts

# Closing starts when the tokens left are at most those closing takes, the stop token and what one
# token written freely just before may add (a comma: a key, its colon and value): at least this.
MARGIN = 5

# Bytes of the tokens preferred, longest first, where the grammar forces text while closing.
LONG_TOKENS = (12, 8, 6, 5, 4, 3, 2)
WHITESPACE = frozenset(b" \t\r\n")
LITERALS = ("null", "true", "false")
CLOSING_CHARACTERS = '"}]:, 0123456789-.'


@dataclass
class Frame:
    """An open object or array under a schema: its subschema, and for an object the keys written."""
    node: dict | None
    keys: set[str] = field(default_factory=set)


@dataclass
class OpenJson:
    """Where a JSON text stands: its open objects and arrays, whether it is inside a string (a key
    or a value) or a number or literal, and what it expects next. Given its schema's costs, also
    each open container's subschema and keys written, for what the schema still requires."""
    stack: list[int] = field(default_factory=list)  # b"{" or b"[" for each open container
    in_string: bool = False
    escape: int = 0  # inside a string: -1 just after a backslash, n > 0: hex digits of \\u still to come
    string_is_key: bool = False
    expect: str = "value"  # value, key, key_or_end, value_or_end, colon, after
    scalar: bool = False  # inside a number or a literal
    schema: SchemaCosts | None = None
    frames: list[Frame] = field(default_factory=list)  # with a schema: one per entry of stack
    key: bytearray = field(default_factory=bytearray)  # with a schema: the key being read, or the last
    pending: dict | None = None  # with a schema: the subschema of the value expected next
    closing: bool = False  # once it starts closing it goes on (a free token may open more than it closes)

    def __post_init__(self) -> None:
        if self.schema is not None and not self.stack:
            self.pending = self.schema.resolve(self.schema.root)

    def feed(self, data: bytes) -> None:
        schema = self.schema
        for c in data:
            if self.in_string:
                if self.escape == -1:
                    self.escape = 4 if c == ord("u") else 0
                elif self.escape > 0:
                    self.escape -= 1
                elif c == ord("\\"):
                    self.escape = -1
                elif c == ord('"'):
                    self.in_string = False
                    self.expect = "colon" if self.string_is_key else "after"
                    if schema is not None and self.string_is_key and self.frames:
                        key = self.key.decode("utf-8", "replace")
                        self.frames[-1].keys.add(key)
                        self.pending = schema.property(self.frames[-1].node, key)
                    continue
                if schema is not None and self.string_is_key:
                    self.key.append(c)  # a key's escapes are kept as written: keys are compared, not decoded
                continue
            if c in WHITESPACE:
                if self.scalar:
                    self.scalar, self.expect = False, "after"
                continue
            if c == ord('"'):
                self.in_string, self.scalar = True, False
                self.string_is_key = self.expect in ("key", "key_or_end")
                if schema is not None and self.string_is_key:
                    self.key.clear()
            elif c in b"{[":
                self.stack.append(c)
                self.scalar = False
                self.expect = "key_or_end" if c == ord("{") else "value_or_end"
                if schema is not None:
                    self.frames.append(Frame(self.pending))
                    self.pending = schema.items(self.pending) if c == ord("[") else None
            elif c in b"}]":
                if self.stack:
                    self.stack.pop()
                    if schema is not None and self.frames:
                        self.frames.pop()
                self.scalar, self.expect = False, "after"
                self.pending = None
            elif c == ord(":"):
                self.scalar, self.expect = False, "value"
            elif c == ord(","):
                self.scalar = False
                in_object = self.stack and self.stack[-1] == ord("{")
                self.expect = "key" if in_object else "value"
                if schema is not None and self.frames:
                    self.pending = None if in_object else schema.items(self.frames[-1].node)
            else:  # a number's or a literal's character
                self.scalar, self.expect = True, "after"

    @property
    def whole(self) -> bool:
        """A complete JSON value: nothing open, nothing expected."""
        return not self.stack and not self.in_string and self.expect == "after"

    def pieces_to_close(self) -> int:
        """At most how many tokens closing takes: a string's quote (and its escape's rest), a key's
        colon and value (a value: `"` and `"`), a number's or literal's last character, each `}`
        or `]`; tokens that join them (`"}`, `""`, `"]}`) only make it fewer. Under a schema, also
        every open object's required keys not yet written, and a value expected that the schema
        makes longer than `""` (an object with required keys, an enum's member)."""
        pieces = len(self.stack) + self.scalar
        if self.in_string:
            pieces += 1 + bool(self.escape) + (3 if self.string_is_key else 0)
        else:
            pieces += {"colon": 3, "value": 2, "key": 5}.get(self.expect, 0)
        schema = self.schema
        if schema is None:
            return pieces
        writing_key = self.in_string and self.string_is_key
        for i, frame in enumerate(self.frames):
            if self.stack[i] == ord("{"):
                top = i == len(self.frames) - 1
                missing = schema.missing_pieces(frame.node, frame.keys, self.key.decode("utf-8", "replace") if top and writing_key else None)
                if top and self.expect == "key" and not self.in_string:
                    # The comma is written, and the key counted above is the first of them.
                    missing = max(0, missing - 1 - 5)
                pieces += missing
        if not self.in_string and self.expect in ("colon", "value"):
            pieces += max(0, schema.value_pieces(self.pending) - 2)
        elif self.expect == "value_or_end" and self.frames:  # an array just opened: its minItems
            pieces += schema.min_items(self.frames[-1].node) * (1 + schema.value_pieces(self.pending))
        return pieces

    def margin(self) -> int:
        """At most what one token written freely may add: a comma and what it opens, a key and its
        value in an object, an item in an array (under a schema, the costliest it allows)."""
        schema, most = self.schema, MARGIN
        if schema is not None:
            for opener, frame in zip(self.stack, self.frames):
                if opener == ord("["):
                    most = max(most, 1 + schema.value_pieces(schema.items(frame.node)))
                else:
                    most = max(most, schema.comma_pieces(frame.node, frame.keys))
        return most

    def copy(self) -> OpenJson:
        return OpenJson(list(self.stack), self.in_string, self.escape, self.string_is_key, self.expect, self.scalar,
                        self.schema, [Frame(f.node, set(f.keys)) for f in self.frames], bytearray(self.key), self.pending,
                        self.closing)


def closing_level(text: str) -> int:
    """Outside a string, how early a token's text may close (1 is tried first), 0 never: 1 only
    `}` and `]`; 2 those and `"`; 3 those, `:` and spaces; 4 those and `,` (taken only where the
    grammar allows none of the above: a schema's required key must come); 5 those, digits, sign and
    point, or a literal among them."""
    if not text or text.isspace():
        return 0
    chars = set(text)
    if chars <= set("}]"):
        return 1
    if chars <= set('"}]'):
        return 2
    if chars <= set('"}]: '):
        return 3
    if chars <= set('"}]:, '):
        return 4
    if chars <= set(CLOSING_CHARACTERS) or text.strip('"}]:, ') in LITERALS:
        return 5
    return 0


def closes_string(text: str) -> bool:
    """Inside a string: the token ends it (its quote), with nothing but closers after."""
    return '"' in text and set(text) <= set('"}]')


class ClosingMasks:
    """The vocabulary's closing tokens and stop tokens as bitmask rows (xgrammar's layout: token i
    is bit i % 32 of int32 word i // 32), made once from the decoded vocabulary."""

    def __init__(self, decoded_vocab: Sequence[bytes], stop_token_ids: Sequence[int], vocab_size: int) -> None:
        words = (vocab_size + 31) // 32
        self.token_bytes = list(decoded_vocab[:vocab_size])  # what each token adds to a reply's text
        # Only tokens made of closing characters (and the literals) can be any of them: a quick
        # filter first, as the vocabulary has tens of thousands of tokens.
        texts = {i: text for i, token in enumerate(self.token_bytes)
                 if (text := token.decode("utf-8", "replace")) and text.strip(CLOSING_CHARACTERS) in ("", *LITERALS)}
        levels = {i: closing_level(text) for i, text in texts.items()}
        self.outside = [self._bits([i for i, level in levels.items() if 0 < level <= most], words)
                        for most in (1, 2, 3, 4, 5)]
        self.in_string = self._bits([i for i, text in texts.items() if closes_string(text)], words)
        self.stops = self._bits([i for i in stop_token_ids if i < vocab_size], words)
        # Where the grammar allows no closing token (it spells a key, an enum's member, a string's
        # minLength), the longest tokens it allows, so that the text it forces takes few tokens.
        longest = [self._bits([i for i, token in enumerate(self.token_bytes) if len(token) >= least], words)
                   for least in LONG_TOKENS]
        # Each case's tiers as the rows of one tensor, tried in order by one AND.
        self._tiers = {"whole": torch.stack([self.stops, *longest]), "in_string": torch.stack([self.in_string, *longest]),
                       "outside": torch.stack([*self.outside, *longest])}

    @staticmethod
    def _bits(token_ids: list[int], words: int) -> torch.Tensor:
        bits = np.zeros(words, dtype=np.uint32)
        ids = np.asarray(token_ids, dtype=np.int64)
        np.bitwise_or.at(bits, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return torch.from_numpy(bits.view(np.int32))

    def narrow_(self, row: torch.Tensor, reply: OpenJson, tokens_left: int) -> bool:
        """Narrow one bitmask row (the grammar's allowed tokens, in place) if `reply` must close
        now or has started closing, `tokens_left` counting this token. True when it was narrowed."""
        if not reply.closing:
            if tokens_left > reply.pieces_to_close() + 1 + reply.margin():  # 1: the stop token, so that it ends "stop"
                return False
            reply.closing = True
        tiers = self._tiers["whole" if reply.whole else "in_string" if reply.in_string else "outside"]
        both = tiers & row
        found = torch.nonzero(both.any(dim=1))
        if not len(found):
            return False
        row.copy_(both[found[0, 0]])
        return True
