"""Benchmark of one cache-aware routing decision in the frontend (no sockets): not a test.

Each of --engines engines has a CacheIndex of --pages indexed blocks (random keys, plus
the chains of a few shared system prompts, spread over the engines); each request is a
--prompt-tokens prompt, half of them behind one of those system prompts. Per request it
times what EngineClient.submit and _dispatch do: the routing key, the prompt's block keys
(hashed once, from the request's packed ids), every engine's match, the decision
(services/frontend/router.py) with the prompt's hot prefix (hot_prefixes.py), and recording
the keys as sent to the chosen engine and as routed.
Prints p50/p99 in microseconds.

    .venv/bin/python bench/bench_routing.py [--engines 3] [--pages 10000] [--prompt-tokens 2048]
                                            [--block-tokens 16] [--requests 2000]
    .venv/bin/python bench/bench_routing.py --requests 20 --pages 100   (a quick check)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/...`

from services.common import transport  # noqa: E402
from services.common.page_keys import block_keys  # noqa: E402
from services.frontend.cache_index import CacheIndex, PromptKeys  # noqa: E402
from services.frontend.hot_prefixes import HotPrefixes  # noqa: E402
from services.frontend.router import Router, RoutingParams, prefix_key  # noqa: E402

SEED = b"bench-model"
VOCAB = 32000


def build(
    args: argparse.Namespace, rng: random.Random
) -> tuple[dict[str, CacheIndex], list[list[int]]]:
    """The engines' indexes and the shared system prompts (each cached on one engine)."""
    names = [f"10.0.0.{i + 1}" for i in range(args.engines)]
    indexes: dict[str, CacheIndex] = {}
    systems = [[rng.randrange(VOCAB) for _ in range(args.prompt_tokens // 2)] for _ in range(8)]
    for i, name in enumerate(names):
        index = CacheIndex()
        shared = [k for s in systems[i :: len(names)] for k in _keys(s, args.block_tokens)]
        randoms = max(args.pages - len(shared), 0)
        stored = b"".join(shared) + rng.randbytes(16 * randoms)
        index.replace(args.block_tokens, SEED, stored)
        indexes[name] = index
    return indexes, systems


def _keys(ids: list[int], block_tokens: int) -> list[bytes]:
    return block_keys(SEED, "", ids, 0, len(ids) // block_tokens, block_tokens)


def run(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    indexes, systems = build(args, rng)
    router = Router(RoutingParams("cache_aware"))
    hot = HotPrefixes()
    times, branches = [], {"cache_hit": 0, "balance": 0, "fallback": 0}
    for _ in range(args.requests):
        head = rng.choice(systems) if rng.random() < 0.5 else []
        tail = [rng.randrange(VOCAB) for _ in range(args.prompt_tokens - len(head))]
        ids = head + tail
        wire = transport.pack_i32(ids)  # the TokenizedRequest's input_ids, as submit gets them
        loads = {name: rng.randrange(6) for name in indexes}
        t0 = time.perf_counter()
        prompt = PromptKeys("", transport.unpack_i32(wire))
        keys = prompt.keys(SEED, args.block_tokens)
        decision = router.choose(
            prefix_key("", ids),
            loads,
            lambda name, p=prompt: indexes[name].match_prompt(p),
            hot.hot_blocks(keys) * args.block_tokens,
        )
        indexes[decision.engine].note_sent(prompt)
        hot.note(keys)
        times.append(time.perf_counter() - t0)
        branches[decision.branch] += 1
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return {"p50_us": statistics.median(times) * 1e6, "p99_us": p99 * 1e6, **branches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--pages", type=int, default=10_000, help="indexed blocks per engine")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    r = run(args)
    print(
        f"routing decision, {args.engines} engines x {args.pages} pages, "
        f"{args.prompt_tokens}-token prompts, {args.block_tokens}-token blocks: "
        f"p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us "
        f"(cache_hit {r['cache_hit']}, balance {r['balance']}, fallback {r['fallback']})"
    )


if __name__ == "__main__":
    main()
