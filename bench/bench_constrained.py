"""Constrained decoding (issue 12): what the grammar costs. Not a test.

Against a real `radixserve serve` on the embedded default model:

- decode throughput (output tokens/s, all streams together) of 16 concurrent streams,
  unconstrained against constrained (a regex that never ends before max_tokens, so both
  produce exactly the same number of tokens; and a JSON schema, whose outputs end by the
  grammar), the same prompts and seeds; configurations interleaved in every repetition,
  medians reported;
- compile time of a large JSON schema, cold and from the worker's cache: in-process
  (services/worker/grammar) and as the time to first token of a request that carries it;
- inter-token latency (p50 / p99, client side) of 16 running streams before and while a
  large schema compiles: the compile runs on the worker's grammar threads, beside the steps.

    .venv/bin/python bench/bench_constrained.py [--streams 16] [--tokens 96] [--reps 3]
        [--fields 1200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.* when run as `python bench/...`

from radixserve.internal.v1 import engine_pb2  # noqa: E402
from radixserve.v1 import generation_pb2 as pb  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH, WorkerConfig  # noqa: E402
from services.common.transport import pack_i32  # noqa: E402
from services.worker import wire  # noqa: E402
from services.worker.batch import Constraint  # noqa: E402
from services.worker.grammar.compiler import GrammarCompiler, TokenizerInfoSource  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from tests.e2e.constrained_cases import SCHEMAS, large_schema  # noqa: E402
from tests.server_util import Server  # noqa: E402

PROMPTS = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit.",
    "Simple is better than complex.",
    "Complex is better than complicated.",
    "Flat is better than nested.",
    "Sparse is better than dense.",
    "Readability counts.",
    "Errors should never pass silently.",
]
LONG_TEXT = r"[a-z ,.]{2000}"  # longer than any max_tokens here: every stream ends by length
PRODUCT = next(c for c in SCHEMAS if c.name == "product")


def _sampling(i: int, tokens: int, **constraint) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=not constraint, **constraint
    )


def throughput(server: Server, streams: int, tokens: int, **constraint) -> float:
    """Output tokens/s of ``streams`` concurrent requests (wall time of the whole batch)."""

    def one(i: int) -> int:
        text = PROMPTS[i % len(PROMPTS)]
        return len(server.generate(text=text, sampling=_sampling(i, tokens, **constraint))[0])

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        n = sum(pool.map(one, range(streams)))
    return n / (time.perf_counter() - start)


def step_time(runner: ModelRunner, prompts: list[list[int]], steps: int, **kind: str) -> float:
    """Median seconds of one decode step of every stream in the worker (forward + sampling
    + grammar), the requests constrained by ``kind`` (none when empty)."""
    constraint = engine_pb2.Constraint(**kind) if kind else None
    starts, slot, reqs = [], 1, []
    for i, ids in enumerate(prompts):
        sp = engine_pb2.SamplingParams(temperature=1.0, seed=i, ignore_eos=True)
        if constraint is not None:
            sp.constraint.CopyFrom(constraint)
        reqs.append(
            engine_pb2.ForwardRequest(
                req_slot=i,
                input_ids=pack_i32(ids),
                out_slots=pack_i32(range(slot, slot + len(ids))),
                is_new=True,
                sample=True,
                sampling=sp,
            )
        )
        starts.append(slot)
        slot += len(ids) + steps
    if constraint is not None:
        c = wire.constraint_of(constraint)
        assert c is not None
        runner.grammars.compiler.submit(c).result()
    res = wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, reqs=reqs))
    times = []
    for step in range(steps):
        batch = engine_pb2.ForwardBatch(batch_id=2 + step, is_decode=True)
        for i, (ids, tok) in enumerate(zip(prompts, res.tokens, strict=True)):
            pos = len(ids) + step
            batch.reqs.add(
                req_slot=i,
                input_ids=pack_i32([tok.token_id]),
                prefix_len=pos,
                out_slots=pack_i32([starts[i] + pos]),
                sample=True,
            )
        res = wire.forward(runner, batch)
        times.append(res.forward_time)
    return statistics.median(times)


def worker_steps(streams: int, steps: int, reps: int) -> dict[str, float]:
    """Median decode step time per constraint kind, in-process (no sockets, less noise)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(streams)]
    total = sum(len(p) + steps for p in prompts) + 1
    cfg = WorkerConfig(device="cpu", max_total_tokens=total, max_running_requests=streams)
    runner = ModelRunner(cfg)
    kinds: dict[str, dict[str, str]] = {
        "unconstrained": {},
        "regex": {"regex": LONG_TEXT},
        "json_schema": {"json_schema": PRODUCT.text},
    }
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):
        for name, kw in kinds.items():
            out[name].append(step_time(runner, prompts, steps, **kw))
    return {k: statistics.median(v) for k, v in out.items()}


def compile_in_process(fields: int) -> tuple[float, float]:
    """(cold, cached) seconds to get the compiled large schema from a fresh compiler."""
    compiler = GrammarCompiler(TokenizerInfoSource(DEFAULT_MODEL_PATH, 596, [0]), 8, 1)
    compiler.submit(Constraint("regex", "warm")).result()  # the tokenizer info, once
    c = Constraint("json_schema", json.dumps(large_schema(fields)))
    t0 = time.perf_counter()
    compiler.submit(c).result()
    t1 = time.perf_counter()
    compiler.submit(c).result()
    return t1 - t0, time.perf_counter() - t1


class Streams:
    """``n`` long unconstrained streams on threads, each message's arrival time kept."""

    def __init__(self, server: Server, n: int, tokens: int):
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._run, args=(server, i, tokens)) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, server: Server, i: int, tokens: int) -> None:
        req = pb.GenerateRequest(text=PROMPTS[i % len(PROMPTS)], sampling=_sampling(i, tokens))
        for _ in server.stub.Generate(req, timeout=600):
            self.times[i].append(time.perf_counter())

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def gaps(self, lo: float, hi: float) -> list[float]:
        """Inter-token gaps (s) of every stream whose later message arrived in [lo, hi]."""
        return [
            b - a for ts in self.times for a, b in zip(ts, ts[1:], strict=False) if lo <= b <= hi
        ]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def ttft(server: Server, schema: str) -> float:
    t0 = time.perf_counter()
    req = pb.GenerateRequest(
        text=PROMPTS[0], sampling=pb.SamplingParams(max_tokens=4, temperature=0, json_schema=schema)
    )
    for _ in server.stub.Generate(req, timeout=600):
        return time.perf_counter() - t0
    return float("nan")


def itl_during_compile(server: Server, streams: int, fields: int) -> dict[str, float]:
    """ITL of running streams in a quiet window, then while a cold large schema compiles."""
    runs = Streams(server, streams, tokens=480)
    while sum(len(t) > 5 for t in runs.times) < streams:  # all decoding
        time.sleep(0.05)
    quiet_start = time.perf_counter()
    time.sleep(2.0)
    # A schema no one compiled before (the description makes its text new).
    schema = large_schema(fields)
    schema["description"] = f"bench {time.time()}"
    compile_start = time.perf_counter()
    cold = ttft(server, json.dumps(schema))
    compile_end = time.perf_counter()
    cached = ttft(server, json.dumps(schema))
    runs.join()
    quiet, busy = runs.gaps(quiet_start, compile_start), runs.gaps(compile_start, compile_end)
    return {
        "ttft_cold_s": cold,
        "ttft_cached_s": cached,
        "itl_quiet_p50_ms": 1e3 * _pct(quiet, 0.5),
        "itl_quiet_p99_ms": 1e3 * _pct(quiet, 0.99),
        "itl_compile_p50_ms": 1e3 * _pct(busy, 0.5),
        "itl_compile_p99_ms": 1e3 * _pct(busy, 0.99),
        "gaps_during_compile": len(busy),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fields", type=int, default=1200, help="properties of the large schema")
    args = ap.parse_args()

    cold, cached = compile_in_process(args.fields)
    size = len(json.dumps(large_schema(args.fields)))
    print(
        f"large schema ({args.fields} properties, {size} chars): in-process compile "
        f"cold {cold:.3f} s, cached {cached * 1e6:.0f} us"
    )
    base_step = 0.0
    for name, t in worker_steps(args.streams, 48, args.reps).items():
        base_step = base_step or t
        print(
            f"worker decode step, {args.streams} streams, {name:>13}: {t * 1e3:6.2f} ms "
            f"({args.streams / t:7.1f} tok/s, {base_step / t:.2f}x)"
        )
    flags = ("--max-running-requests", "64", "--max-total-tokens", "32768")
    with Server(*flags, "--grammar-compile-timeout", "300", timeout=600) as server:
        kinds = {
            "unconstrained": {},
            "regex": {"regex": LONG_TEXT},
            "json_schema": {"json_schema": PRODUCT.text},
        }
        for kw in kinds.values():  # warm: grammars compiled, code paths hot
            throughput(server, 2, 8, **kw)
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.reps):
            for name, kw in kinds.items():
                rates[name].append(throughput(server, args.streams, args.tokens, **kw))
        base = statistics.median(rates["unconstrained"])
        for name, rs in rates.items():
            med = statistics.median(rs)
            print(
                f"{args.streams} streams x {args.tokens} tokens, {name:>13}: "
                f"{med:7.1f} tok/s ({med / base:.2f}x)  reps {[round(r, 1) for r in rs]}"
            )
        itl = itl_during_compile(server, args.streams, args.fields)
    print(
        f"large schema end to end: TTFT cold {itl['ttft_cold_s']:.2f} s, "
        f"cached {itl['ttft_cached_s']:.3f} s"
    )
    print(
        f"ITL of {args.streams} running streams: quiet p50 {itl['itl_quiet_p50_ms']:.1f} ms "
        f"p99 {itl['itl_quiet_p99_ms']:.1f} ms; while the schema compiles p50 "
        f"{itl['itl_compile_p50_ms']:.1f} ms p99 {itl['itl_compile_p99_ms']:.1f} ms "
        f"({itl['gaps_during_compile']} gaps)"
    )


if __name__ == "__main__":
    main()
