"""The one way the engine states a condition that must hold: `require(ok, message)`.

Inputs checked at the edge raise ValueError; the invariant checker passes AssertionError. Not
`assert`, which `python -O` strips.
"""
from __future__ import annotations


def require(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    if not ok:
        raise error(message)
