"""Which engine replica gets a request (``--routing-policy``; docs/routing.md has the rules).

Every policy is a pure function of each engine's load and, for cache_aware, the prompt
tokens each engine's radix tree holds (cache_index.py). Frontends do not talk to each other,
so every tie is broken by rendezvous order, never by arrival or dict order: two frontends
that see the same loads and events decide the same.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.common import transport

ROUTING_PREFIX_TOKENS = 32
DEFAULT_LOAD_FACTOR = 1.25

POLICIES = ("cache_aware", "prefix_hash", "round_robin", "least_load")
# What a cache_aware decision was based on (the metric's label; other policies: their name).
CACHE_AWARE_BRANCHES = ("cache_hit", "balance", "fallback")


def policy_names() -> list[str]:
    return list(POLICIES)


def prefix_key(cache_salt: str, input_ids: Sequence[int]) -> bytes:
    """What requests that may share cached KV have in common."""
    return cache_salt.encode() + b"\0" + transport.pack_i32(list(input_ids[:ROUTING_PREFIX_TOKENS]))


def _score(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest()


def ranking(key: bytes, names: Sequence[str]) -> list[str]:
    """The engines in order of preference for ``key`` (rendezvous hashing)."""
    return sorted(names, key=lambda n: _score(key, n), reverse=True)


def load_bound(loads: Mapping[str, int], factor: float) -> int:
    """The most load an engine may carry before it sheds a new request to the next one."""
    if not loads:
        return 0
    return math.ceil(factor * (sum(loads.values()) + 1) / len(loads))


def pick(key: bytes, loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR) -> str:
    """prefix_hash: the first engine of the key's ranking whose load is under the bound.

    One always qualifies: the bound exceeds the mean load. ``factor`` >= 1.
    """
    if not loads:
        raise ValueError("no engine to route to")
    bound = load_bound(loads, factor)
    order = ranking(key, list(loads))
    return next((n for n in order if loads[n] < bound), order[0])


def imbalanced(loads: Mapping[str, int], abs_threshold: int, rel_threshold: float) -> bool:
    """cache_aware's rule (a): the spread of loads is past both thresholds."""
    hi, lo = max(loads.values()), min(loads.values())
    return hi - lo > abs_threshold and hi > rel_threshold * lo


@dataclass(frozen=True)
class RoutingParams:
    """The --routing-* flags (services/common/config.py FrontendConfig)."""

    policy: str = "cache_aware"
    load_factor: float = DEFAULT_LOAD_FACTOR
    balance_abs: int = 8
    balance_rel: float = 1.5
    min_match_tokens: int = 32
    load_cost_tokens: int = 64
    hot_prefix_forks: int = 16

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r} (one of {POLICIES})")

    @property
    def cache_aware(self) -> bool:
        return self.policy == "cache_aware"


@dataclass(frozen=True)
class Decision:
    engine: str
    # cache_aware: cache_hit, balance or fallback (CACHE_AWARE_BRANCHES); else the policy.
    branch: str
    matched_tokens: int = 0  # cache_aware: the chosen engine's, when asked


class Router:
    """Applies one policy; the only state is round_robin's counter."""

    def __init__(self, params: RoutingParams | None = None) -> None:
        self.params = params or RoutingParams()
        self._turn = itertools.count()

    def choose(
        self,
        key: bytes,
        loads: Mapping[str, int],
        matched: Callable[[str], int] | None = None,
        hot_tokens: int = 0,
    ) -> Decision:
        """``key``: prefix_key of the request; ``loads``: every routable engine's;
        ``matched(name)``: tokens of the prompt that engine holds; ``hot_tokens``: its
        leading tokens that count as held everywhere (hot_prefixes.py) (cache_aware only)."""
        if not loads:
            raise ValueError("no engine to route to")
        p = self.params
        if p.policy == "prefix_hash":
            return Decision(pick(key, loads, p.load_factor), p.policy)
        if p.policy == "round_robin":
            names = sorted(loads)
            return Decision(names[next(self._turn) % len(names)], p.policy)
        if p.policy == "least_load":
            return Decision(_least_loaded(key, loads), p.policy)
        return self._cache_aware(key, loads, matched or (lambda name: 0), hot_tokens)

    def _cache_aware(
        self, key: bytes, loads: Mapping[str, int], matched: Callable[[str], int], hot: int
    ) -> Decision:
        p = self.params
        # An overloaded engine sheds to the best of the rest, not to the emptiest, so a
        # conversation moves only when its own engine is the overloaded one.
        low = min(loads.values())
        fit = {
            n: v
            for n, v in loads.items()
            if not imbalanced({n: v, "": low}, p.balance_abs, p.balance_rel)
        }
        order = ranking(key, list(loads))
        tokens = {name: matched(name) for name in order}
        most, least = max(tokens.values()), max(p.min_match_tokens, 1)
        if most < least:  # no engine holds a useful prefix
            engine = pick(key, fit, p.load_factor)
            return Decision(engine, "fallback", tokens[engine])
        # A hot prefix some engine holds counts as held by all: it is worth a copy on each.
        shared = min(hot, most)
        held = {n: _useful(max(tokens[n], shared), least) for n in order if n in fit}
        # Best score, then least loaded, then rendezvous order (min is stable: first wins).
        best = min(held, key=lambda n: (p.load_cost_tokens * loads[n] - held[n], loads[n]))
        return Decision(best, "cache_hit" if tokens[best] == most else "balance", tokens[best])


def _useful(tokens: int, least: int) -> int:
    """Matched tokens as rule (b) counts them: none below --routing-min-match-tokens."""
    return tokens if tokens >= least else 0


def _least_loaded(key: bytes, loads: Mapping[str, int]) -> str:
    return min(ranking(key, list(loads)), key=lambda n: loads[n])
