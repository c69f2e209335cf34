"""Tool calls out of model text (``--tool-call-parser``): the ``tool_calls`` of a chat completion.

A call is emitted only once its markup is complete and parses, so a stream never shows a
call that later proves malformed; markup that does not parse goes to content unchanged.
``parse`` runs the stream's scanner, so both agree however the text was split. ``trigger``,
``call_begin``, ``call_end`` and ``separator`` describe the markup to tool_grammar.py.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

Delta = str | dict[str, Any]  # content text, or one item of OpenAI's ``delta.tool_calls``
IdFactory = Callable[[], str]
NAME = "{name}"  # where ``call_begin`` takes the function's name


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, compact, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


class _Accept(NamedTuple):
    end: int  # characters the calls take from the opener on, markup included
    calls: list[tuple[str, str]]  # (name, arguments JSON)


class _Reject(NamedTuple):
    skip: int  # length of the opener: it goes to content and scanning resumes after it


_Match = _Accept | _Reject | None  # None: undecided until more text comes


_MORE, _BAD = -1, -2  # a value may still close / can never close
_WS = re.compile(r"\s*")


class _Syntax(NamedTuple):
    tokens: re.Pattern[str]  # one quote, one bracket, or a run of anything else
    pairs: dict[str, str]  # opening bracket -> its closer
    quotes: str
    bad: re.Pattern[str] | None  # what may never stand outside a string


_JSON = _Syntax(
    re.compile(r'["{}\[\]]|[^"{}\[\]]+'),
    {"{": "}", "[": "]"},
    '"',
    re.compile(r"[^\s0-9:,.+\-eEtrufalsn]"),
)
_PYTHON = _Syntax(
    re.compile(r"""['"(){}\[\]]|[^'"(){}\[\]]+"""), {"{": "}", "[": "]", "(": ")"}, "\"'", None
)
_BODIES = {q: re.compile(rf"(?:[^{q}\\]|\\.)*", re.S) for q in "\"'"}  # a string up to its end


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


class _Scan:
    """Finds where one call's bracketed value ends; resumes where it stopped."""

    def __init__(self) -> None:
        self._reset(-1)

    def _reset(self, start: int) -> None:
        self._start = self._pos = start  # where the value starts; where to go on
        self._stack: list[str] = []  # closers still due
        self._quote = ""  # at _pos the text is inside a string opened with this quote
        self._result = _MORE

    def end(self, text: str, start: int, syntax: _Syntax) -> int:
        """End of the value opening at ``text[start]`` (``text`` only grows between calls):
        _MORE while it may still close, _BAD once nothing that follows can make it valid."""
        if start != self._start:
            self._reset(start)
        if self._result == _MORE:
            self._result = self._advance(text, syntax)
        return self._result

    def _advance(self, text: str, syntax: _Syntax) -> int:
        pos, closers = self._pos, syntax.pairs.values()
        while pos < len(text):
            if self._quote:
                body = _BODIES[self._quote].match(text, pos)
                pos = body.end() if body else pos
                if pos == len(text) or text[pos] == "\\":
                    break  # the string, maybe an escape, goes on in the next piece
                self._quote, pos = "", pos + 1
                continue
            match = syntax.tokens.match(text, pos)
            if match is None:  # cannot happen: some alternative takes any character
                return _BAD
            token, pos = match.group(), match.end()
            if token in syntax.pairs:
                self._stack.append(syntax.pairs[token])
            elif len(token) == 1 and token in syntax.quotes:
                self._quote = token
            elif token in closers:
                if not self._stack or self._stack.pop() != token:
                    return _BAD
                if not self._stack:
                    return pos
            elif syntax.bad is not None and syntax.bad.search(token):
                return _BAD
        self._pos = pos
        return _MORE


def _span(
    text: str, pos: int, firsts: str, scan: _Scan, syntax: _Syntax = _JSON
) -> tuple[int, int]:
    """(start, end) of the bracketed value after the whitespace at ``pos``; end is _MORE or
    _BAD as for ``_Scan.end``, and _BAD when the value opens with none of ``firsts``."""
    start = _skip_ws(text, pos)
    if start == len(text):
        return start, _MORE
    if text[start] not in firsts:
        return start, _BAD
    return start, scan.end(text, start, syntax)


def _give_up(end: int, skip: int, final: bool) -> _Match:
    """For an end that is _MORE or _BAD: reject now, or wait for more text."""
    return _Reject(skip) if final or end == _BAD else None


def _tail(text: str, pos: int, mark: str, final: bool) -> int | None:
    """End of the whitespace and ``mark`` after a call's value; None while they may still
    come, _BAD when something else follows. At the end of the text a missing mark is forgiven."""
    start = _skip_ws(text, pos)
    head = text[start : start + len(mark)]
    if head == mark:
        return start + len(mark)
    if mark.startswith(head):
        return len(text) if final else None
    return _BAD


def _partial_len(text: str, marks: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that a mark begins with (a mark may follow)."""
    for n in range(min(len(text), max(map(len, marks)) - 1), 0, -1):
        if any(mark.startswith(text[-n:]) for mark in marks):
            return n
    return 0


def _find_literal(text: str, marks: Sequence[str]) -> tuple[int, int]:
    hits = [i for i in (text.find(mark) for mark in marks) if i >= 0]
    if hits:
        return min(hits), min(hits)
    return -1, len(text) - _partial_len(text, marks)


def _compact(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _json(text: str) -> Any:
    try:
        return json.loads(text, strict=False)  # models do write raw newlines in strings
    except (ValueError, RecursionError):
        return None


def _json_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments) of ``{"name": ..., "arguments" or "parameters": {...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        return None
    args = _json(obj[key]) if isinstance(obj[key], str) else obj[key]
    text = _compact(args) if isinstance(args, dict) else None
    return None if text is None else (obj["name"], text)


_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A literal argument; JSON's true/false/null are taken too (models mix them in)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k}
    return ast.literal_eval(node)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _python_call(node: ast.expr) -> tuple[str, str] | None:
    """(name, arguments) of ``f(a=1, b="x")``: keyword arguments with literal values only."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None or any(k.arg is None for k in node.keywords):
        return None
    try:
        args = {k.arg: _literal(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    text = _compact(args)
    return None if text is None else (name, text)


def _python_calls(src: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [c for c in map(_python_call, tree.body.elts) if c is not None]
    return calls if len(calls) == len(tree.body.elts) else None


class ToolParser:
    """One model family's call markup. Holds no state: a stream keeps its own."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # the markup that opens a call: what a lazy grammar waits for
    call_begin: ClassVar[str]  # how a call to NAME begins, up to its arguments
    call_end: ClassVar[str]  # what follows the arguments
    separator: ClassVar[str] = ""  # between two calls where no free text may come
    arguments_format: ClassVar[str] = "json"  # "json": an object; "python": keyword arguments
    openers: ClassVar[tuple[str, ...]]  # markup that may open a call anywhere in the text

    def begin(self, name: str) -> str:
        return self.call_begin.replace(NAME, name)

    def stream(self, new_id: IdFactory = new_call_id) -> StreamParser:
        return StreamParser(self, new_id)

    def parse(self, text: str, new_id: IdFactory = new_call_id) -> ParsedOutput:
        stream = self.stream(new_id)
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d for d in deltas if isinstance(d, str))
        return ParsedOutput(content, stream.tool_calls)

    def _find_open(self, text: str, ws_only: bool) -> tuple[int, int]:
        """(start, safe): where the first opener starts (-1: none yet), and how much of
        ``text`` surely holds none. ``ws_only``: only whitespace since the last call."""
        return _find_literal(text, self.openers)

    def _match(self, text: str, final: bool, scan: _Scan) -> _Match:
        """The call(s) that ``text``, which starts with an opener, begins with."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes, Qwen2.5, Qwen3: ``<tool_call>\\n{"name": f, "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    trigger = "<tool_call>"
    call_begin = '<tool_call>\n{"name": "{name}", "arguments": '
    call_end = "}\n</tool_call>"
    separator = "\n"
    openers = ("<tool_call>",)

    def _match(self, text: str, final: bool, scan: _Scan) -> _Match:
        skip = len(self.trigger)
        start, end = _span(text, skip, "{", scan)
        if end < 0:
            return _give_up(end, skip, final)
        call = _json_call(_json(text[start:end]))
        if call is None:
            return _Reject(skip)
        stop = _tail(text, end, "</tool_call>", final)
        if stop is None:
            return None
        if stop == _BAD:
            return _Reject(skip)
        return _Accept(stop, [call])


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` and a JSON list of ``{"name": f, "arguments": {...}}``."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    call_begin = '[TOOL_CALLS][{"name": "{name}", "arguments": '
    call_end = "}]"
    openers = ("[TOOL_CALLS]",)

    def _match(self, text: str, final: bool, scan: _Scan) -> _Match:
        skip = len(self.trigger)
        start, end = _span(text, skip, "[{", scan)
        if end < 0:
            return _give_up(end, skip, final)
        value = _json(text[start:end])
        items = value if isinstance(value, list) else [value]
        calls = [c for c in map(_json_call, items) if c is not None]
        if not items or len(calls) != len(items):
            return _Reject(skip)
        return _Accept(end, calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2: optional ``<|python_tag|>``, then ``{"name": f, "parameters": {...}}``,
    joined by ``;``. Untagged, a call must open the output, so a ``{`` in prose stays prose."""

    name = "llama3_json"
    trigger = "<|python_tag|>"
    call_begin = '<|python_tag|>{"name": "{name}", "parameters": '
    call_end = "}"
    openers = ("<|python_tag|>",)

    def _find_open(self, text: str, ws_only: bool) -> tuple[int, int]:
        start, safe = super()._find_open(text, ws_only)
        first = _skip_ws(text, 0)
        if ws_only and first < len(text) and text[first] == "{":
            return first, first
        return start, safe

    def _match(self, text: str, final: bool, scan: _Scan) -> _Match:
        pos = len(self.trigger) if text.startswith(self.trigger) else 0
        skip = pos or 1
        start, end = _span(text, pos, "{", scan)
        if end < 0:
            return _give_up(end, skip, final)
        call = _json_call(_json(text[start:end]))
        if call is None:
            return _Reject(skip)
        stop = _tail(text, end, ";", final)
        if stop is None:
            return None
        return _Accept(end if stop == _BAD else stop, [call])


class PythonicParser(ToolParser):
    """Llama 3.2/4: ``[get_weather(city="Paris")]``, literal keyword arguments, optionally in
    ``<|python_start|>...<|python_end|>``; untagged, the list must open the output."""

    name = "pythonic"
    trigger = "["
    call_begin = "[{name}("
    call_end = ")]"
    arguments_format = "python"
    openers = ("<|python_start|>",)
    _end_tag = "<|python_end|>"
    _call_start = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")
    _call_prefix = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*)?")  # what may still grow into one

    def _find_open(self, text: str, ws_only: bool) -> tuple[int, int]:
        start, safe = super()._find_open(text, ws_only)
        first = _skip_ws(text, 0)
        if not ws_only or first == len(text) or text[first] != "[":
            return start, safe
        if self._call_start.match(text, first):
            return first, first
        if self._call_prefix.fullmatch(text, first):
            return -1, first
        return start, safe

    def _match(self, text: str, final: bool, scan: _Scan) -> _Match:
        pos = len(self.openers[0]) if text.startswith(self.openers[0]) else 0
        skip = pos or 1
        start, end = _span(text, pos, "[", scan, _PYTHON)
        if end < 0:
            return _give_up(end, skip, final)
        calls = _python_calls(text[start:end])
        if calls is None:
            return _Reject(skip)
        if pos:
            stop = _tail(text, end, self._end_tag, final)
            if stop is None:
                return None
            end = end if stop == _BAD else stop
        return _Accept(end, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# Other formats that reuse one of the marks below (Qwen3-Coder, GLM, DeepSeek): unread.
_OTHER_FORMATS = ("<function=", "<arg_key>", "<｜tool▁calls▁begin｜>")
_SIGNS = (
    ("[func_name1(", "pythonic"),  # the Llama 3.2/4 pythonic system prompt
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)


def detect_parser(chat_template: str) -> str | None:
    """The parser a chat template's own tool-call markup asks for, where the text tells."""
    if any(mark in chat_template for mark in _OTHER_FORMATS):
        return None
    return next((name for mark, name in _SIGNS if mark in chat_template), None)


class StreamParser:
    """Text in as it is generated; content text and OpenAI tool-call deltas out.

    Each call comes out whole: a delta with its index, id, type and name, then one with its
    arguments. Whitespace that only lays out the calls is dropped."""

    def __init__(self, parser: ToolParser, new_id: IdFactory = new_call_id) -> None:
        self._parser = parser
        self._new_id = new_id
        self._buf = ""  # text not decided yet
        self._lead = ""  # whitespace before any content or call: a call would drop it
        self._seg_text = False  # non-space content since the last call (or the start)
        self._waiting = _Scan()  # how far the call opening the buffer has been read
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list[Delta]:
        """At the end of the output: what was held back is decided now."""
        out = self._scan(final=True)
        if self._lead and not self.tool_calls:
            _append(out, self._lead)
        self._lead = ""
        return out

    def _scan(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            start, safe = self._parser._find_open(self._buf, not self._seg_text)
            self._content(self._buf[:safe], out)
            self._buf = self._buf[safe:]
            if start < 0:
                if final:
                    self._content(self._buf, out)
                    self._buf = ""
                return out
            match = self._parser._match(self._buf, final, self._waiting)
            if match is None:
                return out
            self._waiting = _Scan()
            if isinstance(match, _Reject):
                self._content(self._buf[: match.skip], out)
                self._buf = self._buf[match.skip :]
            else:
                self._calls(match.calls, out)
                self._buf = self._buf[match.end :]

    def _content(self, text: str, out: list[Delta]) -> None:
        if not self._seg_text:
            text = text.lstrip() if self.tool_calls else self._lead + text
            self._lead = ""
            if not text.strip():
                self._lead = text  # only ever kept before the first call
                return
            self._seg_text = True
        if text:
            _append(out, text)

    def _calls(self, calls: list[tuple[str, str]], out: list[Delta]) -> None:
        self._lead, self._seg_text = "", False
        for name, arguments in calls:
            call = ToolCall(self._new_id(), name, arguments)
            index = len(self.tool_calls)
            self.tool_calls.append(call)
            head = {"index": index, "id": call.id, "type": "function", "function": {"name": name}}
            out.append(head)
            out.append({"index": index, "function": {"arguments": arguments}})


def _append(out: list[Delta], text: str) -> None:
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)
