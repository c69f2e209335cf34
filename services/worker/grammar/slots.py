"""The grammar state of each request slot: a matcher per constrained request.

Per step, for the sampled rows whose request is constrained: fill xgrammar's token bitmask
from each matcher, apply it to the logits in place (disallowed tokens -> -inf) before the
sampler runs, then advance each matcher with the token drawn. The matcher lives here, in
the worker, because this is where tokens are sampled: mask, sample and advance happen in
the same step, so the overlap schedule (the next step queued before this one's tokens
reach the scheduler) works for constrained requests unchanged.

A request that takes its slot again after a retraction replays its output tokens into a
fresh matcher, so its grammar state is the one it left with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from services.worker.batch import Constraint
from services.worker.grammar.compiler import GrammarCompiler


class SlotGrammars:
    def __init__(self, compiler: GrammarCompiler, max_slots: int, vocab_size: int):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.matchers: list[xgr.GrammarMatcher | None] = [None] * max_slots
        self.done = [False] * max_slots  # terminated: nothing more to mask or accept
        self.errors = [""] * max_slots  # the grammar broke: the request must end
        # The grammar allows no token at all here: the constraint's fault, not the engine's.
        self.dead_end = [False] * max_slots
        self._bitmask = xgr.allocate_token_bitmask(max_slots, vocab_size)  # host int32

    def start(self, slot: int, c: Constraint | None, replay: Sequence[int]) -> None:
        """A request takes ``slot``: its matcher (None: unconstrained), fed ``replay``."""
        self.matchers[slot], self.done[slot], self.errors[slot] = None, False, ""
        self.dead_end[slot] = False
        if c is None:
            return
        try:
            # Ready by now (the scheduler admits it only then); blocks only if the LRU
            # dropped it meanwhile.
            compiled = self.compiler.submit(c).result()
        except Exception as e:
            self.errors[slot] = f"the grammar is unavailable: {e}"
            return
        matcher = xgr.GrammarMatcher(compiled)
        self.matchers[slot] = matcher
        for i, token in enumerate(replay):
            if not matcher.accept_token(int(token)):
                self.errors[slot] = (
                    f"replaying output token {i} (id {int(token)}) into the grammar failed"
                )
                return
        self.done[slot] = matcher.is_terminated()

    def any_constrained(self, slots: Sequence[int]) -> bool:
        return any(self.matchers[s] is not None for s in slots)

    def _live(self, slot: int) -> xgr.GrammarMatcher | None:
        m = self.matchers[slot]
        return None if m is None or self.done[slot] or self.errors[slot] else m

    def mask(self, logits: torch.Tensor, slots: Sequence[int]) -> None:
        """logits [n, V] (row j belongs to slots[j]): tokens the grammar forbids -> -inf.
        A row whose grammar allows no token ends its request instead: masked, it would be
        all -inf, which sampling cannot draw from."""
        rows = []
        for j, s in enumerate(slots):
            if (m := self._live(s)) is not None:
                m.fill_next_token_bitmask(self._bitmask, j)
                if bool(self._bitmask[j].any()):
                    rows.append(j)
                    continue
                self.errors[s] = "the constraint allows no token of this model's vocabulary here"
                self.dead_end[s] = True
        if not rows:
            return
        bitmask = self._bitmask[: len(slots)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def advance(self, slots: Sequence[int], tokens: Sequence[int]) -> tuple[list[bool], list[str]]:
        """Feeds each constrained row its sampled token: (terminated, error) per row."""
        terminated, errors = [False] * len(slots), [""] * len(slots)
        for j, s in enumerate(slots):
            m = self.matchers[s]
            if m is None:
                continue
            if not self.errors[s] and not self.done[s] and not m.accept_token(int(tokens[j])):
                self.errors[s] = f"the grammar rejected the sampled token (id {int(tokens[j])})"
            errors[j] = self.errors[s]
            self.done[s] = self.done[s] or (not self.errors[s] and m.is_terminated())
            terminated[j] = self.done[s]
        return terminated, errors
