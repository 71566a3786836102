"""The request bodies of the OpenAI-compatible API: OpenAI's fields, plus the vLLM extras that fit
this engine, and how they become `SamplingParams`. Unknown fields are ignored, as OpenAI's and
vLLM's servers do, so clients that send more than we use still work."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sampling_params import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and text completions share."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; ValueError names the parameter that is out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k in (None, 0) else self.top_k,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, stop=stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # PagedChat's extra: with `cache_salt`, the first N messages (a preset system prompt every user
    # shares) are cached unsalted, so their blocks serve everyone while the rest stays the salt's.
    num_shared_messages: int = Field(default=0, ge=0)

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them ("developer" is OpenAI's newer "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


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
