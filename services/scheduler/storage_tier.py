"""The storage tier behind the host tier (hierarchical cache): page names and pending loads.

The worker keeps the pages as files; this side only names them. A key hashes the engine's
identity, the namespace and every token up to the page's end: equal keys mean equal KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.page_keys import block_keys
from services.scheduler.tokens import Tokens

MAX_LOAD_PAGES = 64  # pages one request asks for at once (what a batch reads from disk)


def engine_seed(
    model_id: str, weights: str, dtype: str, layers: int, kv_heads: int, head_dim: int
) -> bytes:
    """What a page's KV depends on besides its tokens (weights: the checkpoint's
    fingerprint, so one served name over other weights shares nothing)."""
    return f"radixserve-kv2|{model_id}|{weights}|{dtype}|{layers}|{kv_heads}|{head_dim}".encode()


def page_keys(
    seed: bytes, namespace: str, tokens: Tokens, first: int, end: int, p: int
) -> list[bytes]:
    """Keys of pages first..end-1 of tokens (page i holds tokens[i*p:(i+1)*p])."""
    return block_keys(seed, namespace, tokens, first, end, p)


@dataclass
class PendingLoad:
    namespace: str
    tokens: Tokens  # the prompt up to the end of the last page asked for
    start: int  # first token of the first page asked for (a page boundary)
    host: list[int]  # host slots reserved for all the pages asked for
    req: object = None  # the request waiting on it (services.scheduler.request.Req)
    batch_id: int = -1  # the batch its copy went out on (-1: not sent yet)


@dataclass
class StorageCounters:
    """Tokens, cumulative."""

    stored: int = 0  # device -> storage (pages written)
    loaded: int = 0  # storage -> host (pages found)
    missed: int = 0  # pages asked for and not found (computed instead)
    failed_loads: int = 0  # loads (not tokens) lost with a failed batch


@dataclass
class StorageTier:
    page_tokens: int
    seed: bytes
    pending: dict[int, PendingLoad] = field(default_factory=dict)
    counters: StorageCounters = field(default_factory=StorageCounters)
    next_id: int = 1

    def add(self, load: PendingLoad) -> int:
        load_id, self.next_id = self.next_id, self.next_id + 1
        self.pending[load_id] = load
        return load_id

    def held_host_slots(self) -> list[int]:
        return [s for ld in self.pending.values() for s in ld.host]

    def mark_sent(self, batch_id: int) -> None:
        for ld in self.pending.values():
            if ld.batch_id < 0:
                ld.batch_id = batch_id

    def unanswered(self, batch_id: int) -> list[int]:
        """Loads whose batch came back without their answer (it failed: nothing found)."""
        return [i for i, ld in self.pending.items() if 0 <= ld.batch_id <= batch_id]
