"""What the cache events cost the scheduler (issue 37): one workload through a real
Scheduler and the fake worker (tests/fake_worker.py, which costs next to nothing), with
--cache-events-port -1 (off) and on (every step's events taken and serialized, as the
publisher does), alternating, median of --reps. Reports microseconds per step and the
ratio; the tree's hooks, the hashing of new blocks and the per-step message are all in it.

    .venv/bin/python bench/bench_cache_events.py [--reps 5] [--sessions 32] [--turns 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fake_worker import make, submit  # noqa: E402


def run_once(events: bool, sessions: int, turns: int, prompt_len: int) -> tuple[float, int]:
    """(seconds, steps) for a multi-turn workload of ``sessions`` chats of ``turns`` turns."""
    rng = random.Random(1)
    sched, _ = make(num_slots=131072, max_running=32, cache_events_port=0 if events else -1)
    system = [rng.randrange(1, 900) for _ in range(256)]
    hist = {s: system + [rng.randrange(1, 900) for _ in range(prompt_len)] for s in range(sessions)}
    steps, elapsed = 0, 0.0
    for turn in range(turns):
        for s, h in hist.items():
            submit(sched, f"s{s}t{turn}", h, 32)
        out: dict[str, list[int]] = {}
        start = time.perf_counter()
        while True:
            worked = sched.step()
            if sched.events is not None and (msg := sched.events.take()) is not None:
                msg.SerializeToString()
            for deltas in sched.outbox.take().values():
                for d in deltas:
                    out.setdefault(d.rid, []).extend(d.token_ids)
            steps += worked
            if not worked and not sched.has_requests():
                break
        elapsed += time.perf_counter() - start
        for s, h in hist.items():
            h += out[f"s{s}t{turn}"] + [rng.randrange(1, 900) for _ in range(prompt_len)]
    return elapsed, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=200)
    ns = p.parse_args()
    per_step: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ns.reps):
        for on in (False, True):
            secs, steps = run_once(on, ns.sessions, ns.turns, ns.prompt_len)
            per_step[on].append(secs / steps * 1e6)
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    print(f"| cache events | scheduler us per step (median of {ns.reps}) |")
    print("|---|---|")
    print(f"| off | {off:.1f} |")
    print(f"| on | {on:.1f} ({on / off:.3f}x) |")


if __name__ == "__main__":
    main()
