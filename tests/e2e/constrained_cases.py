"""The constraints the constrained-decoding tests and benchmark run: JSON Schemas, regexes
and EBNF grammars, each with the check its output must pass (jsonschema for schemas,
re.fullmatch for regexes and for the grammars, each written again as a regex)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

SHORT = {"type": "string", "maxLength": 12}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # json_schema | regex | ebnf | json_object
    text: str
    pattern: str = ""  # regex / ebnf: what the output must fullmatch

    def check(self, output: str) -> None:
        """Raises when ``output`` breaks the constraint."""
        if self.kind == "json_schema":
            jsonschema.validate(json.loads(output), json.loads(self.text))
        elif self.kind == "json_object":
            assert isinstance(json.loads(output), dict), output
        else:
            assert re.fullmatch(self.pattern, output, re.DOTALL), (self.pattern, output)


def _schema(name: str, schema: Any) -> Case:
    return Case(name, "json_schema", json.dumps(schema))


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v"],
        }
    },
    "$ref": "#/$defs/node",
}

SCHEMAS = [
    _schema(
        "flat",
        {
            "type": "object",
            "properties": {"name": SHORT, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
        },
    ),
    _schema(
        "nested",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tag": SHORT},
                    "required": ["id", "tag"],
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
        },
    ),
    _schema(
        "int_array",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 4,
        },
    ),
    _schema("enum", {"enum": ["red", "green", "blue"]}),
    _schema("mixed_enum", {"enum": ["a", 1, None, True]}),
    _schema("bounded_number", {"type": "number", "minimum": 0, "maximum": 1}),
    _schema("bounded_int", {"type": "integer", "minimum": 10, "maximum": 20}),
    _schema("exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}),
    _schema("pattern", {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}),
    _schema("length", {"type": "string", "minLength": 2, "maxLength": 5}),
    _schema("any_of", {"anyOf": [{"type": "integer"}, {"type": "boolean"}, SHORT]}),
    _schema("one_of_disjoint", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}),
    _schema(
        "all_of",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            ]
        },
    ),
    _schema(
        "const", {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]}
    ),
    _schema(
        "objects_array",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "k": {"enum": ["x", "y"]},
                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["k", "n"],
            },
            "maxItems": 3,
        },
    ),
    _schema(
        "nullable",
        {
            "type": "object",
            "properties": {"s": {"type": ["string", "null"], "maxLength": 8}},
            "required": ["s"],
        },
    ),
    _schema(
        "optional_props",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
            "additionalProperties": False,
        },
    ),
    _schema(
        "tuple",
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
            "items": False,
        },
    ),
    _schema("recursive_tree", TREE),
    _schema("bool_schema", True),
    _schema("date_format", {"type": "string", "format": "date"}),
    _schema(
        "product",
        {
            "type": "object",
            "properties": {
                "product_name": SHORT,
                "price": {"type": "number", "minimum": 0},
                "features": {"type": "array", "items": SHORT, "maxItems": 3},
                "in_stock": {"type": "boolean"},
            },
            "required": ["product_name", "price", "features", "in_stock"],
        },
    ),
    Case("json_object", "json_object", ""),
]

REGEXES = [
    Case("phone", "regex", r"\d{3}-\d{4}", r"\d{3}-\d{4}"),
    Case("word", "regex", r"[A-Z][a-z]{2,8}", r"[A-Z][a-z]{2,8}"),
    Case("choice", "regex", r"(yes|no|maybe)", r"(yes|no|maybe)"),
    Case("price", "regex", r"[0-9]{1,4}\.[0-9]{2}", r"[0-9]{1,4}\.[0-9]{2}"),
    Case("color", "regex", r"#[0-9a-f]{6}", r"#[0-9a-f]{6}"),
    Case(
        "email", "regex", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
    ),
    Case("pairs", "regex", r"(ab|cd){2,4}", r"(ab|cd){2,4}"),
    Case("point", "regex", r"\(\d,\d\)", r"\(\d,\d\)"),
]

EBNFS = [
    Case("yes_no", "ebnf", 'root ::= "yes" | "no"', r"yes|no"),
    Case(
        "sum",
        "ebnf",
        'root ::= num ("+" num){0,3}\nnum ::= [1-9] [0-9]?',
        r"[1-9][0-9]?(\+[1-9][0-9]?){0,3}",
    ),
    Case(
        "tuple",
        "ebnf",
        'root ::= "(" item ("," item){0,4} ")"\nitem ::= [a-z]{1,4}',
        r"\([a-z]{1,4}(,[a-z]{1,4}){0,4}\)",
    ),
    Case(
        "greeting",
        "ebnf",
        'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,6}',
        r"(hello|hi) [A-Z][a-z]{1,6}!",
    ),
    Case(
        "pairs",
        "ebnf",
        'root ::= "[" (pair ("," pair){0,2})? "]"\npair ::= key ":" [0-9]{1,3}\n'
        'key ::= "x" | "y" | "z"',
        r"\[([xyz]:[0-9]{1,3}(,[xyz]:[0-9]{1,3}){0,2})?\]",
    ),
    Case(
        "lines",
        "ebnf",
        'root ::= line{1,3}\nline ::= "- " [a-z]{2,5} "\\n"',
        r"(- [a-z]{2,5}\n){1,3}",
    ),
]

ALL = SCHEMAS + REGEXES + EBNFS


# A large schema for the compile-time figures: many properties of several types.
def large_schema(n: int = 400) -> dict[str, Any]:
    props = {}
    for i in range(n):
        kind = i % 4
        if kind == 0:
            props[f"field_{i}"] = {"type": "string", "maxLength": 16}
        elif kind == 1:
            props[f"field_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif kind == 2:
            props[f"field_{i}"] = {"enum": ["alpha", "beta", "gamma"]}
        else:
            props[f"field_{i}"] = {"type": "array", "items": {"type": "number"}, "maxItems": 4}
    return {"type": "object", "properties": props, "required": list(props)[: n // 2]}
