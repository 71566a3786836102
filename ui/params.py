"""Sampling parameters the chat page offers: defaults, slider ranges, and their validation."""
from __future__ import annotations

from dataclasses import dataclass

from engine import SamplingParams


@dataclass(frozen=True)
class Range:
    minimum: float
    maximum: float
    default: float
    step: float


TEMPERATURE = Range(0.0, 2.0, 0.7, 0.05)
TOP_P = Range(0.05, 1.0, 0.9, 0.05)
MAX_TOKENS = Range(1, 4096, 512, 1)


def sampling_params(temperature: float, top_p: float, max_tokens: float) -> SamplingParams:
    """Checked parameters for one reply; ValueError says which one is out of range."""
    for name, value, bounds in (("temperature", temperature, TEMPERATURE), ("top_p", top_p, TOP_P),
                                ("max new tokens", max_tokens, MAX_TOKENS)):
        if not isinstance(value, (int, float)) or not bounds.minimum <= value <= bounds.maximum:
            raise ValueError(f"{name} must be between {bounds.minimum} and {bounds.maximum}, got {value!r}")
    if max_tokens != int(max_tokens):
        raise ValueError(f"max new tokens must be a whole number, got {max_tokens!r}")
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens))
