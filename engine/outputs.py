"""What the engine hands back: streamed deltas, and whole outputs for the offline API."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int       # prompt tokens served from the prefix cache
    completion_tokens: int
    ttft_s: float            # arrival to first token
    duration_s: float        # arrival to finish


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one sample of one request since the last step."""
    request_id: str
    index: int                       # which of the request's n samples
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on the sample's last delta
    usage: Usage | None = None        # on the sample's last delta
    error: str | None = None          # what went wrong, with finish_reason "error"
    logprobs: tuple[dict[int, float], ...] | None = None  # per new token, when asked for


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: top tokens' and the sampled one's


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    usage: Usage | None = None  # of sample 0

    def add(self, delta: Delta) -> None:
        sample = self.outputs[delta.index]
        sample.text += delta.text
        sample.token_ids += delta.token_ids
        if delta.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
            if delta.usage is not None:
                self.num_cached_tokens = delta.usage.cached_tokens
                if delta.index == 0:
                    self.usage = delta.usage
        self.finished = all(o.finish_reason is not None for o in self.outputs)
