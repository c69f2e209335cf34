"""One request as the scheduler sees it: token ids, KV slots, stop conditions, timings.

``kv_slots[:locked_len]`` are the tree's (locked), the rest up to ``kv_len`` the request's
own. The last sampled token never has KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.internal.v1 import engine_pb2
from services.common.sampling_limits import DEFAULT_MAX_TOKENS
from services.scheduler.tokens import Tokens, as_tokens, new_tokens


@dataclass(eq=False)  # identity: requests are compared in queue lookups, never by value
class Req:
    rid: str
    identity: bytes  # the frontend socket that gets this request's output
    input_ids: Tokens  # a list given here is converted
    sampling: engine_pb2.SamplingParams
    priority: int = 0
    namespace: str = ""
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    enqueued_at: float = field(default_factory=time.monotonic)  # this scheduler's clock
    trace_context: dict[str, str] = field(default_factory=dict)

    output_ids: Tokens = field(default_factory=new_tokens)
    kv_slots: list[int] = field(default_factory=list)
    locked_len: int = 0  # leading kv_slots owned by the tree (and locked)
    node: Any = None
    req_slot: int | None = None  # row of the request-slot table while running
    table_dirty: bool = True  # the worker's row must be (re)written: send is_new
    lookahead: int = 0  # id of a queued batch that computes its next token (overlap)
    # Trailing kv_slots grown for the drafts of the step being built or in flight.
    draft_slots: int = 0
    spec: Any = None
    cached_tokens: int = -1  # prompt tokens reused at first admission (-1: not yet)
    sent_tokens: int = 0  # output tokens already streamed to the frontend
    logprobs: list = field(default_factory=list)
    # Collected until sent; done: nothing (more) to send.
    prompt_logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs_done: bool = True
    finish_reason: str = ""
    finish_message: str = ""
    error_code: str = ""
    retry_after: float = 0.0  # refused as overloaded: seconds after which to retry
    matched_stop_token: int = -1
    num_retractions: int = 0
    grammar_wait: bool = False  # constrained: not admitted until the worker compiled its grammar
    storage_wait: bool = False  # not admitted until the storage tier answered (storage_tier.py)
    storage_asked: bool = False
    storage_tokens: int = 0  # tokens its storage load added to the tree
    cached_host_tokens: int = 0  # of cached_tokens, loaded from the host tier ...
    cached_storage_tokens: int = 0  # ... and, having come there from storage, from storage
    first_scheduled: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    spans: dict[str, Any] = field(default_factory=dict)

    prefill_only: bool = False

    def __post_init__(self) -> None:
        self.input_ids = as_tokens(self.input_ids)
        self.output_ids = as_tokens(self.output_ids)
        self.prompt_logprobs_done = not self.sampling.prompt_logprobs
        self.prefill_only = self.max_new_tokens == 0

    @property
    def fill_ids(self) -> Tokens:
        return self.input_ids + self.output_ids

    @property
    def kv_len(self) -> int:
        return len(self.kv_slots)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def max_new_tokens(self) -> int:
        s = self.sampling
        return s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    @property
    def in_prefill(self) -> bool:
        """More than one token lacks KV: the next step is (a chunk of) a prefill."""
        return self.seq_len - self.kv_len > 1

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def _stop_token(self, token: int) -> bool:
        """EOS (unless ignore_eos) or a stop id, past min_tokens as the worker masks them;
        with a constraint the grammar's end wins (a finished grammar allows only EOS)."""
        s = self.sampling
        if not (token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_token_ids)):
            return False
        early = len(self.output_ids) <= s.min_tokens  # token is output_ids[-1]
        return not early or s.constraint.WhichOneof("kind") is not None

    def stop_reason(self, token: int, max_model_len: int) -> tuple[str, int]:
        """('stop'|'length'|'', matched token) after ``token`` was appended to output_ids."""
        if self._stop_token(token):
            return "stop", token
        if len(self.output_ids) >= self.max_new_tokens or self.seq_len >= max_model_len:
            return "length", -1
        return "", -1
