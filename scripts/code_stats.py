"""How much of the code is prose, and which modules are largest (issue 34's house measures).

    python scripts/code_stats.py [DIR ...]      # default: services kernels

Counts over the ``.py`` files below each folder (generated ``*_pb2*`` stubs left out):
non-blank lines, comment lines (a line holding only a ``#`` comment), docstring lines
(the lines of a module, class or function docstring) and their share of the non-blank
lines; then the five largest modules by line count. A line that holds code and a trailing
comment counts as code. C files (``.c``, ``.h``: the CPU kernels) get a line of their own,
comment lines being those wholly inside ``/* */`` or ``//``. Standard library only, so it
runs outside the virtualenv too.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers covered by module, class and function docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            expr = body[0]
            lines.update(range(expr.lineno, (expr.end_lineno or expr.lineno) + 1))
    return lines


def comment_lines(source: str) -> set[int]:
    """Line numbers whose only token is a comment."""
    code: set[int] = set()
    comments: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return comments - code


def file_stats(path: Path) -> tuple[int, int, int, int]:
    """(lines, non-blank lines, comment lines, docstring lines) of one file."""
    source = path.read_text()
    all_lines = source.splitlines()
    nonblank = {i for i, line in enumerate(all_lines, 1) if line.strip()}
    docs = docstring_lines(ast.parse(source)) & nonblank
    comments = comment_lines(source) - docs
    return len(all_lines), len(nonblank), len(comments), len(docs)


def c_stats(path: Path) -> tuple[int, int]:
    """(non-blank lines, comment-only lines) of a C file."""
    nonblank = comments = 0
    in_block = False
    for line in path.read_text().splitlines():
        rest, code = line.strip(), False
        if not rest:
            continue
        nonblank += 1
        while rest:
            if in_block:
                end = rest.find("*/")
                if end < 0:
                    rest = ""
                else:
                    in_block, rest = False, rest[end + 2 :].strip()
            elif rest.startswith("//"):
                rest = ""
            elif rest.startswith("/*"):
                in_block, rest = True, rest[2:]
            else:
                code = True
                start = rest.find("/*")
                rest = rest[start:] if start >= 0 else ""
        comments += not code
    return nonblank, comments


def main(argv: list[str]) -> None:
    roots = [Path(a) for a in argv] or [Path("services"), Path("kernels")]
    sizes: list[tuple[int, str]] = []
    totals = [0, 0, 0]
    for root in roots:
        sub = [0, 0, 0]
        for path in sorted(root.rglob("*.py")):
            if "_pb2" in path.name:
                continue
            lines, nonblank, comments, docs = file_stats(path)
            sizes.append((lines, str(path)))
            for acc in (sub, totals):
                acc[0] += nonblank
                acc[1] += comments
                acc[2] += docs
        report(str(root), *sub)
        c_files = sorted([*root.rglob("*.c"), *root.rglob("*.h")])
        if c_files:
            counts = [c_stats(path) for path in c_files]
            nonblank, comments = sum(c[0] for c in counts), sum(c[1] for c in counts)
            share = 100 * comments / nonblank
            print(f"{root} (C): {nonblank} non-blank lines, {comments} comment", end="")
            print(f" -> {share:.1f} % prose")
    if len(roots) > 1:
        report("all", *totals)
    print("five largest modules:")
    for lines, name in sorted(sizes, reverse=True)[:5]:
        print(f"  {lines:6d}  {name}")


def report(name: str, nonblank: int, comments: int, docs: int) -> None:
    share = 100 * (comments + docs) / nonblank if nonblank else 0.0
    print(
        f"{name}: {nonblank} non-blank lines, {comments} comment, {docs} docstring"
        f" -> {share:.1f} % prose"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
