"""Checks on what callers pass in, made at the edge with errors that say what was wrong."""
from __future__ import annotations

ROLES = ("system", "user", "assistant")
METRICS = {
    "prompt_tokens": int,
    "cached_tokens": int,
    "completion_tokens": int,
    "ttft_s": float,
    "tokens_per_s": float,
    "finish_reason": str,
    "stopped": bool,
    "backend": str,  # which server wrote the reply, when the app fronts several (None: in-process)
    "left_out": int,  # the oldest messages left out of its prompt to fit the context (None: none)
}


def user_id(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"user id must be a non-empty string, got {value!r}")
    return value


def title(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"conversation title must be non-empty text, got {value!r}")
    return value.strip()


def text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be text, got {type(value).__name__}")
    return value


def role(value: object) -> str:
    if value not in ROLES:
        raise ValueError(f"unknown role {value!r}: expected one of {', '.join(ROLES)}")
    return value


def content(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"message content must be non-empty text, got {value!r}")
    return value


def metrics(values: dict) -> dict:
    """Known metric names with values of the right kind; a stopped reply finishes with "abort"."""
    unknown = set(values) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown message metrics {sorted(unknown)}: "
                         f"expected some of {sorted(METRICS)}")
    for name, value in values.items():
        kind = METRICS[name]
        ok = value is None or (isinstance(value, kind) if kind is not float else isinstance(value, (int, float)))
        if not ok or (kind is int and isinstance(value, bool)):
            raise ValueError(f"metric {name} must be {kind.__name__} or None, got {value!r}")
    checked = dict(values)
    checked["stopped"] = bool(checked.get("stopped"))
    if checked["stopped"]:
        if checked.get("finish_reason") not in (None, "abort"):
            raise ValueError(f"a stopped reply finishes with 'abort', not {checked['finish_reason']!r}")
        checked["finish_reason"] = "abort"
    return checked
