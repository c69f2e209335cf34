"""The per-batch log lines, in SGLang's format so its users can read them."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("radixserve.scheduler")


class BatchLog:
    def __init__(self, decode_interval: int, speculative: bool = False):
        self.decode_interval = max(1, decode_interval)
        self.decode_steps = 0
        self._tokens = 0
        self._since = time.perf_counter()
        # SGLang's "accept len": tokens committed per request step.
        self.speculative = speculative
        self._req_steps = 0

    @staticmethod
    def prefill(
        new_seq: int, new_tokens: int, cached: int, usage: float, running: int, queued: int
    ) -> None:
        log.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, cuda graph: False",
            new_seq,
            new_tokens,
            cached,
            usage,
            running,
            queued,
        )

    def decode(
        self,
        n_tokens: int,
        running: int,
        kv_tokens: int,
        usage: float,
        cuda_graph: bool,
        queued: int,
        req_steps: int = 0,
    ) -> None:
        """Counts one decode step of ``req_steps`` requests (0: one token each) that made
        ``n_tokens`` tokens; logs every decode_interval steps with the throughput since."""
        self.decode_steps += 1
        self._tokens += n_tokens
        self._req_steps += req_steps or n_tokens
        if self.decode_steps % self.decode_interval:
            return
        now = time.perf_counter()
        tput = self._tokens / max(1e-9, now - self._since)
        accept = ""
        if self.speculative:
            accept = f"accept len: {self._tokens / max(1, self._req_steps):.2f}, "
        self._since, self._tokens, self._req_steps = now, 0, 0
        log.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %scuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            running,
            kv_tokens,
            usage,
            accept,
            cuda_graph,
            tput,
            queued,
        )
