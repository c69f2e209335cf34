"""Structured output specs: whatever the caller describes the answer with becomes one JSON
Schema for the server's constrained decoding, and one parser that turns the text back into
the caller's type.

Accepted specs (``output_spec``):

- a JSON Schema dict (any dict of plain JSON values): parsed with ``json.loads``;
- a pydantic model class or a dataclass (nested ones too): an instance of it;
- a type dict such as ``{"name": str, "price": float, "tags": list[str]}``, with nested
  dicts, ``list[...]``, ``dict[str, X]``, ``Optional[...]``, ``Literal[...]`` and unions:
  a plain dict (every key required, no extra keys);
- any other type pydantic understands (``list[int]``, ``Literal["yes", "no"]``, a
  TypedDict, ...): a value of that type.

pydantic does the schema generation and the validation; this module only routes to it.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union, cast, get_args, get_origin, overload

import pydantic

from radixserve.client.errors import StructuredOutputError
from radixserve.client.types import Completion, with_parsed

T = TypeVar("T")

_JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class OutputSpec(Generic[T]):
    """A JSON Schema and the parser back into Python. Build one with ``output_spec``."""

    json_schema: dict[str, Any]
    name: str
    _parse: Callable[[str], T]

    @property
    def schema_text(self) -> str:
        """The schema as compact JSON text: what goes into ``SamplingParams.json_schema``."""
        return json.dumps(self.json_schema, separators=(",", ":"))

    def parse(self, text: str) -> T:
        """The text as the spec's type; raises ValueError (pydantic's ValidationError or
        json's JSONDecodeError) when it does not parse or does not fit."""
        return self._parse(text)


@overload
def output_spec(spec: OutputSpec[T]) -> OutputSpec[T]: ...
@overload
def output_spec(spec: type[T]) -> OutputSpec[T]: ...
@overload
def output_spec(spec: object) -> OutputSpec[Any]: ...


def output_spec(spec: object) -> OutputSpec[Any]:
    """The OutputSpec of a JSON Schema dict, a type dict, a pydantic model, a dataclass or any
    type pydantic can validate. Raises TypeError for anything else."""
    if isinstance(spec, OutputSpec):
        return spec
    if isinstance(spec, str):
        raise TypeError("structured_output takes a dict, not JSON text: pass json.loads(text)")
    if isinstance(spec, Mapping):
        if _is_json(spec):
            return _from_json_schema(dict(spec))
        return _from_type_dict(spec)
    return _from_type(spec)


def parse_completion(spec: OutputSpec[T], completion: Completion[None]) -> Completion[T]:
    """The completion with ``parsed`` filled in; StructuredOutputError when the text does not
    parse, saying why (a cut-off answer is the usual reason). Never retries."""
    try:
        parsed = spec.parse(completion.text)
    except ValueError as e:
        raise StructuredOutputError(_parse_failure(spec, completion, e), completion) from e
    return with_parsed(completion, parsed)


def _parse_failure(spec: OutputSpec[Any], c: Completion[None], err: ValueError) -> str:
    why = {
        "length": (
            f"generation stopped at the token limit after {c.usage.completion_tokens} tokens"
            f" (finish_reason 'length'), so the JSON is cut off; {_length_advice(spec)}"
        ),
        "abort": "the request was aborted (finish_reason 'abort') before the answer was complete",
        "stop": (
            "the text is complete (finish_reason 'stop') but fails validation; checks beyond"
            " the JSON Schema (pydantic validators, for one) are not part of the grammar"
        ),
    }.get(c.finish_reason, f"finish_reason {c.finish_reason!r}")
    return f"the output does not parse as {spec.name}: {why}. Parser: {_first_line(err)}"


def _length_advice(spec: OutputSpec[Any]) -> str:
    """What helps a cut-off answer: bounds on what the model may write at length (a small
    model's strings may never close), then more tokens where the context has room."""
    loose = _unbounded(spec.json_schema, "")
    bound = (
        f"bound {', '.join(loose[:3])} (maxLength / maxItems, an enum; pydantic's"
        " Field(max_length=...)) so the answer stays short, or "
        if loose
        else ""
    )
    return f"{bound}raise max_tokens if prompt + max_tokens still fits the model's context"


def _unbounded(schema: Any, path: str) -> list[str]:
    """Paths of the strings without maxLength and arrays without maxItems in a schema."""
    if isinstance(schema, list):
        return [p for item in schema for p in _unbounded(item, path)]
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    fixed = any(k in schema for k in ("enum", "const", "pattern", "format"))
    here = []
    if "string" in kinds and "maxLength" not in schema and not fixed:
        here.append(path or "the string")
    if "array" in kinds and "maxItems" not in schema:
        here.append(path or "the array")
    for key, sub in schema.items():
        if key == "properties" and isinstance(sub, dict):
            for name, prop in sub.items():
                here += _unbounded(prop, f"{path}.{name}" if path else name)
        elif key in ("$defs", "definitions") and isinstance(sub, dict):
            for name, prop in sub.items():
                here += _unbounded(prop, name)
        elif key in ("items", "anyOf", "oneOf", "allOf", "additionalProperties"):
            here += _unbounded(sub, f"{path}[]" if key == "items" else path)
    return list(dict.fromkeys(here))


def _first_line(err: ValueError) -> str:
    lines = str(err).strip().splitlines()
    return " ".join(line.strip() for line in lines[:3])


def _is_json(value: object) -> bool:
    """True for plain JSON data (what a JSON Schema is); False once any Python type appears."""
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_is_json(v) for v in value)
    return isinstance(value, _JSON_SCALARS)


def _from_json_schema(schema: dict[str, Any]) -> OutputSpec[Any]:
    title = schema.get("title")
    name = f"the JSON Schema {title!r}" if isinstance(title, str) else "the JSON Schema"
    return OutputSpec(json_schema=schema, name=name, _parse=json.loads)


def _from_type(spec: object) -> OutputSpec[Any]:
    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(cast(Any, spec))
        schema = adapter.json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError) as e:
        raise TypeError(
            f"structured_output {spec!r} is not a JSON Schema dict, a type dict, a pydantic"
            f" model, a dataclass or another type pydantic can describe: {e}"
        ) from e
    return OutputSpec(json_schema=schema, name=_type_name(spec), _parse=adapter.validate_json)


def _from_type_dict(spec: Mapping[str, Any], name: str = "Output") -> OutputSpec[dict[str, Any]]:
    model = _model_of(spec, name)
    inner = _from_type(model)

    def parse(text: str) -> dict[str, Any]:
        return cast(pydantic.BaseModel, inner.parse(text)).model_dump(by_alias=True)

    return OutputSpec(json_schema=inner.json_schema, name="the type dict", _parse=parse)


def _model_of(spec: Mapping[str, Any], name: str) -> type[pydantic.BaseModel]:
    """A pydantic model for a type dict: every key required, no other keys allowed.

    Fields get safe Python names and the dict's keys as aliases, so keys like "_id" or
    "first-name" work as they are.
    """
    fields: dict[str, Any] = {}
    for i, (key, tp) in enumerate(spec.items()):
        if not isinstance(key, str):
            raise TypeError(f"type dict keys must be strings, got {key!r}")
        fields[f"f{i}"] = (_resolve(tp, name + _camel(key)), pydantic.Field(alias=key))
    config = pydantic.ConfigDict(extra="forbid")
    return pydantic.create_model(name, __config__=config, **fields)


def _resolve(tp: Any, name: str) -> Any:
    """``tp`` with every nested dict spec, also inside list[...] or Optional[...], turned into
    a model named after its path (so two nested dicts never share a name in $defs)."""
    if isinstance(tp, Mapping):
        return _model_of(tp, name)
    origin, args = get_origin(tp), get_args(tp)
    if not args or not any(_has_dict(a) for a in args):
        return tp
    resolved = tuple(_resolve(a, f"{name}Item") for a in args)
    if origin is Union or origin is types.UnionType:
        return Union[resolved]  # noqa: UP007 (built at run time from a tuple)
    return origin[resolved if len(resolved) > 1 else resolved[0]]


def _has_dict(tp: Any) -> bool:
    return isinstance(tp, Mapping) or any(_has_dict(a) for a in get_args(tp))


def _camel(key: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^0-9A-Za-z]+", key))


def _type_name(spec: object) -> str:
    name = getattr(spec, "__name__", None)
    return name if isinstance(name, str) and get_origin(spec) is None else repr(spec)
