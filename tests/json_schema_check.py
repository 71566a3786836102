"""A small JSON-schema check for the structured-output tests: the keywords their schemas use
(type, properties, required, additionalProperties, items, minItems, maxItems, enum, const,
anyOf, minimum, maximum, $ref into $defs), so a reply is checked against its schema without
a dependency for it."""
from __future__ import annotations

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value: object, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """What in `value` breaks `schema`, each as "path: why"; [] when it matches."""
    root = schema if root is None else root
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return schema_errors(value, root["$defs"][name], root, path)
    if "anyOf" in schema:
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if not any(not schema_errors(value, {**rest, **case}, root, path) for case in schema["anyOf"]):
            return [f"{path}: matches none of anyOf"]
    errors = []
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        return [f"{path}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{path}: {key!r} is missing" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: {key!r} is not allowed")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), root, f"{path}[{i}]")
    return errors


def _is_type(value: object, kind: str | list) -> bool:
    if isinstance(kind, list):
        return any(_is_type(value, k) for k in kind)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[kind])
