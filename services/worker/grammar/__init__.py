"""Constrained decoding on xgrammar: compile (compiler.py), wait (waits.py), mask and
advance per request slot (slots.py). ``Grammars`` bundles them for the model runner.

xgrammar is imported with the first constraint, not with this package: the model runner
(and the GPU check, on an image without xgrammar) must run unconstrained batches without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common.config import WorkerConfig
from services.worker.batch import Constraint, GrammarStatus

if TYPE_CHECKING:
    import torch

    from services.worker.grammar.compiler import GrammarCompiler, GrammarError
    from services.worker.grammar.slots import SlotGrammars
    from services.worker.grammar.waits import CompileWaits

__all__ = ["Constraint", "GrammarCompiler", "GrammarError", "Grammars", "GrammarStatus"]


def __getattr__(name: str) -> Any:
    if name in ("GrammarCompiler", "GrammarError"):
        from services.worker.grammar import compiler

        return getattr(compiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _NoSlots:
    """Stands in for SlotGrammars until a request brings a constraint; mask/advance never
    run (no row is constrained)."""

    dead_end: list[bool] = []

    def __init__(self, owner: Grammars):
        self._owner = owner

    def start(self, slot: int, c: Constraint | None, replay: Sequence[int]) -> None:
        if c is not None:
            self._owner.build().slots.start(slot, c, replay)

    def any_constrained(self, slots: Sequence[int]) -> bool:
        return False

    def mask(self, logits: torch.Tensor, slots: Sequence[int]) -> None:
        raise RuntimeError("no grammar has started: no row to mask")

    def mask_drafts(self, rows: torch.Tensor, slot: int, drafts: Sequence[int]) -> int:
        raise RuntimeError("no grammar has started: no row to mask")

    def advance(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]]
    ) -> tuple[list[bool], list[str]]:
        raise RuntimeError("no grammar has started: no matcher to advance")


class _NoWaits:
    """Stands in for CompileWaits until the first compile: nothing to wait for."""

    def __len__(self) -> int:
        return 0

    def clear(self) -> None:
        pass

    def settled(self, wait_s: float = 0.0) -> list[GrammarStatus]:
        return []


class Grammars:
    """The worker's grammar state: the compile cache, the waiting requests, the matchers."""

    compiler: GrammarCompiler
    _compile_waits: CompileWaits
    waits: CompileWaits | _NoWaits
    slots: SlotGrammars | _NoSlots

    def __init__(self, cfg: WorkerConfig, vocab_size: int, eos_token_ids: list[int]):
        self._cfg, self._vocab_size, self._eos = cfg, vocab_size, list(eos_token_ids)
        self._built = False
        self.waits, self.slots = _NoWaits(), _NoSlots(self)

    def build(self) -> Grammars:
        """The xgrammar-backed parts, made once on the first constraint."""
        if self._built:
            return self
        from services.worker.grammar.compiler import GrammarCompiler, TokenizerInfoSource
        from services.worker.grammar.slots import SlotGrammars
        from services.worker.grammar.waits import CompileWaits

        cfg = self._cfg
        source = TokenizerInfoSource(cfg.model_path, self._vocab_size, self._eos)
        self.compiler = GrammarCompiler(source, cfg.grammar_cache_size, cfg.grammar_compile_threads)
        self._compile_waits = CompileWaits(self.compiler, cfg.grammar_compile_timeout)
        self.waits = self._compile_waits
        self.slots = SlotGrammars(self.compiler, cfg.max_running_requests, self._vocab_size)
        self._built = True
        return self

    def prepare(self, rid: str, c: Constraint) -> None:
        self.build()._compile_waits.add(rid, c)

    def settled(self, wait_s: float = 0.0) -> list[GrammarStatus]:
        return self.waits.settled(wait_s)
