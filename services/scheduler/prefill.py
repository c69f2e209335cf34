"""Prefill batches: the next chunk of each running prefill, then newly admitted requests,
within ``--max-prefill-tokens`` (per request ``--chunked-prefill-size``). Admission keeps
room for the tokens running requests are expected to produce (the new-token ratio).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.config import SchedulerConfig
from services.scheduler import prompt_logprobs, request_spans, schedule_policy
from services.scheduler.batch import Item
from services.scheduler.batch_log import BatchLog
from services.scheduler.kv_manager import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.radix_cache import common_prefix_len
from services.scheduler.req_queues import ReqQueues
from services.scheduler.request import Req

# Admission reserves this share of each request's remaining max_tokens (SGLang's
# new-token ratio): optimistic, since most requests stop early; retraction covers the rest.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
# A waiting request sharing this many uncached tokens with one already in the batch waits
# one step: after that batch its prefix is in the tree, and it is a hit instead of a copy.
IN_BATCH_SHARE_THRESHOLD = 32
NO_CHUNKING = 1 << 30


class NewTokenRatio:
    """Raised by a retraction (too optimistic), lowered a little by every decode step."""

    def __init__(self) -> None:
        self.value = INIT_NEW_TOKEN_RATIO

    def reserve(self, reqs: Iterable[Req]) -> float:
        return sum(r.remaining_new_tokens for r in reqs) * self.value

    def raise_after_retract(self) -> None:
        self.value = min(1.0, self.value + 0.1)

    def decay(self) -> None:
        self.value = max(MIN_NEW_TOKEN_RATIO, self.value - NEW_TOKEN_RATIO_DECAY)


# --max-prefill-tokens 0: by device. No request in a batch sees a token before all of it
# is computed, and a CPU worker computes in groups of ~2,048 rows anyway (CPU_EXTEND_ROWS).
DEFAULT_MAX_PREFILL_TOKENS = 8192
CPU_MAX_PREFILL_TOKENS = 2048


def max_prefill_tokens(setting: int, device: str) -> int:
    if setting > 0:
        return setting
    return CPU_MAX_PREFILL_TOKENS if device == "cpu" else DEFAULT_MAX_PREFILL_TOKENS


@dataclass(eq=False)
class PrefillBuilder:
    cfg: SchedulerConfig
    queues: ReqQueues
    ratio: NewTokenRatio
    max_running: int
    metrics: SchedulerMetrics
    batch_log: BatchLog
    max_prefill: int  # max_prefill_tokens(cfg.max_prefill_tokens, the worker's device)

    @property
    def kv(self) -> KVManager:
        return self.queues.kv

    @property
    def chunk(self) -> int:
        size = self.cfg.chunked_prefill_size
        return size if size > 0 else NO_CHUNKING

    def build(self, budget: int | None = None) -> list[Item]:
        """At most ``budget`` new tokens (default max_prefill); [] when nothing is due."""
        budget = self.max_prefill if budget is None else budget
        items = self._next_chunks(budget)
        budget -= sum(it.n for it in items)
        admitted = self._admit(budget, items) if self.queues.waiting and budget > 0 else []
        self.queues.start(admitted)
        if items:
            self._log(items, admitted)
        return items

    def _next_chunks(self, budget: int) -> list[Item]:
        items: list[Item] = []
        for req in self.queues.running:
            if req.in_prefill and budget > 0:
                n = min(req.seq_len - req.kv_len, self.chunk, budget)
                if self.kv.grow(req, n) is None:
                    continue
                items.append(Item.prefill(req, n))
                budget -= n
        return items

    def _admit(self, budget: int, items: list[Item]) -> list[Req]:
        """Admits waiting requests in policy order while they fit; appends their items."""
        reserved = self.ratio.reserve(self.queues.running)
        admitted: list[Req] = []
        loading = 0  # seats kept for requests whose pages the storage tier now loads
        for req in self._ordered_waiting():
            if len(self.queues.running) + len(admitted) + loading >= self.max_running:
                break
            if budget <= 0:
                break
            if self._shares_with(req, admitted):
                continue
            if self._ask_storage(req):
                loading += 1
                continue
            item = self._admit_one(req, budget, reserved)
            if item is None:
                break  # nothing behind the head of the order jumps ahead
            admitted.append(req)
            items.append(item)
            budget -= item.n
            reserved += req.remaining_new_tokens * self.ratio.value
        return admitted

    def _ask_storage(self, req: Req) -> bool:
        """Asks storage once for the pages past the tree: True when the request now waits.
        Asked at admission, not arrival, so a burst does not thrash the host tier."""
        if req.storage_asked or prompt_logprobs.match_limit(req) is not None:
            return False
        req.storage_asked = True
        req.storage_wait = self.kv.cache.ask_storage(req.fill_ids, req.namespace, req)
        return req.storage_wait

    def _admit_one(self, req: Req, budget: int, reserved: float) -> Item | None:
        """Matches, locks and grows the first chunk; None (all undone) if it does not fit."""
        matched = self.kv.match(req, prompt_logprobs.match_limit(req))
        todo = req.seq_len - matched
        need = todo + req.remaining_new_tokens * self.ratio.value
        n = min(todo, self.chunk, budget)
        if need > self.kv.available - reserved or self.kv.grow(req, n) is None:
            self.kv.unmatch(req)
            return None
        self.queues.assign_row(req)
        if req.cached_tokens < 0:  # its first admission
            req.cached_tokens = matched
            loaded = min(self.kv.cache.last_loaded, matched)
            req.cached_storage_tokens = min(req.storage_tokens, loaded)
            req.cached_host_tokens = loaded - req.cached_storage_tokens
            req.first_scheduled = time.time()
            self.metrics.on_scheduled(req)
            request_spans.on_scheduled(req)
        return Item.prefill(req, n)

    def _ordered_waiting(self) -> list[Req]:
        waiting = [r for r in self.queues.waiting if not (r.grammar_wait or r.storage_wait)]
        return schedule_policy.order(self.cfg.schedule_policy, waiting, self.kv.cache)

    def _shares_with(self, req: Req, admitted: list[Req]) -> bool:
        """Whether req shares a long uncached run with a request admitted to this batch."""
        if self.cfg.disable_radix_cache or not admitted:
            return False
        ids = req.fill_ids
        for other in admitted:
            n = common_prefix_len(ids, other.fill_ids)
            if n - other.locked_len >= IN_BATCH_SHARE_THRESHOLD:
                return True
        return False

    def _log(self, items: list[Item], admitted: list[Req]) -> None:
        new_tokens = sum(it.n for it in items)
        cached = sum(max(r.cached_tokens, 0) for r in admitted)
        self.metrics.on_prefill_batch(new_tokens, cached)
        self.batch_log.prefill(
            len(admitted),
            new_tokens,
            cached,
            self.kv.usage,
            len(self.queues.running) - len(admitted),
            len(self.queues.waiting),
        )
