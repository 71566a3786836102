"""What the engine hands back: streamed deltas, whole outputs for the offline API, and what the
client reports of the engine (what it runs on, recent times to first token)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int       # prompt tokens served from the prefix cache
    completion_tokens: int
    ttft_s: float            # arrival to first token
    duration_s: float        # arrival to finish

    @property
    def decode_tokens_per_s(self) -> float | None:
        return decode_rate(self.completion_tokens, self.duration_s - self.ttft_s)


def decode_rate(tokens: int, decode_seconds: float) -> float | None:
    """Tokens per second after the first one (whose wait is the TTFT, not decoding); None when
    there is nothing to measure."""
    return (tokens - 1) / decode_seconds if tokens > 1 and decode_seconds > 0 else None


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


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One sample's new tokens from one engine-core step: token ids, not text. The frontend
    (engine/frontend/output_processor.py) turns them into Deltas; the core may run in another process."""
    request_id: str                   # the request (the group, when n > 1)
    index: int                        # which of its n samples
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # decided by the core: a stop token, max_tokens, or an error
    error: str | None = None
    logprobs: tuple[dict[int, float], ...] | None = None
    num_cached_tokens: int = 0        # prompt tokens the prefix cache served (on every output)


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


@dataclass(frozen=True, slots=True)
class FirstToken:
    """When a request's first token arrived and how long it took from submission."""
    request_id: str
    timestamp: float  # time.time(), the clock of SchedulerStats.timestamp
    ttft_s: float


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine runs on; fixed for its life."""
    model: str
    device: str      # "cuda:0", "cpu"
    dtype: str       # "bfloat16", "float32"
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    kernels: str     # "triton" or "torch"
    max_model_len: int = 0  # longest prompt + output a request may have
    weights: str = ""        # a GGUF file's type and how it runs ("Q4_K_M, quantized (native)"); "" if dense
    config: EngineConfig | None = None  # all the engine decided at start; None where it does not say (a peer server)

    @property
    def label(self) -> str:
        """The model as people read it: a GGUF file by its name, with its type and how it runs."""
        if not self.weights:
            return self.model
        return f"{self.model.replace(chr(92), '/').rsplit('/', 1)[-1]} · {self.weights}"

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")
