"""Orders the waiting queue before each prefill batch (``--schedule-policy``).

The cache-aware ones (``lpm``: longest cached prefix first; ``dfs-weight``: heavier
subtrees first) fall back to fcfs on long queues, where matching every request each step
would cost more than it saves.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

from services.scheduler.radix_cache import BasePrefixCache
from services.scheduler.request import Req

LPM_MAX_QUEUE = 128

Policy = Callable[[list[Req], BasePrefixCache], list[Req]]
_POLICIES: dict[str, Policy] = {}


def register(name: str) -> Callable[[Policy], Policy]:
    def deco(fn: Policy) -> Policy:
        _POLICIES[name] = fn
        return fn

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def order(name: str, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    if name not in _POLICIES:
        raise ValueError(f"--schedule-policy {name!r} is unknown; choose one of {policy_names()}")
    return _POLICIES[name](waiting, cache)


@register("fcfs")
def fcfs(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda r: r.arrival_time)


@register("lof")
def longest_output_first(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda r: (-r.max_new_tokens, r.arrival_time))


@register("random")
def random_order(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    out = list(waiting)
    random.shuffle(out)
    return out


@register("priority")
def by_priority(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda r: (-r.priority, r.arrival_time))


def _matches(waiting: list[Req], cache: BasePrefixCache):
    # peek: ordering the queue is not a use, so eviction scores stay honest.
    return [cache.match_prompt(r.fill_ids, r.namespace, peek=True) for r in waiting]


@register("lpm")
def longest_prefix_match(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    if len(waiting) > LPM_MAX_QUEUE:
        return fcfs(waiting, cache)
    lens = [len(m.slots) for m in _matches(waiting, cache)]
    ranked = sorted(range(len(waiting)), key=lambda i: (-lens[i], waiting[i].arrival_time))
    return [waiting[i] for i in ranked]


@register("dfs-weight")
def dfs_weight(waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
    if len(waiting) > LPM_MAX_QUEUE:
        return fcfs(waiting, cache)
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, list] = defaultdict(list)
    for req, m in zip(waiting, _matches(waiting, cache), strict=True):
        node = m.node
        at_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            parent = node.parent
            if parent is not None and weight[id(node)] == 1:
                children[id(parent)].append(node)
            node = parent
    out: list[Req] = []
    stack = [cache.root]
    while stack:
        node = stack.pop()
        out.extend(sorted(at_node.get(id(node), []), key=lambda r: r.arrival_time))
        # Pushed lightest first so that the heaviest child is visited next.
        stack.extend(sorted(children.get(id(node), []), key=lambda c: weight[id(c)]))
    return out
