"""Which engine replica gets a request: cache-aware first, load-aware when it matters.

The routing key is (cache_salt, the first ROUTING_PREFIX_TOKENS prompt ids). Engines are
ranked for that key by rendezvous (highest-random-weight) hashing of (key, engine name), so

- requests that share a prefix (a system prompt, a few-shot header) rank the engines the
  same way and land on the engine whose radix tree already holds that prefix's KV, and every
  frontend computes the same ranking without talking to the others;
- adding or removing an engine moves only the keys that it wins or loses.

Bounded loads (consistent hashing with bounded loads, Mirrokni et al.): an engine may take a
new request only while its load is below ceil(factor * (total load + 1) / engines). The
request goes to the first engine of its ranking under that bound, so a hot prefix fills its
first-choice engine up to a fair share and then spills to its second choice (which then
caches the prefix too) instead of queueing on one replica while the others idle.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from services.common import transport

ROUTING_PREFIX_TOKENS = 32
DEFAULT_LOAD_FACTOR = 1.25


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
    """The first engine of the key's ranking whose load is under the bound.

    One always qualifies: the bound exceeds the mean load, so the least loaded engine is
    below it. ``factor`` >= 1; larger keeps prefixes together longer, 1 balances strictly.
    """
    if not loads:
        raise ValueError("no engine to route to")
    bound = load_bound(loads, factor)
    order = ranking(key, list(loads))
    return next((n for n in order if loads[n] < bound), order[0])
