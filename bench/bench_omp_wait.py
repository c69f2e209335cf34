"""OpenMP wait policy of the worker: decode steps with threads that sleep vs spin (issue 18).

libgomp reads its wait policy once, when torch loads it, so each setting runs in its own
child process; the settings alternate round after round and the medians are compared.
A child builds a ModelRunner (the server's defaults: packed linears, the C decode kernel),
prefills --batch prompts and times --steps decode steps (wall ms per step, median).

    passive   OMP_WAIT_POLICY=PASSIVE: sleep at once (the worker's --cpu-wait passive)
    spin      GOMP_SPINCOUNT=300000 (libgomp's own default: spin ~300k rounds, then sleep)
    spinN     GOMP_SPINCOUNT=N (--cpu-wait spin is spin30000)
    adaptive  --cpu-wait adaptive, the worker's default: spin30000, and the worker's thread
              governor (services/worker/cpu_threads.py) around every step

``--busy N`` runs N busy loops (one process each) beside the children for the whole run:
the cores wanted by someone else, as on a shared machine.

    M=~/.cache/radixserve-peers/models/small
    .venv/bin/python bench/bench_omp_wait.py --model-path $M --batches 16 64 --rounds 3 \
        --policies passive spin20000 spin
    .venv/bin/python bench/bench_omp_wait.py --model-path $M --batches 16 --rounds 2 \
        --policies passive spin30000 adaptive --busy 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.worker.cpu_threads import SPIN_COUNT  # noqa: E402  (stdlib only: no torch yet)


def policy_env(name: str) -> dict[str, str]:
    """The environment of one --policies name (see the docstring)."""
    if name == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if name == "adaptive":
        return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    count = name.removeprefix("spin") or "300000"
    if not count.isdigit():
        raise SystemExit(f"--policies: unknown policy {name!r}")
    return {"GOMP_SPINCOUNT": count}


def child(path: str, batch: int, prompt_len: int, steps: int, threads: int, adapt: bool) -> None:
    import random
    import time
    from contextlib import nullcontext

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode_step import batches, runner

    from services.worker import wire
    from services.worker.cpu_threads import ThreadGovernor

    torch.set_num_threads(threads)
    governor = ThreadGovernor(threads, torch.set_num_threads) if adapt else None
    r = runner(path, batch * (prompt_len + steps) + 16, nullcontext)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, r.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    todo = batches(prompts, steps)
    wire.forward(r, todo[0])
    times = []
    for b in todo[1:]:
        start = time.perf_counter()
        if governor:
            governor.before(len(b.reqs))  # decode steps: one row a request
        wire.forward(r, b)
        if governor:
            governor.after()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times[1:]) * 1e3}))


def run_child(ns: argparse.Namespace, policy: str, batch: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(policy_env(policy))
    argv = [sys.executable, __file__, "--child", "--model-path", ns.model_path,
            "--batches", str(batch), "--prompt-len", str(ns.prompt_len), "--steps",
            str(ns.steps), "--threads", str(ns.threads)]  # fmt: skip
    if policy == "adaptive":
        argv.append("--adaptive")
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=288)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=["passive", "spin"])
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    for name in ns.policies:  # a bad name fails here, not after the first children ran
        policy_env(name)
    if len(set(ns.policies)) != len(ns.policies):
        raise SystemExit("--policies: each policy once")
    if ns.child:
        child(ns.model_path, ns.batches[0], ns.prompt_len, ns.steps, ns.threads, ns.adaptive)
        return
    if ns.busy < 0:
        raise SystemExit("--busy: a count >= 0")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.busy)]
    try:
        compare(ns)
    finally:
        for proc in busy:
            proc.kill()


def compare(ns: argparse.Namespace) -> None:
    print(f"{ns.threads} threads, prompts {ns.prompt_len}, {ns.steps} decode steps per child, "
          f"{ns.rounds} rounds, {ns.busy} busy loops beside, load average at start "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    base = ns.policies[0]
    head = " | ".join(f"{p} ms/step" for p in ns.policies)
    speed = " | ".join(f"{p} / {base} speed" for p in ns.policies[1:])
    print(f"| decode batch | {head} | {speed} | per round ({' / '.join(ns.policies)}) |")
    print("|---:|" + "---:|" * (2 * len(ns.policies) - 1) + "---|")
    for b in ns.batches:
        ms: dict[str, list[float]] = {p: [] for p in ns.policies}
        for r in range(ns.rounds):
            for p in ns.policies if r % 2 == 0 else reversed(ns.policies):
                ms[p].append(run_child(ns, p, b))
        med = {p: statistics.median(v) for p, v in ms.items()}
        cells = " | ".join(f"{med[p]:.1f}" for p in ns.policies)
        ratios = " | ".join(f"{med[base] / med[p]:.2f}x" for p in ns.policies[1:])
        rounds = ", ".join("/".join(f"{ms[p][r]:.0f}" for p in ns.policies)
                           for r in range(ns.rounds))  # fmt: skip
        print(f"| {b} | {cells} | {ratios} | {rounds} |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
