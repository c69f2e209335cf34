"""Which engine replica gets a request (``--routing-policy``; docs/routing.md).

Every policy is a pure function of what the frontend knows: each routable engine's load
(its running + waiting requests, ``_Engine.load``) and, for cache_aware, how many leading
prompt tokens each engine's radix tree holds (cache_index.py, fed by the engines' own
CacheEvents). Frontends do not talk to each other: two that see the same loads and events
decide the same, so every tie is broken by rendezvous order, never by arrival or dict order.

cache_aware (the default; docs/routing.md has the why of each rule):

(a) an engine overloaded against the least loaded one (load - least > ``balance_abs`` AND
    load > ``balance_rel`` x least: SGLang's router's tests) takes no new request;
(b) among the rest, if one holds at least ``min_match_tokens`` of the prompt, the engine
    of the best score: matched tokens - ``load_cost_tokens`` x load (ties: the lower load,
    then rendezvous order). A hot prefix (one that many prompts fork after: a shared system
    prompt, hot_prefixes.py) counts as held by every engine once one holds it, so new
    conversations spread by load and each engine computes it once; a conversation's own
    history is not hot, and outweighs a few requests more;
(c) else (no engine holds a useful prefix), prefix_hash below over them, so requests that
    share a new prefix still converge on one engine, the same one from every frontend,
    which then caches it for (b).

prefix_hash (the routing before issue 37, kept exactly): the routing key is (cache_salt,
the first ROUTING_PREFIX_TOKENS prompt ids). Engines are ranked for that key by rendezvous
(highest-random-weight) hashing of (key, engine name), so requests that share a prefix rank
the engines the same way from every frontend, and adding or removing an engine moves only
the keys that it wins or loses. Bounded loads (consistent hashing with bounded loads,
Mirrokni et al.): an engine may take a new request only while its load is below
ceil(factor * (total load + 1) / engines); the request goes to the first engine of its
ranking under that bound, so a hot prefix fills its first-choice engine up to a fair share
and then spills to its second choice instead of queueing on one replica while others idle.

round_robin: the engines in name order, one after the other (this frontend's own counter).
least_load: the least loaded engine (ties: rendezvous order).
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
    """The choices of --routing-policy."""
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

    One always qualifies: the bound exceeds the mean load, so the least loaded engine is
    below it. ``factor`` >= 1; larger keeps prefixes together longer, 1 balances strictly.
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
    # cache_aware: cache_hit (the engine holding the most), balance (one holding less, for
    # its load), fallback (none holds min_match_tokens); else the policy's name.
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
        # The engines the balance rule leaves in: those not so far above the least loaded
        # that the two would be imbalanced (the least loaded always stays). An overloaded
        # engine sheds new requests to the best of the rest, not to whoever is emptiest,
        # so a conversation moves only when its own engine is the overloaded one.
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
