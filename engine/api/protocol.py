"""The request bodies of the OpenAI-compatible API: OpenAI's fields, plus the vLLM extras that fit
this engine, and how they become `SamplingParams`.

A field this server does not implement is refused (400 naming it), never dropped unread: a client
that sends `functions` or `prediction` would otherwise get a reply that ignores what it asked for
and not know. The few fields that change nothing about a reply are declared below and ignored,
each with its reason. An unknown field set to null (or an empty list or object) asks for nothing
and is let through: clients echo an earlier reply's `refusal: null` back in their messages."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sampling_params import SamplingParams, StructuredOutputsParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the reply must match `schema`."""
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # OpenAI asks for `strict: true` to enforce the schema; here the schema is always enforced,
    # as on vLLM, whichever it says.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object (engine/core/sampling_params.py's StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def params(self) -> StructuredOutputsParams:
        """The engine's form; ValueError says what is wrong (none or two constraints, ...)."""
        given = {name: value for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                                 ("grammar", self.grammar), ("json_object", self.json_object),
                                                 ("disable_any_whitespace", self.disable_any_whitespace))
                 if value is not None}
        return StructuredOutputsParams(**given)


class SamplingFields(BaseModel):
    """What chat and text completions share."""
    model_config = ConfigDict(extra="allow")  # kept in `model_extra`, then refused by name (unknown_fields)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Ignored, as they change nothing about the reply:
    user: str | None = None               # an end-user id for the provider's abuse monitoring; none here
    safety_identifier: str | None = None  # OpenAI's newer name for `user`
    store: bool | None = None             # asks OpenAI to keep the completion for its dashboard; nothing is kept here
    metadata: dict[str, Any] | None = None  # tags for stored completions (with `store`)
    service_tier: str | None = None       # a billing / latency tier; this server has one
    prompt_cache_key: str | None = None   # OpenAI's routing hint for its prompt cache; the prefix cache here needs none
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, description="keeps this request's prefix-cache blocks to "
                                                            "requests with the same salt")
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older names for structured_outputs' members
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # ignored: which grammar library; this server has one (xgrammar)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request; ValueError names the parameter that is out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k in (None, 0) else self.top_k,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, stop=stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            structured_outputs=structured_outputs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unknown_fields(self) -> list[str]:
        """The fields this server does not implement, by their paths (`functions`,
        `messages.2.audio`); those set to null or empty are left out: they ask for nothing."""
        return _unknown(self, "")


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI's replies give it


class ToolCall(BaseModel):
    """A call an earlier assistant message made, sent back with the conversation."""
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name unless null (SamplingFields.unknown_fields)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # the participant's (or, on a tool message, the function's) name
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None           # tool messages: the call this answers

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)

    def as_dict(self) -> dict:
        """The message as chat templates take it: role and text, and the tool fields it has, with
        each call's arguments as an object (templates write them with `tojson`). ValueError says
        what is wrong."""
        message: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # as response_format's: a constrained call always follows the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none", "auto", "required" or a NamedToolChoice; read by engine/api/tool_choice.py, which says
    # what is wrong with any other value (a union here would name its members in the error).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    # PagedChat's extra: with `cache_salt`, the first N messages (a preset system prompt every user
    # shares) are cached unsalted, so their blocks serve everyone while the rest stays the salt's.
    num_shared_messages: int = Field(default=0, ge=0)

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them ("developer" is OpenAI's newer "system")."""
        return [m.as_dict() for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _unknown(model: BaseModel, prefix: str) -> list[str]:
    found = [f"{prefix}{name}" for name, value in (model.model_extra or {}).items()
             if value not in (None, [], {}, "")]
    for name, value in model:
        values = value if isinstance(value, list) else [value]
        for i, item in enumerate(values):
            if isinstance(item, BaseModel) and item.model_config.get("extra") == "allow":
                found += _unknown(item, f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}.")
    return found


def _arguments(text: str) -> dict:
    """A sent-back call's arguments: JSON text of an object."""
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"a tool call's function.arguments must be the JSON text of an object, got {text[:80]!r}")
    return arguments
