"""OpenAI tools as an xgrammar structural tag: calls whose arguments match each function's
JSON Schema (the shapes per ``tool_choice``: docs/tools.md).

The tag is built from the model's own call markup: fixed text before the arguments
(``begin``), the constrained JSON, fixed text after (``end``). The markup is a plain
dataclass, so this module knows no parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAME_PLACEHOLDER = "{name}"
# Names are written verbatim into the markup, so no quote, backslash or ">": OpenAI's rule,
# plus "." (tools bridged from MCP servers use it).
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Each tool is a tag of the grammar and a schema in the prompt; 128 is OpenAI's own limit.
MAX_TOOLS = 128
# Whitespace in a row in the arguments' JSON: unbounded, a small model can pad forever.
MAX_WHITESPACE = 1
# No parameters: OpenAI's "empty parameter list", so the only arguments are {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolGrammarError(ValueError):
    """The request's tools or tool_choice cannot make a grammar; ``param`` is to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class CallMarkup:
    """How a model writes one tool call: ``begin`` (``{name}`` for the function), the
    arguments JSON, ``end``. Every ``begin`` starts with ``trigger``."""

    trigger: str
    begin: str
    end: str
    separator: str = "\n"

    def begin_of(self, name: str) -> str:
        return self.begin.replace(NAME_PLACEHOLDER, name)

    def end_of(self, name: str) -> str:
        return self.end.replace(NAME_PLACEHOLDER, name)


def tool_structural_tag(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any],
    parallel_tool_calls: bool,
    markup: CallMarkup,
) -> str | None:
    """The structural-tag JSON for a request's tools, or None when nothing is constrained."""
    fmt = tool_call_format(tools, tool_choice, parallel_tool_calls, markup)
    return None if fmt is None else json.dumps({"type": "structural_tag", "format": fmt})


def tool_call_format(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any],
    parallel_tool_calls: bool,
    markup: CallMarkup,
) -> dict[str, Any] | None:
    """The structural tag's ``format`` alone (to compose, e.g. after a reasoning part)."""
    schemas = function_schemas(tools)
    if tool_choice == "none" or (tool_choice == "auto" and not schemas):
        return None
    if tool_choice == "auto":
        return _auto(schemas, parallel_tool_calls, markup)
    if tool_choice == "required":
        if not schemas:
            raise ToolGrammarError("tool_choice", "'required' needs at least one tool")
        return _calls(schemas, parallel_tool_calls, markup)
    name = _named_choice(tool_choice)
    if name not in schemas:
        raise ToolGrammarError("tool_choice", f"function {name!r} is not one of the tools")
    return _calls({name: schemas[name]}, False, markup)


# What may stand between the end of the thinking and the calls ("</think>\n\n<tool_call>").
_AFTER_THINKING = {"type": "regex", "pattern": r"\s{0,4}"}


def after_free_reasoning(
    fmt: dict[str, Any], start: str, end: str, implicit_start: bool
) -> dict[str, Any]:
    """``fmt`` behind a free-text reasoning part ``start`` ... ``end``. ``implicit_start``: the
    template opens the thinking, so the output must close it; else it may skip it."""
    thinking = {
        "type": "tag",
        "begin": "" if implicit_start else start,
        "content": {"type": "any_text"},
        "end": end,
    }
    reasoned = {"type": "sequence", "elements": [thinking, _AFTER_THINKING, fmt]}
    return reasoned if implicit_start else {"type": "or", "elements": [reasoned, fmt]}


def function_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON Schema, in the tools' order."""
    if len(tools) > MAX_TOOLS:
        raise ToolGrammarError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _function(tool, f"tools[{i}]")
        if name in out:
            raise ToolGrammarError("tools", f"tools[{i}]: function {name!r} is given twice")
        out[name] = schema
    return out


def _function(tool: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    if tool.get("type", "function") != "function":
        raise ToolGrammarError("tools", f"{where}.type must be 'function', got {tool['type']!r}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise ToolGrammarError("tools", f"{where}.function is required (name, parameters)")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolGrammarError(
            "tools",
            f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _, ., -; got {name!r}",
        )
    schema = fn.get("parameters")
    if schema is None:
        return name, NO_PARAMETERS
    if not isinstance(schema, Mapping):
        raise ToolGrammarError("tools", f"{where}.function.parameters must be a JSON Schema object")
    return name, dict(schema)


def _named_choice(choice: str | Mapping[str, Any]) -> str:
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ToolGrammarError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name"}};'
            f" got {choice!r}",
        )
    return name


def _auto(
    schemas: Mapping[str, dict[str, Any]], parallel: bool, markup: CallMarkup
) -> dict[str, Any]:
    """Free text; the trigger starts a call (stop_after_first: no text, no call after it)."""
    return {
        "type": "triggered_tags",
        "triggers": [markup.trigger],
        "tags": _tags(schemas, markup),
        "at_least_one": False,
        "stop_after_first": not parallel,
    }


def _calls(
    schemas: Mapping[str, dict[str, Any]], parallel: bool, markup: CallMarkup
) -> dict[str, Any]:
    """Calls only, at least one: the output starts with a call and ends after the last."""
    return {
        "type": "tags_with_separator",
        "tags": _tags(schemas, markup),
        "separator": markup.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _tags(schemas: Mapping[str, dict[str, Any]], markup: CallMarkup) -> list[dict[str, Any]]:
    return [_tag(name, schema, markup) for name, schema in schemas.items()]


def _tag(name: str, schema: dict[str, Any], markup: CallMarkup) -> dict[str, Any]:
    begin = markup.begin_of(name)
    if not begin.startswith(markup.trigger):
        # xgrammar dispatches a triggered tag by the trigger that starts its begin.
        raise ValueError(f"the call markup's begin {begin!r} must start with {markup.trigger!r}")
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"type": "tag", "begin": begin, "content": content, "end": markup.end_of(name)}
