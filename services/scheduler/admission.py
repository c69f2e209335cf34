"""The edge of the waiting queue: overload is refused at once (RESOURCE_EXHAUSTED with
Retry-After), a wait past --max-queue-time ends DEADLINE_EXCEEDED. Without it a burst
would queue whole until clients give up, having cost KV and compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import SchedulerConfig
from services.scheduler.req_queues import ReqQueue
from services.scheduler.request import Req

# Defaults, sized from the engine: a queue deeper than this many batches of running
# requests, or prompts worth this many full pools, is not served within a client's patience.
QUEUED_REQUESTS_PER_RUNNING = 8
QUEUED_TOKENS_PER_POOL = 4
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class Overload:
    message: str
    retry_after: float  # seconds (what HTTP's Retry-After says)


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int  # 0: no limit
    max_tokens: int  # 0: no limit
    max_wait_s: float  # 0: no limit

    @classmethod
    def of(cls, cfg: SchedulerConfig, max_running: int, pool_tokens: int) -> QueueLimits:
        def pick(value: int, default: int) -> int:
            return 0 if value < 0 else value or default

        return cls(
            pick(cfg.max_queued_requests, QUEUED_REQUESTS_PER_RUNNING * max_running),
            pick(cfg.max_total_queued_tokens, QUEUED_TOKENS_PER_POOL * pool_tokens),
            cfg.max_queue_time,
        )

    def overload(self, waiting: ReqQueue, prompt: int, token_s: float) -> Overload | None:
        """Why a new request of ``prompt`` tokens is refused now, or None. ``token_s``:
        seconds per prefill token (0: unknown), for Retry-After."""
        if self.max_requests and len(waiting) >= self.max_requests:
            why = f"{len(waiting)} requests are waiting (--max-queued-requests {self.max_requests})"
        elif self.max_tokens and waiting.tokens + prompt > self.max_tokens:
            why = (
                f"{waiting.tokens} prompt tokens are waiting and this request adds {prompt} "
                f"(--max-total-queued-tokens {self.max_tokens})"
            )
        else:
            return None
        # About the time the queue ahead takes to prefill: a retry then has room.
        wait = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, waiting.tokens * token_s))
        wait = float(math.ceil(wait))
        return Overload(f"the engine is overloaded: {why}; retry in {wait:.0f} s", wait)

    def expired(self, waiting: ReqQueue, now: float) -> list[Req]:
        """Requests that waited longer than max_wait_s (retracted ones were admitted once)."""
        if not self.max_wait_s:
            return []
        deadline = now - self.max_wait_s
        return [r for r in waiting if not r.num_retractions and r.enqueued_at < deadline]
