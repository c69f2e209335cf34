"""The grammar state of each request slot: a matcher per constrained request.

Matchers live in the worker, where tokens are sampled: mask, sample and advance happen in
one step, so overlap scheduling works for constrained requests unchanged. A retracted
request replays its output into a fresh matcher. A verify step masks row i with the state
after drafts[:i]; drafts the grammar refuses (or that would end it early) are dropped, so
only the last committed token can end the grammar, as in a one-token step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from services.worker.batch import Constraint
from services.worker.grammar.compiler import GrammarCompiler

MAX_VERIFY_ROWS = 17  # 1 + --speculative-num-draft-tokens' largest value


class SlotGrammars:
    def __init__(self, compiler: GrammarCompiler, max_slots: int, vocab_size: int):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.matchers: list[xgr.GrammarMatcher | None] = [None] * max_slots
        self.done = [False] * max_slots
        self.errors = [""] * max_slots  # the grammar broke: the request must end
        # No token allowed at all: the constraint's fault, not the engine's.
        self.dead_end = [False] * max_slots
        self._bitmask = xgr.allocate_token_bitmask(max_slots, vocab_size)  # host int32
        self._draft_bitmask = xgr.allocate_token_bitmask(MAX_VERIFY_ROWS, vocab_size)

    def start(self, slot: int, c: Constraint | None, replay: Sequence[int]) -> None:
        """A request takes ``slot``: its matcher (None: unconstrained), fed ``replay``."""
        self.matchers[slot], self.done[slot], self.errors[slot] = None, False, ""
        self.dead_end[slot] = False
        if c is None:
            return
        try:
            # Blocks only if the LRU dropped it since the scheduler saw it ready.
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
        """logits [n, V] (row j is slots[j]): forbidden tokens -> -inf. A row allowing no
        token ends its request instead (all -inf cannot be sampled)."""
        rows = []
        for j, s in enumerate(slots):
            if (m := self._live(s)) is not None:
                m.fill_next_token_bitmask(self._bitmask, j)
                if bool(self._bitmask[j].any()):
                    rows.append(j)
                    continue
                self._dead_end(s)
        if not rows:
            return
        bitmask = self._bitmask[: len(slots)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def _dead_end(self, slot: int) -> None:
        self.errors[slot] = "the constraint allows no token of this model's vocabulary here"
        self.dead_end[slot] = True

    def mask_drafts(self, rows: torch.Tensor, slot: int, drafts: Sequence[int]) -> int:
        """Masks verify rows [1 + len(drafts), V] in place, row i after drafts[:i]. Returns
        how many leading drafts stay; the caller drops the rows past them."""
        m = self._live(slot)
        if m is None:
            return len(drafts)
        bitmask, n = self._draft_bitmask, 0
        while True:
            m.fill_next_token_bitmask(bitmask, n)
            if not bool(bitmask[n].any()):
                if n == 0:
                    self._dead_end(slot)
                    return 0
                m.rollback(1)
                n -= 1
                break
            if n == len(drafts) or not m.accept_token(int(drafts[n])):
                break
            if m.is_terminated():  # only the step's last token may end the grammar
                m.rollback(1)
                break
            n += 1
        if n:
            m.rollback(n)
        mask = bitmask[: n + 1].to(rows.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(rows[: n + 1], mask, vocab_size=self.vocab_size)
        return n

    def advance(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]]
    ) -> tuple[list[bool], list[str]]:
        """Feeds each constrained row its committed tokens: (terminated, error) per row."""
        terminated, errors = [False] * len(slots), [""] * len(slots)
        for j, s in enumerate(slots):
            m = self.matchers[s]
            if m is None:
                continue
            for token in tokens[j]:
                if self.errors[s] or self.done[s]:
                    break
                if not m.accept_token(int(token)):
                    self.errors[s] = f"the grammar rejected the sampled token (id {int(token)})"
                self.done[s] = not self.errors[s] and m.is_terminated()
            errors[j] = self.errors[s]
            self.done[s] = self.done[s] or (not self.errors[s] and m.is_terminated())
            terminated[j] = self.done[s]
        return terminated, errors
