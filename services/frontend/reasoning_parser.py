"""Reasoning out of model text: ``reasoning_content`` beside ``content`` (``--reasoning-parser``).

deepseek_r1: the template may open the thinking itself, so everything before </think> is
reasoning. qwen3: only an output that opens with <think> has reasoning. The tags and the
whitespace next to them belong to neither part; text that could still be a tag is held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    implicit_start: bool  # the output may start inside the reasoning, without the open tag
    start: str = "<think>"
    end: str = "</think>"

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> ReasoningSplit:
        stream = self.stream()
        head, tail = stream.feed(text), stream.finish()
        return ReasoningSplit(head.reasoning + tail.reasoning, head.content + tail.content)


REASONING_PARSERS = {
    p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]


def _partial_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that ``tag`` begins with."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Output text in as it is generated; (reasoning, content) pieces out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._buf = ""  # text not decided yet
        self._state = "opening"  # -> "reasoning" -> "content", or "opening" -> "content"
        self._said = False  # some reasoning went out (its leading whitespace is dropped)
        self._lstrip = False  # content follows </think>: drop its leading whitespace

    def feed(self, text: str) -> ReasoningSplit:
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> ReasoningSplit:
        return self._scan(final=True)

    def _scan(self, final: bool) -> ReasoningSplit:
        reasoning = content = ""
        if self._state == "opening":
            self._open(final)
        if self._state == "reasoning":
            reasoning = self._reason(final)
        if self._state == "content":
            content, self._buf = self._buf, ""
            if self._lstrip:
                content = content.lstrip()
                self._lstrip = not content
        return ReasoningSplit(reasoning, content)

    def _open(self, final: bool) -> None:
        head, tag = self._buf.lstrip(), self._parser.start
        if head.startswith(tag):
            self._buf, self._state = head[len(tag) :], "reasoning"
        elif final or not tag.startswith(head):
            self._state = "reasoning" if self._parser.implicit_start else "content"

    def _reason(self, final: bool) -> str:
        buf, tag = self._buf, self._parser.end
        i = buf.find(tag)
        if i >= 0:
            text, self._buf = buf[:i].rstrip(), buf[i + len(tag) :]
            self._state, self._lstrip = "content", True
        elif final:
            text, self._buf = buf.rstrip(), ""
        else:  # hold a possible start of the tag, and whitespace that may come before it
            cut = len(buf[: len(buf) - _partial_len(buf, tag)].rstrip())
            text, self._buf = buf[:cut], buf[cut:]
        if not self._said:
            text = text.lstrip()
            self._said = bool(text)
        return text
