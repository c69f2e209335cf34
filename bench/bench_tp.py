"""Tensor parallelism on the CPU: TP=2 x 1 thread against TP=1 x 2 threads (issue 40).

The same cores either way; what differs is who splits the work: two gloo ranks each
running half the heads and rows on one thread (two all-reduces per layer, one for the
embedding, a logits gather, the step broadcast), or one process whose torch ops use two
threads. It shows what the collectives cost honestly; TP exists for models that do not fit
one device, not to beat threads on one CPU.

Each configuration runs in fresh processes (services/worker/parallel/rank_runner.py, the
follower loop the worker's ranks run): a prefill of --prompts prompts of --prompt-len
tokens (--rounds times, tokens/s), then --steps decode steps of a batch of --batch
(ms/step, median), each configuration --repeats times in fresh processes, interleaved;
medians and the ratio. Timing belongs on a quiet machine; --smoke runs a few steps only.

    .venv/bin/python bench/bench_tp.py                       # the embedded default model
    .venv/bin/python bench/bench_tp.py --model-path ~/.cache/radixserve-peers/models/small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from services.common.config import DEFAULT_MODEL_PATH
from services.worker.parallel.group import TpGroup, destroy_group, init_group
from services.worker.parallel.launch import store_path
from services.worker.parallel.rank_runner import RankModel, RankShape, make_step


@dataclass(frozen=True)
class Plan:
    model_path: str
    prompts: int
    prompt_len: int
    rounds: int
    batch: int
    steps: int
    device: str = "cpu"  # cuda: rank r on GPU r, NCCL (the GPU check's TP row)


def run_plan(rank: RankModel, plan: Plan) -> dict[str, float]:
    """Rank 0's timings (the others follow)."""
    span = max(plan.prompt_len, 1) + plan.steps + 1
    rng = np.random.default_rng(0)
    vocab = rank.config.vocab_size
    prefill = []
    for _ in range(plan.rounds):
        ids = [rng.integers(1, vocab, plan.prompt_len) for _ in range(plan.prompts)]
        out = [1 + i * span + np.arange(plan.prompt_len) for i in range(plan.prompts)]
        step = make_step(ids, out, range(plan.prompts), [0] * plan.prompts, False,
                         np.cumsum([plan.prompt_len] * plan.prompts) - 1)  # fmt: skip
        t0 = time.perf_counter()
        rank.lead(step)
        _sync(rank.device)
        prefill.append(plan.prompts * plan.prompt_len / (time.perf_counter() - t0))
    # decode: the batch's first tokens at position 0, then one token per request per step
    b = plan.batch
    decode = []
    for k in range(plan.steps + 1):
        step = make_step(
            [rng.integers(1, vocab, 1) for _ in range(b)],
            [np.array([1 + i * span + k]) for i in range(b)],
            range(b),
            [k] * b,
            k > 0,
            np.arange(b),
        )
        t0 = time.perf_counter()
        rank.lead(step)
        _sync(rank.device)
        if k:  # the first one starts the requests
            decode.append(1000 * (time.perf_counter() - t0))
    rank.stop()
    result = {"prefill_tok_s": statistics.median(prefill), "decode_ms": statistics.median(decode)}
    return result | {
        "all_reduce_us": _all_reduce_us(rank.tp, rank.device, b, rank.config.hidden_size)
    }


def _all_reduce_us(
    tp: TpGroup, device: torch.device, rows: int, hidden: int, times: int = 100
) -> float:
    """Median latency of one all-reduce of a decode step's [rows, hidden] activations (each
    decode step runs 2 per layer, one for the embedding, a gather and two broadcasts)."""
    if tp.world == 1:
        return 0.0
    x, spent = torch.zeros(rows, hidden, device=device), []
    for i in range(times + 1):
        if i == 1:
            tp.barrier()
        t0 = time.perf_counter()
        tp.all_reduce(x)
        _sync(device)
        spent.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(spent[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(index: int, world: int, threads: int, store: str, plan: Plan, out: str) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", index) if plan.device == "cuda" else torch.device("cpu")
    tp = init_group(index, world, store, device, 120.0) if world > 1 else TpGroup()
    span = max(plan.prompt_len, 1) + plan.steps + 1
    rows = max(plan.prompts, plan.batch)
    shape = RankShape(num_slots=rows * span + 1, max_running_requests=rows, max_context=span)
    rank = RankModel(plan.model_path, tp, device, shape)
    tp.barrier()
    if tp.is_first:
        Path(out).write_text(json.dumps(run_plan(rank, plan)))
    else:
        rank.follow()
        _all_reduce_us(tp, device, plan.batch, rank.config.hidden_size)  # rank 0's, after its STOP
    destroy_group(tp)


def measure(world: int, threads: int, plan: Plan) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="radixserve-bench-tp-") as folder:
        out = os.path.join(folder, "result.json")
        mp.spawn(_rank, args=(world, threads, store_path(folder), plan, out), nprocs=world)
        return json.loads(Path(out).read_text())


def compare(
    configs: dict[str, tuple[int, int]], plan: Plan, repeats: int
) -> dict[str, dict[str, float]]:
    """Medians per configuration (name -> (ranks, threads)), runs interleaved: the order flips
    each repeat, so a noisy machine's drift cancels."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for rep in range(repeats):
        for name in list(configs)[:: 1 if rep % 2 == 0 else -1]:
            runs[name].append(measure(*configs[name], plan))
    return {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="fresh runs of each, interleaved")
    p.add_argument("--smoke", action="store_true", help="a few steps: checks it runs, no timing")
    a = p.parse_args()
    plan = Plan(a.model_path, a.prompts, a.prompt_len, a.rounds, a.batch, a.steps)
    if a.smoke:
        plan, a.repeats = Plan(a.model_path, 2, 16, 1, 2, 3), 1
    print(f"model {Path(plan.model_path).name}; {json.dumps(asdict(plan) | {'model_path': ''})}")
    configs = {"TP=1 x 2 threads": (1, 2), "TP=2 x 1 thread": (2, 1)}
    med = compare(configs, plan, a.repeats)
    print(f"| configuration | prefill tokens/s | decode ms/step (batch {plan.batch}) |")
    print("|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['prefill_tok_s']:.0f} | {m['decode_ms']:.2f} |")
    one, two = med["TP=1 x 2 threads"], med["TP=2 x 1 thread"]
    print(
        f"| TP=2 / TP=1 | {two['prefill_tok_s'] / one['prefill_tok_s']:.2f}x | "
        f"{one['decode_ms'] / two['decode_ms']:.2f}x (speed) |"
    )
    print(f"gloo all-reduce of [{plan.batch}, hidden] float32, TP=2: {two['all_reduce_us']:.0f} us")


if __name__ == "__main__":
    main()
