"""How a request samples and when it stops: vLLM's `SamplingParams`, validated at the edge."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

from engine.core.checks import require

MAX_N = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_CHOICES = 1024


class InvalidStructuredOutputsError(ValueError):
    """A constraint the grammar library cannot compile (a broken JSON schema, regex or grammar):
    the message names which and why."""


@dataclass
class StructuredOutputsParams:
    """What a reply must be, as vLLM's `structured_outputs` says it: exactly one of a JSON schema
    (`json`: its text or object; True for any JSON object), any JSON object (`json_object`), a
    regular expression, one of a list of strings (`choice`), or an EBNF grammar (`grammar`, in
    xgrammar's dialect, GBNF's: `root ::= ...`). A grammar library enforces it token by token
    (engine/worker/structured/); whether the grammar compiles is checked before the request is
    queued."""
    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON: any amount of whitespace between tokens (the JSON standard), or only the one space
    # after `,` and `:` (what a small model keeps to; the default, so a reply never drifts into
    # whitespace until max_tokens).
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.json is True:
            self.json, self.json_object = None, True
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) not in (None, False)]
        given += ["json_object"] if self.json_object is True else []
        require(len(given) == 1, "structured_outputs must set exactly one of json, json_object, regex, choice and "
                                 f"grammar, got {', '.join(given) or 'none'}")
        require(isinstance(self.json_object, bool), f"json_object must be true or false, got {self.json_object!r}")
        require(self.json is None or isinstance(self.json, (str, dict)),
                f"json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value), f"{name} must be a non-empty string")
        if self.choice is not None:
            require(isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in self.choice),
                    f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        require(isinstance(self.disable_any_whitespace, bool),
                f"disable_any_whitespace must be true or false, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None) \
            if not self.json_object else "json_object"

    def key(self) -> str:
        """The same text for the same constraint (compiled grammars are cached by it)."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if self.kind == "json" and isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError:
                pass  # not JSON: compiling it says so
        return _json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)


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
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits (OpenAI's -100..100)
    structured_outputs: StructuredOutputsParams | None = None  # what the reply must be (JSON, regex, ...)

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
        if self.logit_bias is not None:
            require(isinstance(self.logit_bias, dict), f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            self.logit_bias = {_token_id(t): float(b) for t, b in self.logit_bias.items()}
            require(all(_is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()),
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {self.logit_bias!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                f"structured_outputs must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _token_id(token: object) -> int:
    """A logit_bias key: a token id, or its decimal text (JSON object keys are strings)."""
    try:
        value = int(token) if isinstance(token, (int, str)) and not isinstance(token, bool) else -1
    except ValueError:
        value = -1
    require(value >= 0, f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
    return value


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rules out NaN
