"""Host costs that grow: the scheduler's time per step against running requests and against
tree size, the radix tree's match / insert at up to 1M nodes, and the tree's memory per
node and per cached token. No model, no tensors: a null worker answers every batch at
once, so what is timed is the scheduler's own work. Not a test.

    .venv/bin/python bench/bench_costs.py                 # every curve (~3 min)
    .venv/bin/python bench/bench_costs.py --only tree --nodes 10000 100000

What each curve should show: per-step time linear in running requests (the step touches
each one: that is the work), flat in tree size (a step walks no tree); match and insert
of a 1k-token prompt flat in tree size (a walk is as long as the prompt, not the tree).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_radix_cache import serve_one  # noqa: E402

from radixserve.internal.v1 import engine_pb2  # noqa: E402
from services.common.config import SchedulerConfig  # noqa: E402
from services.common.transport import pack_i32  # noqa: E402
from services.scheduler.allocator import KVSlotAllocator  # noqa: E402
from services.scheduler.radix_cache import RadixCache, TreeNode  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.scheduler.tokens import as_tokens  # noqa: E402

VOCAB = 32000


class NullWorker:
    """Stands in for the worker's socket: answers each batch with one token per request at
    once, and keeps its own time apart so it can be taken out of the step's."""

    def __init__(self, slots: int, max_running: int):
        self.spent_ns = 0
        self.replies: list[bytes] = []
        self.info = engine_pb2.WorkerInfo(
            model_id="null", architecture="Null", vocab_size=VOCAB, max_model_len=1 << 20,
            max_total_num_tokens=slots, max_running_requests=max_running, device="cpu",
            dtype="float32", num_layers=1, num_key_value_heads=1, head_dim=8,
            eos_token_ids=[VOCAB - 1],
        )  # fmt: skip

    def send(self, payload, flags: int = 0, copy: bool = True) -> None:
        t0 = time.perf_counter_ns()
        msg = engine_pb2.SchedulerToWorker.FromString(bytes(payload))
        if msg.HasField("info"):
            out = engine_pb2.WorkerToScheduler(info=self.info)
        else:
            res = engine_pb2.ForwardResult(batch_id=msg.forward.batch_id)
            for r in msg.forward.reqs:
                res.tokens.add(token_id=7 if r.sample else -1)
            out = engine_pb2.WorkerToScheduler(result=res)
        self.replies.append(out.SerializeToString())
        self.spent_ns += time.perf_counter_ns() - t0

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.replies)

    def recv(self, flags: int = 0) -> bytes:
        return self.replies.pop(0)


def scheduler(slots: int, max_running: int) -> tuple[Scheduler, NullWorker]:
    worker = NullWorker(slots, max_running)
    cfg = SchedulerConfig(max_running_requests=max_running, decode_log_interval=1 << 30)
    return Scheduler(cfg, worker, worker.info), worker


def submit(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> None:
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sampling)
    sched.add_request(b"frontend", msg)


def decode_step_us(sched: Scheduler, worker: NullWorker, steps: int) -> float:
    """Median scheduler time of one decode step (the null worker's time taken out)."""
    times = []
    for _ in range(steps):
        worker.spent_ns = 0
        t0 = time.perf_counter_ns()
        sched.step()
        sched.outbox.take()
        times.append((time.perf_counter_ns() - t0 - worker.spent_ns) / 1000)
    return statistics.median(times)


def start_decoding(
    sched: Scheduler, n: int, prompt_len: int, max_tokens: int, rng: random.Random
) -> None:
    for i in range(n):
        submit(sched, f"r{i}", [rng.randrange(VOCAB - 1) for _ in range(prompt_len)], max_tokens)
    while any(r.in_prefill for r in sched.queues.running) or sched.queues.waiting:
        sched.step()
        sched.outbox.take()


def curve_batch(ns: argparse.Namespace) -> list[tuple[int, float]]:
    """Scheduler time per decode step against running requests."""
    out = []
    for n in ns.running:
        rng = random.Random(n)
        sched, worker = scheduler(n * (ns.prompt_len + ns.steps + 64) + 1024, n)
        start_decoding(sched, n, ns.prompt_len, ns.steps + 32, rng)
        assert len(sched.queues.running) == n, "not every request is running"
        decode_step_us(sched, worker, 5)  # warm
        out.append((n, decode_step_us(sched, worker, ns.steps)))
        print(f"batch {n:4d}: {out[-1][1]:9.1f} us/step, {out[-1][1] / n:6.2f} us/request")
    return out


def grow_tree(cache: RadixCache, alloc: KVSlotAllocator, nodes: int, rng: random.Random) -> int:
    """Inserts branching sequences until the tree holds ``nodes`` nodes (each insert forks an
    earlier sequence at a random point: one split and one leaf); returns the nodes made."""
    seqs: list[list[int]] = [[rng.randrange(VOCAB) for _ in range(16)]]
    made = count_nodes(cache.root)
    while made < nodes:
        for _ in range((nodes - made) // 2 + 1):
            base = rng.choice(seqs)
            seq = base[: rng.randrange(1, len(base))] + [rng.randrange(VOCAB) for _ in range(8)]
            serve_one(cache, alloc, as_tokens(seq[:-1]), as_tokens(seq[-1:] + [0]))
            if len(seqs) < 50_000:
                seqs.append(seq)
        made = count_nodes(cache.root)
    return made


def count_nodes(root: TreeNode) -> int:
    count, stack = 0, [root]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count - 1


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def curve_tree(ns: argparse.Namespace) -> list[dict]:
    """match / insert of a 1k-token prompt against tree size, and the tree's memory."""
    out = []
    for nodes in ns.nodes:
        rng = random.Random(nodes)
        gc.collect()
        alloc = KVSlotAllocator(12 * nodes + 4 * ns.probes * 1024 + 4096)
        rss0 = rss_bytes()
        cache = RadixCache(alloc)
        made = grow_tree(cache, alloc, nodes, rng)
        gc.collect()
        tree_bytes = rss_bytes() - rss0
        cached = alloc.total - alloc.num_free
        prompts = [as_tokens([rng.randrange(VOCAB) for _ in range(1024)]) for _ in range(ns.probes)]
        miss, insert, hit = [], [], []
        for p in prompts:
            t0 = time.perf_counter_ns()
            cache.match_prompt(p)
            miss.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            serve_one(cache, alloc, p, as_tokens([1]))
            insert.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            cache.match_prompt(p)
            hit.append(time.perf_counter_ns() - t0)
        row = {
            "nodes": made,
            "miss_us": statistics.median(miss) / 1000,
            "insert_us": statistics.median(insert) / 1000,
            "hit_us": statistics.median(hit) / 1000,
            "bytes_per_node": tree_bytes / made,
            "cached_tokens": cached,
        }
        out.append(row)
        print(
            f"tree {made:9,d} nodes: match miss {row['miss_us']:6.1f} us, match+lock+insert "
            f"{row['insert_us']:7.1f} us, match hit {row['hit_us']:6.1f} us (1,024-token "
            f"prompt); RSS {tree_bytes / 2**20:7.1f} MiB = {row['bytes_per_node']:5.0f} B/node"
        )
        del cache, alloc
    return out


def curve_step_vs_tree(ns: argparse.Namespace) -> list[tuple[int, float]]:
    """Scheduler time per decode step of ns.tree_batch requests against tree size."""
    out = []
    for nodes in ns.nodes:
        rng = random.Random(nodes)
        slots = 12 * nodes + ns.tree_batch * (ns.prompt_len + ns.steps + 64) + 4096
        sched, worker = scheduler(slots, ns.tree_batch)
        cache = sched.kv.cache
        assert isinstance(cache, RadixCache)
        made = grow_tree(cache, sched.kv.allocator, nodes, rng)
        start_decoding(sched, ns.tree_batch, ns.prompt_len, ns.steps + 32, rng)
        assert len(sched.queues.running) == ns.tree_batch, "not every request is running"
        decode_step_us(sched, worker, 5)
        out.append((made, decode_step_us(sched, worker, ns.steps)))
        print(f"tree {made:9,d} nodes, batch {ns.tree_batch}: {out[-1][1]:8.1f} us/step")
        del sched, worker
        gc.collect()
    return out


def markdown(batch, tree, step_tree) -> str:
    lines = []
    if batch:
        lines += ["| running requests | scheduler us / step | us / request |", "|---:|---:|---:|"]
        lines += [f"| {n} | {us:,.0f} | {us / n:.1f} |" for n, us in batch]
        lines.append("")
    if tree:
        lines += [
            "| tree nodes | match, miss (us) | match + insert (us) | match, hit (us) | "
            "tree RSS per node (B) | cached tokens |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['nodes']:,} | {r['miss_us']:.1f} | {r['insert_us']:.1f} | "
            f"{r['hit_us']:.1f} | {r['bytes_per_node']:.0f} | {r['cached_tokens']:,} |"
            for r in tree
        ]
        lines.append("")
    if step_tree:
        lines += ["| tree nodes | scheduler us / decode step |", "|---:|---:|"]
        lines += [f"| {n:,} | {us:,.0f} |" for n, us in step_tree]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=["batch", "tree", "step-tree"], action="append")
    p.add_argument("--running", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--nodes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--tree-batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--probes", type=int, default=200, help="1k-token prompts per tree size")
    return p.parse_args()


def main() -> None:
    ns = parse_args()
    only = set(ns.only or ["batch", "tree", "step-tree"])
    batch = curve_batch(ns) if "batch" in only else []
    tree = curve_tree(ns) if "tree" in only else []
    step_tree = curve_step_vs_tree(ns) if "step-tree" in only else []
    print()
    print(markdown(batch, tree, step_tree))


if __name__ == "__main__":
    main()
