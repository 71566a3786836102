"""Does a reply's text parse as JSON and satisfy its JSON Schema? `jsonschema` (Draft 2020-12)
judges; what is added here is strict parsing (no NaN or Infinity, which Python reads and JSON
has not) and errors as short "path: what" lines.

    >>> schema_errors({"a": 1}, {"type": "object", "properties": {"a": {"type": "string"}}})
    ["$.a: 1 is not of type 'string'"]
    >>> judge('{"a": "x"}', {"type": "object", "required": ["a"]})
    (True, 'ok')
"""
from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator


def schema_errors(instance: Any, schema: dict) -> list[str]:
    """Every way `instance` breaks `schema`, each as "path: what" (empty when it validates)."""
    errors = sorted(Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(error.absolute_path)}: {error.message}" for error in errors]


def assert_readable(schema: dict) -> None:
    """jsonschema.SchemaError when `schema` is not a valid JSON Schema."""
    Draft202012Validator.check_schema(schema)


def strict_json(text: str) -> Any:
    """json.loads, refusing NaN and Infinity."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def judge(text: str | None, schema: dict | None) -> tuple[bool, str]:
    """(passed, why): the text parses as JSON and, given a schema, validates against it."""
    if not text:
        return False, "empty reply"
    try:
        value = strict_json(text)
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        return False, f"not JSON ({str(error)[:60]}): {text[:80]!r}"
    if schema is None:
        return True, "ok"
    errors = schema_errors(value, schema)
    return (False, "; ".join(errors)[:200]) if errors else (True, "ok")


def _path(parts) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
