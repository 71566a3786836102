"""How a request samples and when it stops: vLLM's `SamplingParams`, validated at the edge."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.checks import require

MAX_N = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many most likely tokens' log-probabilities per step
    presence_penalty: float = 0.0   # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is already in the output
    min_p: float = 0.0              # drop tokens less likely than min_p times the likeliest one
    min_tokens: int = 0             # no stop token or stop string ends the output before this many tokens
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        require(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        require(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        require(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        require(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               f"top_k must be -1 (disabled) or at least 1, got {self.top_k!r}")
        require(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        require(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        require(self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}")
        require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        require(all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        require(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        require(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
                and 0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            require(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rules out NaN
