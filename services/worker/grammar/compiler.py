"""Constraints compiled with xgrammar, off the forward step's path, once per distinct one.

A bounded LRU maps (kind, text) to the compile's Future, so requests share a running
compile and a refused one is answered at once. Compiles run on a small thread pool:
xgrammar releases the GIL, so forward steps go on meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from services.worker.batch import Constraint
from services.worker.grammar.emptiness import unproductive_rules
from services.worker.grammar.schema_support import unsupported_keyword

log = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf", "json_object", "structural_tag")
MAX_MESSAGE_CHARS = 600
# xgrammar's "[hh:mm:ss] file.cc:123: " and "Check failed: (...) is false: " prefixes.
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GrammarError(ValueError):
    """The compiler refused a constraint; the message is for the client."""


def compiler_message(e: BaseException) -> str:
    text = _NOISE.sub("", str(e).strip()).strip()
    return text[:MAX_MESSAGE_CHARS] or type(e).__name__


class TokenizerInfoSource:
    """xgrammar's view of the vocabulary, built on first use (test models lack tokenizers)."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int]):
        self.model_path, self.vocab_size, self.stop_token_ids = (
            model_path,
            vocab_size,
            stop_token_ids,
        )
        self._info: xgr.TokenizerInfo | None = None
        self._lock = threading.Lock()

    def get(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._info is None:
                from transformers import AutoTokenizer  # the worker only needs it here

                tok = AutoTokenizer.from_pretrained(self.model_path)
                self._info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            return self._info


class GrammarCompiler:
    """Compiles constraints on ``threads`` threads; keeps ``cache_size`` of them (LRU)."""

    def __init__(self, tokenizer: TokenizerInfoSource, cache_size: int, threads: int):
        self.tokenizer = tokenizer
        self.cache_size = max(1, cache_size)
        self._pool = ThreadPoolExecutor(
            max(1, threads), thread_name_prefix="grammar", initializer=_yield_to_forward
        )
        self._cache: OrderedDict[Constraint, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._xgr: xgr.GrammarCompiler | None = None
        self._xgr_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def submit(self, c: Constraint) -> Future[xgr.CompiledGrammar]:
        """The compile of ``c``: cached (done or running), or started now. Main thread only."""
        fut = self._cache.get(c)
        if fut is not None:
            self._cache.move_to_end(c)
            self.hits += 1
            return fut
        self.misses += 1
        fut = self._pool.submit(self._compile, c)
        self._cache[c] = fut
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)  # a compile still running finishes for its waiters
        return fut

    def cached(self, c: Constraint) -> bool:
        return c in self._cache

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._xgr_lock:
            if self._xgr is None:
                # Our pool parallelises and our cache bounds what is kept.
                self._xgr = xgr.GrammarCompiler(
                    self.tokenizer.get(), max_threads=1, cache_enabled=False
                )
            return self._xgr

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        try:
            compiler = self._compiler()
        except Exception as e:  # no tokenizer
            log.error("grammar compiler unavailable: %s", e)
            raise RuntimeError(f"constrained decoding is unavailable on this worker: {e}") from e
        try:
            compiled = _compile_with(compiler, c)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's RuntimeError: the user's constraint is at fault
            raise GrammarError(compiler_message(e)) from None
        check_satisfiable(compiled)
        return compiled


def check_satisfiable(compiled: xgr.CompiledGrammar) -> None:
    """Refuses a constraint no output can complete (rules never end, or no token starts it)."""
    if never := unproductive_rules(str(compiled.grammar)):
        rules = ", ".join(repr(n) for n in never[:5])
        verb = "rule {} never ends" if len(never) == 1 else "rules {} never end"
        raise GrammarError(
            f"the grammar accepts no finite string: {verb.format(rules)} (every alternative"
            " recurses without a way out)"
        )
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError(
            "the grammar accepts no string: no token of this model's vocabulary can start it"
        )


# On a CPU worker compile threads share cores with the forward's OpenMP threads, whose
# barriers wait for any thread that lost its core; +10 keeps decode steps fast.
COMPILE_NICENESS = 10


def _yield_to_forward() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


def _compile_with(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    if c.kind in ("json_schema", "json_object"):
        if c.kind == "json_schema":
            _check_schema(c.text)
        text, strict = (c.text, True) if c.kind == "json_schema" else ('{"type": "object"}', False)
        # One line with ", " and ": ": free whitespace lets a model pad forever.
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict)
        return compiler.compile_grammar(json_safe(grammar))
    if c.kind == "regex":
        return compiler.compile_regex(c.text)
    if c.kind == "ebnf":
        return compiler.compile_grammar(c.text)
    if c.kind == "structural_tag":
        # Not Grammar.from_structural_tag: only the compiler's tokenizer resolves "token".
        compiled = compiler.compile_structural_tag(structural_tag_text(c.text))
        grammar = compiled.grammar  # a new wrapper each time it is read
        fixed = json_safe(grammar)
        return compiled if fixed is grammar else compiler.compile_grammar(fixed)
    raise GrammarError(f"unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}")


# xgrammar 0.2.9's strings with minLength / maxLength admit raw control characters, which
# is not JSON; its other strings use the class without them.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def json_safe(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with every JSON string character class excluding control characters."""
    text = str(grammar)
    fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if problem := unsupported_keyword(schema):
        raise GrammarError(problem)


def structural_tag_text(text: str) -> str:
    """The tag in xgrammar's current format (legacy form converted), its schemas checked."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the structural tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise GrammarError(f"a structural tag is a JSON object, got {type(tag).__name__}")
    if "structures" in tag:
        tag = _from_legacy(tag)
    if problem := _unsupported_in_format(tag.get("format"), "format"):
        raise GrammarError(problem)
    return json.dumps(tag)


def _from_legacy(tag: dict[str, Any]) -> dict[str, Any]:
    """{"structures": [...], "triggers": [...]} as triggered tags."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("triggers must be a list of non-empty strings")
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": [_legacy_tag(s, i) for i, s in enumerate(structures)],
        },
    }


def _legacy_tag(s: Any, i: int) -> dict[str, Any]:
    if not isinstance(s, dict):
        raise GrammarError(f"structures[{i}] must be an object with begin, schema and end")
    for key in ("begin", "end"):
        if not isinstance(s.get(key), str):
            raise GrammarError(f"structures[{i}].{key} must be a string")
    schema = s.get("schema", True)  # no schema: any JSON value, as xgrammar's legacy form
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"structures[{i}].schema must be a JSON Schema object")
    content = {"type": "json_schema", "json_schema": schema}
    return {"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]}


# Formats whose "json_schema" member is a JSON Schema (xgrammar 0.2.9's names).
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


def _unsupported_in_format(fmt: Any, where: str) -> str:
    """The first JSON Schema keyword inside the format that xgrammar would ignore, or ''."""
    if isinstance(fmt, list):
        for i, item in enumerate(fmt):
            if problem := _unsupported_in_format(item, f"{where}[{i}]"):
                return problem
        return ""
    if not isinstance(fmt, dict):
        return ""
    if fmt.get("type") in _SCHEMA_FORMATS:
        problem = unsupported_keyword(fmt.get("json_schema"))
        return f"{where}.json_schema: {problem}" if problem else ""
    for key, value in fmt.items():
        if problem := _unsupported_in_format(value, f"{where}.{key}"):
            return problem
    return ""
