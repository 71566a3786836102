"""What `tools` and `tool_choice` ask of a chat reply, as vLLM reads them.

- `"none"`: no call; the tools still go in the prompt (vLLM's default), the reply is text.
- `"auto"` (the default when tools are given): the model may call; its reply is read for Hermes
  `<tool_call>` blocks (engine/api/tool_call_parser.py), unconstrained.
- `"required"`: the reply is constrained to a JSON array of calls, each
  `{"name": <one tool's name>, "parameters": <that tool's parameters>}` (anyOf over the tools;
  at most one item when `parallel_tool_calls` is false), then read into calls.
- `{"type": "function", "function": {"name": ...}}`: the reply is constrained to that function's
  `parameters` schema, and is its arguments.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from engine.api.errors import bad_request
from engine.api.output_format import Constraint
from engine.api.protocol import ChatCompletionRequest, NamedToolChoice
from engine.api.tool_call_parser import CallArrayParser, FunctionArgumentsParser, HermesParser, ReplyParser
from engine.core.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}  # a function declared without parameters still takes an object
MODES = ("none", "auto", "required")
NAMED = '{"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    tools: list[dict]         # OpenAI's shape: {"type": "function", "function": {name, description, parameters}}
    function: str | None = None  # mode "function": its name
    parallel: bool = True     # false: at most one call

    def constraint(self) -> Constraint | None:
        """The JSON schema the reply must match (`required` and a named function), or None."""
        if self.mode == "function":
            return Constraint(StructuredOutputsParams(json=self._parameters(self.function)), "tool_choice", "tools")
        if self.mode != "required":
            return None
        # A `$ref` in a tool's parameters points into its own `$defs` ("#/$defs/..."), which is
        # the root only of its own schema: nested here, the definitions move up to this root.
        definitions: dict = {}
        cases = []
        for name in self.names:
            parameters = dict(self._parameters(name))
            for key, definition in (parameters.pop("$defs", None) or {}).items():
                if definitions.setdefault(key, definition) != definition:
                    raise bad_request(f"tools define {key!r} in $defs twice, differently; with tool_choice "
                                      f"\"required\" every tool's $defs share one namespace", "tools")
            cases.append({"properties": {"name": {"type": "string", "const": name}, "parameters": parameters},
                          "required": ["name", "parameters"]})
        calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": cases}}
        if not self.parallel:
            calls["maxItems"] = 1
        if definitions:
            calls["$defs"] = definitions
        return Constraint(StructuredOutputsParams(json=calls), "tool_choice", "tools")

    def parser(self) -> Callable[[], ReplyParser] | None:
        """A new reader of one reply's calls, for each choice; None: the reply is text."""
        most = None if self.parallel else 1
        if self.mode == "auto":
            return lambda: HermesParser(most)
        if self.mode == "required":
            return lambda: CallArrayParser(most)
        if self.mode == "function":
            return lambda: FunctionArgumentsParser(self.function)
        return None

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def _parameters(self, name: str) -> dict:
        function = next(tool["function"] for tool in self.tools if tool["function"]["name"] == name)
        return function.get("parameters") or ANY_OBJECT


def tool_choice_of(body: ChatCompletionRequest) -> ToolChoice | None:
    """The request's tool choice (None without tools); APIError 400 names what is inconsistent."""
    if body.tools is None:
        if body.tool_choice is not None and body.tool_choice != "none":
            raise bad_request("tool_choice needs `tools`: the functions the model may call", "tool_choice")
        return None
    if not body.tools:
        raise bad_request("tools must not be empty: give at least one function, or leave tools out", "tools")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise bad_request(f"tools names {', '.join(twice)} more than once; each function needs its own name", "tools")
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice or "auto"
    if choice in MODES:
        return ToolChoice(choice, tools, parallel=parallel)
    try:
        name = NamedToolChoice.model_validate(choice).function.name
    except ValidationError:
        raise bad_request(f'tool_choice must be "none", "auto", "required" or {NAMED}, got '
                          f"{json.dumps(choice)[:200]}", "tool_choice") from None
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    return ToolChoice("function", tools, name, parallel)
