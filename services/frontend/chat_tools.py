"""OpenAI tool calling and reasoning on ``/v1/chat/completions`` (docs/tools.md).

The request side: ``tools`` and ``tool_choice`` checked in OpenAI's terms, and the structural
tag that makes the calls parse and match their schemas (tool_grammar.py). The answer side:
the output split into reasoning (``--reasoning-parser``), then content and tool calls
(``--tool-call-parser``), whole or as stream deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.frontend.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from services.frontend.tool_grammar import (
    CallMarkup,
    ToolGrammarError,
    after_free_reasoning,
    function_schemas,
    tool_call_format,
)
from services.frontend.tool_parsers import (
    TOOL_PARSERS,
    StreamParser,
    ToolCall,
    ToolParser,
    detect_parser,
    get_tool_parser,
)
from services.frontend.validation import MAX_CONSTRAINT_CHARS


def tool_parser_choices() -> list[str]:
    """--tool-call-parser: auto (from the chat template's markup) or one parser."""
    return ["auto", *TOOL_PARSERS]


def reasoning_parser_choices() -> list[str]:
    return ["none", *REASONING_PARSERS]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema; absent: no arguments
    strict: bool | None = None  # the grammar holds the arguments to the schema either way


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: FunctionSpec


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; some clients send the object


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation (fed back by the client)."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: str = "function"
    function: CalledFunction

    def arguments_json(self) -> str:
        args = self.function.arguments
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


ToolChoice = str | dict[str, Any]
_CHOICES = ("none", "auto", "required")


def _shown(choice: ToolChoice) -> str:
    return json.dumps(choice, ensure_ascii=False)


def _choice(tool_choice: ToolChoice | None, names: Sequence[str]) -> ToolChoice:
    """tool_choice checked; unset means auto with tools and none without (OpenAI's)."""
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolGrammarError(
                "tool_choice",
                '"none", "auto", "required" or {"type": "function", "function": {"name": ...}};'
                f" got {_shown(tool_choice)}",
            )
        if name not in names:
            given = ", ".join(names) or "no tools"
            raise ToolGrammarError(
                "tool_choice", f"names function {name!r}, which is not one of the tools ({given})"
            )
        return tool_choice
    if tool_choice not in _CHOICES:
        raise ToolGrammarError(
            "tool_choice",
            f'must be "none", "auto", "required" or a named function, got {_shown(tool_choice)}',
        )
    if tool_choice != "none" and not names:
        raise ToolGrammarError("tool_choice", f"{_shown(tool_choice)} needs tools; none are given")
    return tool_choice


@dataclass(frozen=True)
class ChatPlan:
    structural_tag: str | None  # the constraint the tools ask for (JSON text), if any
    reasoning: ReasoningParser | None
    tool_parser: ToolParser | None  # None: the output is not read for calls

    def output(self) -> ChatOutput | None:
        """A fresh reader of the answer's text; None when the text is all content."""
        if self.reasoning is None and self.tool_parser is None:
            return None
        return ChatOutput(self.reasoning, self.tool_parser)


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers (--tool-call-parser, --reasoning-parser), for every chat."""

    tool_parser: ToolParser | None = None  # None: no format known, tools are refused
    reasoning: ReasoningParser | None = None

    @classmethod
    def from_flags(
        cls, tool_call_parser: str, reasoning_parser: str, chat_template: str | None
    ) -> ChatParsers:
        """``auto`` reads the format off the chat template's own call markup."""
        name = (
            detect_parser(chat_template or "") if tool_call_parser == "auto" else tool_call_parser
        )
        tool = get_tool_parser(name) if name else None
        reasoning = None if reasoning_parser == "none" else get_reasoning_parser(reasoning_parser)
        return cls(tool, reasoning)

    def plan(
        self,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: ToolChoice | None,
        parallel: bool,
        constraint_param: str | None = None,
    ) -> ChatPlan:
        """The request's plan; ToolGrammarError names the body field at fault."""
        choice = _choice(tool_choice, list(function_schemas(tools)))
        if choice == "none":
            # A constraint from the first token leaves no free thinking to split off.
            return ChatPlan(None, None if constraint_param else self.reasoning, None)
        parser = self.tool_parser
        if parser is None:
            raise ToolGrammarError(
                "tools",
                "this server reads no tool calls: its model's chat template shows no call "
                "format it knows; start it with --tool-call-parser "
                f"({', '.join(TOOL_PARSERS)}), or send tool_choice none",
            )
        if constraint_param is not None:
            raise ToolGrammarError(
                constraint_param,
                f"one constraint per request: tools with tool_choice {_shown(choice)} constrain "
                f"the output already (tool_choice none leaves {constraint_param} to it)",
            )
        return ChatPlan(self._tag(tools, choice, parallel, parser), self.reasoning, parser)

    def _tag(
        self, tools: Sequence[Mapping[str, Any]], choice: ToolChoice, parallel: bool, p: ToolParser
    ) -> str | None:
        if p.arguments_format != "json":  # pythonic: keyword arguments, no JSON grammar
            if choice == "auto":
                return None  # free text, read for calls afterwards
            raise ToolGrammarError(
                "tool_choice",
                f"the {p.name} call format has no argument grammar, so tool_choice "
                f"{_shown(choice)} cannot be guaranteed; use auto",
            )
        markup = CallMarkup(p.trigger, p.call_begin, p.call_end, p.separator)
        fmt = tool_call_format(tools, choice, parallel, markup)
        if fmt is None:
            return None
        r = self.reasoning
        if r is not None:
            fmt = after_free_reasoning(fmt, r.start, r.end, r.implicit_start)
        tag = json.dumps({"type": "structural_tag", "format": fmt})
        if len(tag) > MAX_CONSTRAINT_CHARS:  # validation's limit, in the tools' own terms
            raise ToolGrammarError(
                "tools",
                f"their grammar takes {len(tag)} characters, over the {MAX_CONSTRAINT_CHARS} a "
                "constraint may; send fewer tools or smaller schemas",
            )
        return tag


Delta = dict[str, Any]  # the fields of one chunk's delta: reasoning_content, content, tool_calls


@dataclass(frozen=True)
class ParsedAnswer:
    reasoning: str | None  # None without a reasoning parser
    content: str
    tool_calls: list[ToolCall]


class ChatOutput:
    """An answer's text in, as it is generated; its chunks' deltas out, one field per delta."""

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolParser | None):
        self._thinking: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._calls: StreamParser | None = tool_parser.stream() if tool_parser else None
        self.has_reasoning = reasoning is not None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._calls.tool_calls if self._calls is not None else []

    def feed(self, text: str) -> list[Delta]:
        if self._thinking is None:
            return self._content(text, final=False)
        split = self._thinking.feed(text)
        return _reasoning(split.reasoning) + self._content(split.content, final=False)

    def finish(self) -> list[Delta]:
        """At the end of the output: what was held back is decided now."""
        if self._thinking is None:
            return self._content("", final=True)
        split = self._thinking.finish()
        return _reasoning(split.reasoning) + self._content(split.content, final=True)

    def whole(self, text: str) -> ParsedAnswer:
        """The whole answer at once (the same pieces as the stream's)."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        return ParsedAnswer(reasoning if self.has_reasoning else None, content, self.tool_calls)

    def _content(self, text: str, final: bool) -> list[Delta]:
        if self._calls is None:
            return [{"content": text}] if text else []
        pieces = self._calls.feed(text) if text else []
        if final:
            pieces += self._calls.finish()
        return [{"content": p} if isinstance(p, str) else {"tool_calls": [p]} for p in pieces]


def _reasoning(text: str) -> list[Delta]:
    return [{"reasoning_content": text}] if text else []
