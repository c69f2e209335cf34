"""Does a compiled grammar accept any finite string? Found before a request decodes with it.

``root ::= root`` or ``root ::= "a" root`` compile, but no output can complete them, so
the compile refuses them. Productive rules (deriving a finite string) are computed as a
fixpoint over xgrammar's normalized text; unrecognised constructs count as productive, so
a newer xgrammar can only make the check refuse less, never refuse a good grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\])
    | (?P<look>\(=)
    | (?P<open>\()
    | (?P<close>\))
    | (?P<bar>\|)
    | (?P<rep>\{\s*(?P<lo>\d+)\s*(?:,\s*-?\d+\s*)?\}|[*+?])
    | (?P<name>[A-Za-z_][\w.\-]*)
    )""",
    re.VERBOSE,
)
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")


class _Unknown(Exception):
    """Text this parser does not understand: the grammar is taken as satisfiable."""


@dataclass
class _Ref:
    name: str


# An expression: a terminal (True), a rule reference, or alternatives of sequences.
_Expr = bool | _Ref | list[list["_Expr"]]


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise _Unknown(text[pos : pos + 20])
        kind = m.lastgroup if m.lastgroup != "lo" else "rep"
        out.append((kind or "", m.group(kind or 0).strip()))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> str:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else "end"

    def take(self) -> tuple[str, str]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def alternatives(self) -> list[list[_Expr]]:
        alts = [self.sequence()]
        while self.peek() == "bar":
            self.take()
            alts.append(self.sequence())
        return alts

    def sequence(self) -> list[_Expr]:
        seq: list[_Expr] = []
        while self.peek() in ("string", "cls", "name", "open", "look"):
            elem = self.element()
            if elem is not None:
                seq.append(elem)
        return seq

    def element(self) -> _Expr | None:
        kind, text = self.take()
        elem: _Expr | None
        if kind in ("string", "cls"):
            elem = True
        elif kind == "name":
            elem = _Ref(text)
        else:  # "(" alternatives ")", or a lookahead "(=" ... ")" that consumes nothing
            inner = self.alternatives()
            if self.peek() != "close":
                raise _Unknown("unbalanced parenthesis")
            self.take()
            elem = None if kind == "look" else inner
        while self.peek() == "rep":
            _, rep = self.take()
            if rep in ("*", "?") or re.match(r"\{\s*0\s*[,}]", rep):
                elem = True  # may repeat zero times: derives the empty string
        return elem


def _parse(text: str) -> dict[str, list[list[_Expr]]]:
    rules: dict[str, list[list[_Expr]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RULE.match(line)
        if m is None:
            raise _Unknown(line[:40])
        parser = _Parser(_tokens(m.group(2)))
        body = parser.alternatives()
        while parser.peek() == "look":  # a rule's trailing lookahead
            parser.element()
        if parser.peek() != "end":
            raise _Unknown(line[:40])
        rules[m.group(1)] = body
    return rules


def _productive(expr: _Expr, known: set[str]) -> bool:
    if isinstance(expr, bool):
        return expr
    if isinstance(expr, _Ref):
        return expr.name in known
    return any(all(_productive(e, known) for e in seq) for seq in expr)


def unproductive_rules(grammar_text: str, root: str = "root") -> list[str] | None:
    """The rules that can never finish, root first, when ``root`` is one; None when the
    grammar accepts some finite string (or could not be read)."""
    try:
        rules = _parse(grammar_text)
    except _Unknown:
        return None
    if root not in rules:
        return None
    known: set[str] = set()
    changed = True
    while changed:  # fixpoint: at most one pass per rule
        changed = False
        for name, body in rules.items():
            if name not in known and _productive(body, known):
                known.add(name)
                changed = True
    if root in known:
        return None
    return [root] + sorted(n for n in rules if n not in known and n != root)
