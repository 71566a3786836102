"""Tool calls read out of a reply's text, as it streams or whole, in the three shapes a reply
takes (engine/api/tool_choice.py says which):

- `HermesParser` (`tool_choice: "auto"`): text, and calls as Hermes / Qwen2.5 blocks,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `CallArrayParser` (`"required"`): `[{"name": ..., "parameters": {...}}, ...]`;
- `FunctionArgumentsParser` (a named function): the arguments object alone.

A parser is fed the reply's text delta by delta and answers with what may be sent now: text
(`Content`), a call's start (`CallStart`: its id and name) or a piece of its arguments' JSON
text (`CallArguments`). A whole reply is the same parser fed once (`parse_reply`), so a streamed
reply and a whole one say the same, except that a reply that ends up not being calls (not the
shape its constraint asked for) is, whole, all content, and one cut by max_tokens is, whole, the
calls it completed (its finish_reason stays "length"; streamed, the cut call's start went out too).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TAG, END_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among the reply's calls, from 0
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


Event = Content | CallStart | CallArguments


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[dict]  # OpenAI's: {"id", "type": "function", "function": {"name", "arguments"}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyParser:
    """One reply's reader: `feed` each text delta, then `finish` once."""
    calls = 0      # how many calls it has started
    valid = True   # after `finish`: whether the reply as a whole is what its shape asks for
    closed = 0     # how many of its calls are complete (their JSON closed)

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self, stopped: bool) -> list[Event]:
        """The reply has ended: what is left to send. `stopped`: it ended on its own (not cut by
        max_tokens or aborted), so an unfinished call is still read."""
        raise NotImplementedError


def parse_reply(parser: ReplyParser, text: str, stopped: bool) -> ParsedReply:
    """A whole reply's content and calls; content None when it has no text."""
    events = parser.feed(text) + parser.finish(stopped)
    if not parser.valid and (stopped or not parser.closed):
        return ParsedReply(text or None, [])
    calls: list[dict] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, CallArguments):
            calls[event.index]["function"]["arguments"] += event.text
    if not parser.valid:  # cut by max_tokens: the calls it completed, whatever came after them
        return ParsedReply(None, calls[:parser.closed])
    content = "".join(event.text for event in events if isinstance(event, Content))
    return ParsedReply(content or None, calls)


class HermesParser(ReplyParser):
    """Text with `<tool_call>` blocks. Text is sent as it comes, less what may be the start of a
    tag, and less trailing whitespace (dropped when a call follows it, sent when text does); a
    block is read when it closes (or, in a reply that stopped, when the reply ends): one whose
    JSON has a `name` and object `arguments` is a call, any other stays in the text as it was.
    The whitespace around calls is dropped. With `max_calls`, the calls after it are dropped
    (parallel_tool_calls false), as vLLM does."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self._buffer = ""        # text received, not yet sent
        self._in_call = False    # inside a <tool_call> block, whose text is the buffer
        self._held = ""          # the whitespace before the open block: dropped if it is a call
        self._after_call = False  # nothing but whitespace since the last call

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END_TAG)
                if end < 0:
                    return events
                block, self._buffer = self._buffer[:end], self._buffer[end + len(END_TAG):]
                events += self._close(block, closed=True, read=True)
                continue
            start = self._buffer.find(TAG)
            if start < 0:
                return events + self._text(final=False)
            before, self._buffer = self._buffer[:start], self._buffer[start + len(TAG):]
            before = before.lstrip() if self._after_call else before
            sendable = before.rstrip()
            self._held = before[len(sendable):]
            events += self._content(sendable)
            self._in_call = True

    def finish(self, stopped: bool) -> list[Event]:
        if self._in_call:
            block, self._buffer = self._buffer, ""
            return self._close(block, closed=False, read=stopped)
        return self._text(final=True)

    def _text(self, final: bool) -> list[Event]:
        """Send what of the buffered text (no tag in it) can go now."""
        if self._after_call:
            self._buffer = self._buffer.lstrip()
        if final:
            sendable = self._buffer
        else:
            head = self._buffer[:len(self._buffer) - _partial_tag(self._buffer)]
            sendable = head.rstrip()
        self._buffer = self._buffer[len(sendable):]
        return self._content(sendable)

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        self._after_call = False
        return [Content(text)]

    def _close(self, block: str, closed: bool, read: bool) -> list[Event]:
        self._in_call = False
        held, self._held = self._held, ""
        call = _hermes_call(block) if read else None
        if call is None:
            return self._content(held + TAG + block + (END_TAG if closed else ""))
        self._after_call = True
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, new_call_id(), call[0]), CallArguments(index, call[1])]


@dataclass
class _Element:
    """One item of the call array being read."""
    name: str | None = None
    index: int = -1             # its call's index once started; -2: dropped (over max_calls)
    arguments_start: int = -1   # where its parameters' text starts in the reply
    arguments_end: int = -1     # ... and ends, once known
    arguments_sent: int = -1    # how far that text has been sent
    pending: list[Event] = field(default_factory=list)


class CallArrayParser(ReplyParser):
    """`[{"name": "f", "parameters": {...}}, ...]` as it streams: a call starts once its name is
    whole, and its `parameters` text streams as the call's arguments. A reply that does not start
    with `[` is text."""
    ARGUMENTS = "parameters"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self.valid = False
        self._text = ""
        self._scanned = 0
        self._is_array: bool | None = None  # None until the first character that is not whitespace
        self._text_sent = 0     # for a reply that is text
        self._depth = 0         # open brackets
        self._in_string = False
        self._escape = False
        self._last = -1         # the last character scanned that is not whitespace
        self._expect = ""       # inside an item: "key", "value", or "" while in a value
        self._key_start = -1    # where the item's key being read starts
        self._key: str | None = None
        self._value_start = -1  # where the item's current value starts
        self._item: _Element | None = None

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        if self._is_array is not False:
            events += self._scan()
        if self._is_array is False and len(self._text) > self._text_sent:
            events.append(Content(self._text[self._text_sent:]))
            self._text_sent = len(self._text)
        return events

    def finish(self, stopped: bool) -> list[Event]:
        events = self._send(self._item, final=False) if self._item is not None else []
        self.valid = stopped and self.calls > 0 and _is_call_array(self._text, self.ARGUMENTS)
        return events

    def _scan(self) -> list[Event]:
        events: list[Event] = []
        text = self._text
        for i in range(self._scanned, len(text)):
            c = text[i]
            if self._in_string:
                self._last = i
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._key_start >= 0:
                        self._key = _loads(text[self._key_start:i + 1])
                        self._key_start = -1
                continue
            if c.isspace():
                continue
            if self._is_array is None:
                self._is_array = c == "["
                if not self._is_array:
                    self._scanned = len(text)
                    return events
            if self._depth == 0 and self._is_array and self._last >= 0:
                break  # after the array: nothing more is read
            if self._depth == 2 and self._expect == "value":
                self._value_start, self._expect = i, ""
                if self._item is not None and self._key == self.ARGUMENTS:
                    self._item.arguments_start = self._item.arguments_sent = i
            if c == '"':
                self._in_string = True
                if self._depth == 2 and self._expect == "key":
                    self._key_start = i
            elif c in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item, self._expect = (_Element(), "key") if c == "{" else (None, "")
            elif c in "]}":
                if self._depth == 2:
                    self._end_value()
                    if self._item is not None:
                        events += self._send(self._item, final=True)
                        self.closed += self._item.index >= 0
                    self._item = None
                self._depth -= 1
            elif self._depth == 2 and c == ":":
                self._expect = "value"
            elif self._depth == 2 and c == ",":
                self._end_value()
                self._expect = "key"
            self._last = i
        self._scanned = len(text)
        if self._item is not None:
            events += self._send(self._item, final=False)
        return events

    def _end_value(self) -> None:
        """The item's current value ended at the last character that is not whitespace."""
        if self._item is not None and self._value_start >= 0:
            if self._key == "name":
                name = _loads(self._text[self._value_start:self._last + 1])
                self._item.name = name if isinstance(name, str) and name else None
            elif self._key == self.ARGUMENTS:
                self._item.arguments_end = self._last + 1
        self._value_start, self._key = -1, None

    def _send(self, item: _Element, final: bool) -> list[Event]:
        """The item's events so far: its start once its name is whole, then its arguments' text
        up to what is scanned (less trailing whitespace); `final`: the item has closed."""
        if item.index == -1 and item.name is not None:
            if self.max_calls is not None and self.calls >= self.max_calls:
                item.index = -2
            else:
                item.index, self.calls = self.calls, self.calls + 1
                item.pending.append(CallStart(item.index, new_call_id(), item.name))
        if item.index < 0:
            return []
        if item.arguments_start >= 0:
            end = item.arguments_end if item.arguments_end >= 0 else self._last + 1
            if end > item.arguments_sent:
                item.pending.append(CallArguments(item.index, self._text[item.arguments_sent:end]))
                item.arguments_sent = end
        elif final:
            item.pending.append(CallArguments(item.index, "{}"))  # an item without parameters takes none
        events, item.pending = item.pending, []
        return events


class FunctionArgumentsParser(ReplyParser):
    """A named function's arguments object, the whole reply: the call starts with the reply's
    `{`, and the reply's text streams as its arguments. A reply that does not start with `{`
    is text."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.valid = False
        self._text = ""
        self._sent = 0
        self._is_call: bool | None = None

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        if self._is_call is None:
            solid = self._text.lstrip()
            if not solid:
                return events
            self._is_call = solid.startswith("{")
            if self._is_call:
                self.calls = 1
                self._sent = len(self._text) - len(solid)
                events.append(CallStart(0, new_call_id(), self.name))
        return events + self._send(final=False)

    def finish(self, stopped: bool) -> list[Event]:
        events = self._send(final=True)
        self.valid = stopped and self._is_call is True and isinstance(_loads(self._text), dict)
        return events

    def _send(self, final: bool) -> list[Event]:
        end = len(self._text.rstrip()) if self._is_call or not final else len(self._text)
        if self._is_call is None or end <= self._sent:
            return []
        piece, self._sent = self._text[self._sent:end], end
        return [CallArguments(0, piece) if self._is_call else Content(piece)]


def _hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a `<tool_call>` block's JSON, or None if it is not one.
    The arguments may come as `arguments` or `parameters`, as an object or its JSON text."""
    call = _loads(block)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _is_call_array(text: str, arguments: str) -> bool:
    calls = _loads(text)
    return isinstance(calls, list) and bool(calls) and all(
        isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get(arguments), dict)
        for call in calls)


def _partial_tag(text: str) -> int:
    """How many of the text's last characters may begin a `<tool_call>` tag."""
    for size in range(min(len(TAG) - 1, len(text)), 0, -1):
        if text.endswith(TAG[:size]):
            return size
    return 0


_NOT_JSON = object()


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON
