"""What a JSON schema still asks of a reply that must close: the tokens the shortest valid value of
a subschema takes, the keys an object must still write, what a comma may open, and where a key's or
an item's subschema is. Where a schema offers alternatives (anyOf, oneOf, an enum, a list of
types), the costliest counts: which one the reply takes is the model's choice.

A reply under a schema cannot close with `}` while its object lacks a required key: the grammar
makes it spell the key, its colon and a value first. json_closing.py counts those tokens too, so
a reply starts closing early enough to write them. The counts are upper bounds in "pieces" (about
a token each): a key of n bytes is taken as its quotes and colon plus one token per 3 bytes, a
string's minLength as a token a character. An estimate that is too high only starts the closing
a few tokens early."""
from __future__ import annotations

import json
import math

# A schema nested deeper than this (or a $ref that loops) counts as a two-piece value.
MAX_DEPTH = 8
UNKNOWN = 2


def key_pieces(key: str) -> int:
    """`"key": ` — its quotes and colon, and a token per 3 bytes of its text (a closing reply
    writes a key in the longest tokens its grammar allows)."""
    return 2 + math.ceil(len(key.encode()) / 3)


def literal_pieces(value: object) -> int:
    """A constant written out (an enum's member, a const)."""
    return 1 + math.ceil(len(json.dumps(value, ensure_ascii=False)) / 3)


def required_keys(node: dict) -> list[str]:
    """A node's `required` keys (whatever else a schema puts there counts for none: the costs are
    read on the engine's step and must not fail it)."""
    keys = node.get("required")
    return [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []


class SchemaCosts:
    """One JSON schema's answers, memoized per subschema (a request's tracker asks on every
    structural character)."""

    def __init__(self, schema: dict) -> None:
        self.root = schema
        self._memo: dict[int, int] = {}
        self._joined: dict[tuple[int, str], dict] = {}

    def resolve(self, node: object, depth: int = 0) -> dict | None:
        """The subschema itself: a local `$ref` (`#/$defs/x`, `#/definitions/x`) followed."""
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < MAX_DEPTH:
            target: object = self.root
            ref = node["$ref"]
            if not ref.startswith("#"):
                return None
            for part in filter(None, ref[1:].split("/")):
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            node, depth = target, depth + 1
        return node if isinstance(node, dict) else None

    def branches(self, node: dict) -> list[dict]:
        """The alternatives a node offers (anyOf, oneOf), each merged with the node's own keys."""
        options = node.get("anyOf") or node.get("oneOf")
        if not isinstance(options, list):
            return [node]
        own = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
        merged = []
        for option in options:
            option = self.resolve(option)
            if option is not None:
                merged.append({**own, **option})
        return merged or [own]

    def property(self, node: dict | None, key: str) -> dict | None:
        """The subschema of `key`'s value in an object of `node`, None where the schema says
        nothing; where several alternatives have the key, a node offering each of theirs."""
        node = self.resolve(node)
        if node is None:
            return None
        found = []
        for branch in self.branches(node):
            properties = branch.get("properties")
            if isinstance(properties, dict) and key in properties:
                found.append(properties[key])
        if len(found) > 1:
            # Kept, so that its id (the memo's key) stays its own.
            return self._joined.setdefault((id(node), key), {"anyOf": found})
        if found:
            return self.resolve(found[0])
        extra = node.get("additionalProperties")
        return self.resolve(extra) if isinstance(extra, dict) else None

    def items(self, node: dict | None) -> dict | None:
        """The subschema of an array's items."""
        node = self.resolve(node)
        if node is None:
            return None
        items = node.get("items")
        if items is None and isinstance(node.get("prefixItems"), list) and node["prefixItems"]:
            items = node["prefixItems"][0]
        return self.resolve(items)

    def min_items(self, node: dict | None) -> int:
        """How many items an array of `node` must hold."""
        node = self.resolve(node)
        count = node.get("minItems", 0) if node is not None else 0
        return count if isinstance(count, int) and count > 0 else 0

    def missing_pieces(self, node: dict | None, written: set[str], skip: str | None = None) -> int:
        """Pieces the object still has to write for its required keys not in `written`: a comma,
        the key, its value (under alternatives, the costliest). `skip`: a key being written now
        (the first required key it begins)."""
        node = self.resolve(node)
        if node is None:
            return 0
        most = 0
        for branch in self.branches(node):
            pieces, begun = 0, skip
            for key in required_keys(branch):
                if key in written:
                    continue
                value = self.value_pieces(self.property(branch, key))
                if begun is not None and key.startswith(begun):
                    begun = None
                    pieces += value - UNKNOWN  # its name, colon and a two-piece value are counted already
                    continue
                pieces += 1 + key_pieces(key) + value
            most = max(most, pieces)
        return most

    def comma_pieces(self, node: dict | None, written: set[str]) -> int:
        """At most what a comma in an object of `node` adds to what closing writes: an optional key
        not yet written (any key, where the schema allows others: a short one), its colon and
        value. A required key's are counted already (`missing_pieces`)."""
        node = self.resolve(node)
        if node is None:
            return 0
        most = 0
        for branch in self.branches(node):
            properties, required = branch.get("properties"), required_keys(branch)
            for key in properties if isinstance(properties, dict) else ():
                if key not in written and key not in required:
                    most = max(most, 1 + key_pieces(key) + self.value_pieces(self.property(branch, key)))
            if branch.get("additionalProperties", True) is not False:
                most = max(most, 1 + key_pieces("") + UNKNOWN)
        return most

    def value_pieces(self, node: dict | None) -> int:
        """The pieces of the shortest value of `node` (under alternatives, of the costliest one:
        which one the reply takes is the model's choice)."""
        node = self.resolve(node)
        if node is None:
            return UNKNOWN
        # Keyed by the node's id: the nodes belong to the schema, which lives as long as self.
        pieces = self._memo.get(id(node))
        if pieces is None:
            pieces = self._memo[id(node)] = self._pieces(node, 0)
        return pieces

    def _pieces(self, node: dict, depth: int) -> int:
        if depth >= MAX_DEPTH:
            return UNKNOWN
        node = self.resolve(node)
        if node is None:
            return UNKNOWN
        if "const" in node:
            return literal_pieces(node["const"])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return max(literal_pieces(value) for value in node["enum"])
        branches = self.branches(node)
        if len(branches) > 1 or branches[0] is not node:
            return max(self._pieces(branch, depth + 1) for branch in branches)
        kind = node.get("type")
        if isinstance(kind, list) and kind:
            return max(self._pieces({**node, "type": one}, depth + 1) for one in kind)
        if kind == "string":
            least = node.get("minLength")
            return 2 + (least if isinstance(least, int) and least > 0 else 0)
        if kind in ("integer", "number"):
            low = node.get("minimum", node.get("exclusiveMinimum"))
            return 1 + (len(str(int(low))) // 3 if isinstance(low, (int, float)) and abs(low) < 1e18 else 0)
        if kind in ("boolean", "null"):
            return 1
        if kind == "array" or "items" in node:
            return 2 + self.min_items(node) * (1 + self._pieces(self.items(node) or {}, depth + 1))
        if kind == "object" or "properties" in node or "required" in node:
            return 2 + sum(1 + key_pieces(key) + self._pieces(self.property(node, key) or {}, depth + 1)
                           for key in required_keys(node))
        return UNKNOWN
