"""Constrained decoding on xgrammar: compile (compiler.py), wait (waits.py), mask and
advance per request slot (slots.py). ``Grammars`` bundles them for the model runner."""

from __future__ import annotations

from services.common.config import WorkerConfig
from services.worker.batch import Constraint, GrammarStatus
from services.worker.grammar.compiler import GrammarCompiler, GrammarError, TokenizerInfoSource
from services.worker.grammar.slots import SlotGrammars
from services.worker.grammar.waits import CompileWaits

__all__ = ["Constraint", "GrammarCompiler", "GrammarError", "Grammars", "GrammarStatus"]


class Grammars:
    """The worker's grammar state: the compile cache, the waiting requests, the matchers."""

    def __init__(self, cfg: WorkerConfig, vocab_size: int, eos_token_ids: list[int]):
        source = TokenizerInfoSource(cfg.model_path, vocab_size, list(eos_token_ids))
        self.compiler = GrammarCompiler(source, cfg.grammar_cache_size, cfg.grammar_compile_threads)
        self.waits = CompileWaits(self.compiler, cfg.grammar_compile_timeout)
        self.slots = SlotGrammars(self.compiler, cfg.max_running_requests, vocab_size)

    def prepare(self, rid: str, c: Constraint) -> None:
        self.waits.add(rid, c)

    def settled(self, wait_s: float = 0.0) -> list[GrammarStatus]:
        return self.waits.settled(wait_s)
