"""JSON Schema keywords the grammar engine cannot honour, refused instead of ignored.

xgrammar silently drops keywords it has no grammar for (``not``, ``uniqueItems``, ...), so
the output could break the schema; refusing them keeps every finished output valid. The
list was measured against xgrammar 0.2.9.
"""

from __future__ import annotations

from typing import Any

UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
    }
)
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_keyword(schema: Any, where: str = "#") -> str:
    """'' when the grammar engine honours every keyword of ``schema``, else why not."""
    if not isinstance(schema, dict):
        return ""
    for key in schema:
        if key in UNSUPPORTED:
            return f"keyword {key!r} at {where} is not supported by the grammar engine"
    if schema.get("uniqueItems") is True:
        return f"keyword 'uniqueItems' at {where} is not supported by the grammar engine"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref {ref!r} at {where}: only references inside the schema (#...) are supported"
    return _in_subschemas(schema, where)


def _in_subschemas(schema: dict[str, Any], where: str) -> str:
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            if problem := unsupported_keyword(schema[key], f"{where}/{key}"):
                return problem
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if problem := unsupported_keyword(sub, f"{where}/{key}/{i}"):
                    return problem
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if problem := unsupported_keyword(sub, f"{where}/{key}/{name}"):
                    return problem
    return ""
