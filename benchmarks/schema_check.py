"""Does a reply's text parse as JSON and satisfy a JSON Schema? A validator for the subset of JSON
Schema that the structured-output benchmarks ask servers for, small enough to read in a minute
(the project's venv has no `jsonschema`, and a checker should not need one).

Keywords checked: `type` (string, integer, number, boolean, object, array, null, or a list of
them), `properties`, `required`, `additionalProperties` (false, true or a schema), `enum`,
`items`, `minItems`, `maxItems`. `title` and `description` are annotations and ignored. Any
other keyword raises ValueError: a schema the checker cannot read must not pass silently.

    >>> schema_errors({"a": 1}, {"type": "object", "properties": {"a": {"type": "string"}}})
    ['$.a: expected string, got integer']
    >>> judge('{"a": "x"}', {"type": "object", "required": ["a"]})
    (True, 'ok')
"""
from __future__ import annotations

import json
import math
from typing import Any

CHECKED = {"type", "properties", "required", "additionalProperties", "enum", "items", "minItems", "maxItems"}
ANNOTATIONS = {"title", "description"}
TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


def json_type(value: Any) -> str:
    """The JSON type of a parsed value (an integral float is a number here; `integer` accepts it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int in Python, never in JSON
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def has_type(value: Any, name: str) -> bool:
    actual = json_type(value)
    if name == "number":
        return actual in ("integer", "number")
    if name == "integer":
        return actual == "integer" or (actual == "number" and math.isfinite(value) and value.is_integer())
    return actual == name


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality for `enum`: 1 == 1.0, but true != 1 and "1" != 1."""
    ta, tb = json_type(a), json_type(b)
    if {ta, tb} <= {"integer", "number"}:
        return a == b
    if ta != tb:
        return False
    if ta == "array":
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if ta == "object":
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return a == b


def schema_errors(instance: Any, schema: dict, path: str = "$") -> list[str]:
    """Every way `instance` breaks `schema`, each as "path: what" (empty when it validates)."""
    unknown = set(schema) - CHECKED - ANNOTATIONS
    if unknown:
        raise ValueError(f"{path}: schema keywords this checker does not read: {sorted(unknown)}")
    errors: list[str] = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if bad := [n for n in names if n not in TYPES]:
            raise ValueError(f"{path}: unknown type {bad}")
        if not any(has_type(instance, n) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {json_type(instance)}"]  # the rest would only echo it
    if "enum" in schema and not any(json_equal(instance, option) for option in schema["enum"]):
        errors.append(f"{path}: {json.dumps(instance)[:60]} is not one of {json.dumps(schema['enum'])[:120]}")
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in instance:
                errors.append(f"{path}: missing required property {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, value in instance.items():
            where = f"{path}.{name}"
            if name in properties:
                errors += schema_errors(value, properties[name], where)
            elif extra is False:
                errors.append(f"{path}: property {name!r} not allowed (additionalProperties false)")
            elif isinstance(extra, dict):
                errors += schema_errors(value, extra, where)
    if isinstance(instance, list):
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errors.append(f"{path}: {len(instance)} items, at most {schema['maxItems']} allowed")
        if "minItems" in schema and len(instance) < schema["minItems"]:
            errors.append(f"{path}: {len(instance)} items, at least {schema['minItems']} required")
        if "items" in schema:
            for i, item in enumerate(instance):
                errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def assert_readable(schema: dict, path: str = "$") -> None:
    """ValueError if any part of `schema` uses a keyword or type this checker does not read
    (schema_errors only meets the parts an instance reaches: an empty array skips `items`)."""
    unknown = set(schema) - CHECKED - ANNOTATIONS
    if unknown:
        raise ValueError(f"{path}: schema keywords this checker does not read: {sorted(unknown)}")
    names = schema.get("type", [])
    if bad := [n for n in (names if isinstance(names, list) else [names]) if n not in TYPES]:
        raise ValueError(f"{path}: unknown type {bad}")
    for name, sub in schema.get("properties", {}).items():
        assert_readable(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            assert_readable(schema[key], f"{path}.{key}")


def strict_json(text: str) -> Any:
    """json.loads, refusing NaN and Infinity (Python reads them; JSON has no such values)."""
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
