"""The hierarchical cache side by side: one multi-turn chat workload whose live prefixes
outgrow the device pool, against servers with the host tier off, with it on, and with a
pool large enough to hold everything (the target the host tier should come close to).

Model: a random-weight ~25M-parameter Llama over the default tokenizer with an 8k context
(the default model's 512 tokens are too short for six turns), built in a temporary folder.
Prints one markdown table (hit rate, wall time, ratios) for docs/benchmarks.md.

Then one long prefix, computed cold and then reloaded from the host tier after eviction
pushed it out of the pool (time to its first token, median of --reps).

    .venv/bin/python bench/bench_hicache.py [--quick] [--pool N] [--ratio R] [--unbounded N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.* when run as `python bench/...`

from radixserve.v1 import generation_pb2  # noqa: E402
from services.loadgen import serving  # noqa: E402
from tests.conftest import make_tiny_zen_model  # noqa: E402
from tests.server_util import Server, greedy, scrape_metrics  # noqa: E402

MODEL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
)


def workload_args(base_url: str, quick: bool, workload: str, model: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_bench_args(parser)
    common = ["--base-url", base_url, "--ignore-eos", "--seed", "1", "--max-concurrency", "8"]
    if workload == "gsp":  # 32 system prompts of 2,048 tokens: 4x a 16,384-token pool
        groups, per_group = ("8", "2") if quick else ("32", "6")
        return parser.parse_args(
            common + ["--tokenizer", str(model), "--workload", "generated-shared-prefix",
                      "--gsp-num-groups", groups,
                      "--gsp-prompts-per-group", per_group, "--gsp-system-prompt-len", "2048",
                      "--gsp-question-len", "64", "--gsp-output-len", "16", "--gsp-interleave"]
        )  # fmt: skip
    prompts, turns = ("16", "4") if quick else ("48", "6")
    return parser.parse_args(
        common + ["--workload", "multi-turn", "--num-prompts", prompts, "--num-turns", turns,
                  "--input-len", "200", "--output-len", "48"]
    )  # fmt: skip


def run_one(model: Path, flags: list[str], quick: bool, workload: str) -> dict[str, float]:
    with Server(*flags, model=model, metrics=True, timeout=600) as s:
        ns = workload_args(f"http://127.0.0.1:{s.http_port}", quick, workload, model)
        start = time.perf_counter()
        rep = serving.benchmark(ns)
        wall = time.perf_counter() - start
        m = scrape_metrics(s.sched_metrics)
    assert rep["completed"] and not rep["errors"], rep["error_messages"]
    return {
        "hit": rep["cache_hit_rate"],
        "wall": wall,
        "cached": m.get("radixserve:cached_tokens_total", 0.0),
        "moved": m.get("radixserve:hicache_tokens_total", 0.0),
    }


def reload_vs_recompute(model: Path, pool: int, prefix: int, reps: int) -> dict[str, float]:
    """Seconds to the first token of a prefix+1-token prompt: cold (computed) and after the
    prefix was evicted to the host tier (loaded back), side by side in one server."""
    rng = random.Random(0)
    flags = ["--max-total-tokens", str(pool), "--hicache-ratio", "8"]
    cold, warm = [], []
    with Server(*flags, model=model, timeout=600) as s:

        def ttft(ids: list[int]) -> tuple[float, int]:
            start = time.perf_counter()
            _, _, last = s.generate(
                input_ids=generation_pb2.InputIds(ids=ids), sampling=greedy(1, ignore_eos=True)
            )
            return time.perf_counter() - start, last.cached_tokens

        for _ in range(reps):
            head = [rng.randrange(3, 590) for _ in range(prefix)]
            t, _ = ttft(head + [rng.randrange(3, 590)])
            cold.append(t)
            for _ in range(pool // prefix + 1):  # other prompts push it out of the pool
                ttft([rng.randrange(3, 590) for _ in range(prefix + 1)])
            t, cached = ttft(head + [rng.randrange(3, 590)])
            assert cached == prefix, f"reloaded {cached} of {prefix} tokens"
            warm.append(t)
    return {"cold": statistics.median(cold), "reload": statistics.median(warm)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 conversations of 4 turns")
    p.add_argument("--pool", type=int, default=16384, help="device pool of the small servers")
    p.add_argument("--ratio", type=float, default=16.0, help="--hicache-ratio of the tiered one")
    p.add_argument("--unbounded", type=int, default=393216, help="pool that holds everything")
    p.add_argument("--prefix", type=int, default=4096, help="tokens of the reloaded prefix")
    p.add_argument("--reps", type=int, default=3, help="reloads measured (median)")
    p.add_argument(
        "--workload", choices=["multi-turn", "gsp"], default="multi-turn",
        help="multi-turn chats, or generated-shared-prefix with its groups interleaved",
    )  # fmt: skip
    p.add_argument("--skip-reload", action="store_true", help="no 4,096-token reload timing")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_zen_model(Path(tmp) / "llama-25m", **MODEL)
        configs = {
            "tiers off": ["--max-total-tokens", str(args.pool)],
            f"host tier ({args.ratio:g}x)": [
                "--max-total-tokens", str(args.pool), "--hicache-ratio", str(args.ratio)
            ],
            "host tier (2x) + storage": [
                "--max-total-tokens", str(args.pool), "--hicache-ratio", "2",
                "--hicache-storage-dir", str(Path(tmp) / "pages"),
            ],
            "unbounded pool": ["--max-total-tokens", str(args.unbounded)],
        }  # fmt: skip
        got = {}
        for name, flags in configs.items():
            got[name] = run_one(model, flags, args.quick, args.workload)
            print(f"{name}: {got[name]}", file=sys.stderr, flush=True)  # kept if killed
        reload = None
        if not args.skip_reload:
            reload = reload_vs_recompute(model, args.pool, args.prefix, args.reps)
    off, host, _, full = (got[n] for n in configs)
    print(f"\n{args.workload}, pool {args.pool} tokens ({'quick' if args.quick else 'full'})\n")
    print("| configuration | cache hit rate | cached tokens | wall (s) | vs unbounded |")
    print("|---|---:|---:|---:|---:|")
    for name, r in got.items():
        print(
            f"| {name} | {r['hit']:.3f} | {r['cached']:,.0f} | {r['wall']:.1f} | "
            f"{r['wall'] / full['wall']:.2f}x |"
        )
    print(
        f"\nhost tier: cached tokens {host['cached'] / max(1.0, full['cached']):.0%} of the "
        f"unbounded pool's, {off['wall'] / host['wall']:.2f}x faster than tiers off, "
        f"{host['moved']:,.0f} tokens moved between tiers"
    )
    if reload is None:
        return 0
    print(
        f"\n{args.prefix}-token prefix, time to first token: computed {reload['cold']:.3f} s, "
        f"reloaded from the host tier {reload['reload']:.3f} s "
        f"({reload['cold'] / reload['reload']:.1f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
