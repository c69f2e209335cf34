"""Streaming overhead: the three processes against the worker called in-process. Not a test.

For each model it measures, side by side in one run (configurations interleaved in every
repetition, medians reported):

- time per output token (TPOT) of one stream (batch 1): through `radixserve serve` (client
  side: time between the first and the last streamed message over the tokens in between)
  against `services.worker.offline.generate` on a ModelRunner in this process (time between
  the first and the last forward over the decode steps in between);
- throughput (output tokens/s, prefill included) of 64 concurrent streams against
  offline.generate of the same 64 prompts as one batch;
- both again for a server with tracing on (`--otlp-traces-endpoint` at an OTLP/gRPC
  TraceService sink started in this process that only counts spans).

Fixed lengths: ignore_eos, greedy. The radix cache is flushed before each server run, so
no run reuses another's prompt.

One torch thread on both sides by default (--threads): on a small shared CPU, OpenMP's
default of one thread per core stalls at every barrier when another process takes a core.

    .venv/bin/python bench/bench_streaming.py [--random-30m] [--reps 5] [--threads 1]
        [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.server_util when run as `python bench/...`

import grpc  # noqa: E402
import torch  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from seed_experiments import count_parameters, make_random_llama  # noqa: E402

from radixserve.v1 import generation_pb2 as pb  # noqa: E402
from radixserve.v1 import generation_pb2_grpc  # noqa: E402
from services.common.config import WorkerConfig  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.offline import generate  # noqa: E402
from tests.server_util import DEFAULT_MODEL, Server  # noqa: E402

RANDOM_30M = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
POOL_TOKENS = 20000


# ---- the OTLP sink --------------------------------------------------------------------


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that counts the spans it is sent and drops them."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def start_sink() -> tuple[grpc.Server, SpanSink, int]:
    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, sink, port


# ---- in-process worker ----------------------------------------------------------------


class TimedRunner:
    """A ModelRunner whose forward calls are time-stamped (when each one returned)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.stamps: list[float] = []

    def info(self):
        return self.runner.info()

    def forward(self, batch):
        out = self.runner.forward(batch)
        self.stamps.append(time.perf_counter())
        return out


def inproc_tpot(runner: TimedRunner, prompt: list[int], n: int) -> float:
    """Seconds per decode step of one request: first forward (prefill) to last, over n - 1."""
    runner.stamps.clear()
    generate(runner, [prompt], n, stop_at_eos=False)
    return (runner.stamps[-1] - runner.stamps[0]) / (len(runner.stamps) - 1)


def inproc_throughput(runner: TimedRunner, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    outs = generate(runner, prompts, n, stop_at_eos=False)
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


# ---- through the server -----------------------------------------------------------------


def sampling(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def server_tpot(server: Server, prompt: list[int], n: int) -> tuple[float, float]:
    """(client-side seconds per token after the first message,
    the server's decode_time / (n - 1))."""
    server.stub.FlushCache(pb.FlushCacheRequest())
    stamps, counts, last = [], [], None
    req = pb.GenerateRequest(input_ids=pb.InputIds(ids=prompt), sampling=sampling(n))
    for msg in server.stub.Generate(req, timeout=600):
        stamps.append(time.perf_counter())
        counts.append(len(msg.token_ids))
        last = msg
    assert last.completion_tokens == n, last
    return (stamps[-1] - stamps[0]) / (n - counts[0]), last.timings.decode_time / (n - 1)


async def _streams(addr: str, prompts: list[list[int]], n: int) -> tuple[int, float]:
    """(tokens received, the longest total_time the server reported)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(p: list[int]) -> tuple[int, float]:
            got, total = 0, 0.0
            req = pb.GenerateRequest(input_ids=pb.InputIds(ids=p), sampling=sampling(n))
            async for msg in stub.Generate(req, timeout=600):
                got += len(msg.token_ids)
                total = msg.timings.total_time or total
            return got, total

        done = await asyncio.gather(*(one(p) for p in prompts))
        return sum(g for g, _ in done), max(t for _, t in done)


def server_throughput(server: Server, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Output tokens/s of len(prompts) concurrent streams (one asyncio client): by the
    client's wall clock, and over the longest request as the frontend timed it."""
    server.stub.FlushCache(pb.FlushCacheRequest())
    t0 = time.perf_counter()
    tokens, longest = asyncio.run(_streams(server.addr, prompts, n))
    wall = time.perf_counter() - t0
    assert tokens == n * len(prompts), tokens
    return tokens / wall, tokens / longest


# ---- one model ------------------------------------------------------------------------


@dataclass
class ModelResult:
    name: str
    params: int
    tpot: dict[str, list[float]] = field(default_factory=dict)  # seconds
    server_decode: dict[str, list[float]] = field(default_factory=dict)
    tput: dict[str, list[float]] = field(default_factory=dict)  # tokens/s
    server_tput: dict[str, list[float]] = field(default_factory=dict)
    spans: int = 0
    traced_requests: int = 0


def prompts_for(server: Server, k: int) -> list[list[int]]:
    """k prompts of the same length (~16 tokens), each starting differently."""
    base = list(
        server.stub.Tokenize(
            pb.TokenizeRequest(text="Beautiful is better than ugly. Explicit is")
        ).ids
    )
    vocab = server.stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    return [[3 + (i * 7) % (vocab - 3)] + base for i in range(k)]


def bench_model(model: Path, args, sink: SpanSink, sink_port: int) -> ModelResult:
    res = ModelResult(model.name, count_parameters(model))
    flags = ["--max-total-tokens", str(POOL_TOKENS)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    print(
        f"# {model.name}: {res.params:,} parameters; starting servers and the in-process runner",
        flush=True,
    )
    with (
        Server(*flags, model=model, timeout=600, env=env) as plain,
        Server(
            *flags,
            "--otlp-traces-endpoint",
            f"127.0.0.1:{sink_port}",
            model=model,
            timeout=600,
            env=env,
        ) as traced,
    ):
        runner = TimedRunner(
            ModelRunner(
                WorkerConfig(
                    model_path=str(model),
                    device="cpu",
                    max_total_tokens=POOL_TOKENS,
                    max_running_requests=64,
                )
            )
        )
        one = prompts_for(plain, 1)[0]
        many = prompts_for(plain, args.streams)
        servers = {"server": plain, "server + tracing": traced}
        _warm(runner, servers, one)
        spans0 = sink.spans
        for rep in range(args.reps):
            order = ["in-process", *servers]
            order = order if rep % 2 == 0 else order[::-1]  # neither side always goes first
            for name in order:
                if name == "in-process":
                    res.tpot.setdefault(name, []).append(inproc_tpot(runner, one, args.tokens))
                    res.tput.setdefault(name, []).append(
                        inproc_throughput(runner, many, args.stream_tokens)
                    )
                else:
                    client, own = server_tpot(servers[name], one, args.tokens)
                    res.tpot.setdefault(name, []).append(client)
                    res.server_decode.setdefault(name, []).append(own)
                    client_side, server_side = server_throughput(
                        servers[name], many, args.stream_tokens
                    )
                    res.tput.setdefault(name, []).append(client_side)
                    res.server_tput.setdefault(name, []).append(server_side)
            print(
                f"#   rep {rep + 1}/{args.reps}: "
                + "; ".join(
                    f"{k} {1e3 * res.tpot[k][-1]:.2f} ms/tok, {res.tput[k][-1]:.0f} tok/s"
                    for k in res.tpot
                ),
                flush=True,
            )
        time.sleep(1.0)  # the exporters send every 200 ms
        res.spans = sink.spans - spans0
        res.traced_requests = args.reps * (1 + args.streams)
    return res


def _warm(runner: TimedRunner, servers: dict[str, Server], prompt: list[int]) -> None:
    generate(runner, [prompt], 8, stop_at_eos=False)
    for s in servers.values():
        server_tpot(s, prompt, 8)


# ---- report -----------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def table(results: list[ModelResult], args) -> str:
    header = [
        "model (parameters)",
        "measure",
        "in-process worker",
        "server",
        "server + tracing",
        "server vs in-process",
        "target",
    ]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        t = {k: 1e3 * med(v) for k, v in r.tpot.items()}
        q = {k: med(v) for k, v in r.tput.items()}
        d = {k: 1e3 * med(v) for k, v in r.server_decode.items()}
        st = {k: med(v) for k, v in r.server_tput.items()}
        label = f"{r.name} ({r.params / 1e6:.1f} M)"

        def step(tokens_per_s: float) -> float:
            """ms per decode step of all streams at this rate."""
            return 1e3 * args.streams / tokens_per_s

        # in-process (p), server (s), server + tracing (t)
        tp, ts, tt = t["in-process"], t["server"], t["server + tracing"]
        qp, qs, qt = q["in-process"], q["server"], q["server + tracing"]
        ok_t = "met" if ts - tp <= 1.0 else "missed"
        ok_q = "met" if qs / qp >= 0.9 else "missed"
        rows += [
            f"| {label} | batch 1: ms per output token ({args.tokens} tokens) "
            f"| {tp:.2f} | {ts:.2f} | {tt:.2f} "
            f"| +{ts - tp:.2f} ms (tracing +{tt - tp:.2f}) | <= +1 ms: {ok_t} |",
            f"| {label} | batch 1: the server's own decode_time / token "
            f"| - | {d['server']:.2f} | {d['server + tracing']:.2f} | | |",
            f"| {label} | {args.streams} streams x {args.stream_tokens} tokens: tokens/s "
            f"| {qp:.0f} | {qs:.0f} | {qt:.0f} "
            f"| {qs / qp:.2f}x (tracing {qt / qp:.2f}x); "
            f"+{step(qs) - step(qp):.1f} ms per step of {args.streams} | >= 0.9x: {ok_q} |",
            f"| {label} | the same, over the longest request's total_time (frontend's clock) "
            f"| - | {st['server']:.0f} | {st['server + tracing']:.0f} "
            f"| {st['server'] / qp:.2f}x | |",
        ]
    spans = "; ".join(
        f"{r.name}: {r.spans} spans for {r.traced_requests} traced requests" for r in results
    )
    return "\n".join(rows) + f"\n\nSpans received by the sink: {spans}.\n\n" + READING


# What the figures have shown so far (2-core VM); kept with the table so it is read with it.
READING = """Reading it: the scheduler's overlap schedule (on by default) queues decode step N+1
behind step N, so the scheduler's bookkeeping hides behind the forward; before it the 30M
model reached 0.81x-0.98x at 64 streams and +0.65 to +1.43 ms per token at batch 1. With a
model as small as radixserve-zen a whole decode step is ~7-10 ms, and on 2 cores the worker
holds one core while the frontend's gRPC streaming (64 writes per step; a py-spy profile
shows most frontend time in grpc.aio's callbacks, little in detokenizing) and the
benchmark's own client share the other: that core bounds the 64-stream figure, not the
scheduler. A model whose step is real work (30M parameters and up) is served at the
in-process rate.
"""


def section(results: list[ModelResult], args, cmd: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        "## Streaming\n\n"
        "Overhead of serving through the three processes (frontend, scheduler, worker; "
        "gRPC + ZeroMQ) against the worker's ModelRunner called in-process "
        "(`services.worker.offline.generate`), same model, greedy, ignore_eos. Batch 1: "
        "client-side time between the first and the last streamed message over the tokens in "
        "between, against the time between the first (prefill) and the last forward in-process "
        "over the decode steps in between. Throughput: output tokens per second of "
        f"{args.streams} concurrent streams (one asyncio gRPC client) against one in-process "
        "batch of the same prompts, prefill included. Tracing: a second server with "
        "`--otlp-traces-endpoint` at an OTLP/gRPC sink in the benchmark process that only "
        "counts spans. All configurations interleaved in each of "
        f"{args.reps} repetitions in one run; medians. CPU only (torch backend), "
        f"{args.threads or 'default'} torch thread(s) in the worker processes and in-process, "
        "on a 2-core machine shared with other work at the time "
        f"({when}): figures are noisy, ratios more than absolutes.\n\n"
        f"```\n{cmd}\n```\n\n" + table(results, args) + "\n"
    )


def write_section(path: Path, text: str) -> None:
    """Replaces (or appends) the `## Streaming` section of docs/benchmarks.md, nothing else."""
    old = path.read_text() if path.exists() else "# radixserve benchmarks\n\n"
    start = old.find("## Streaming\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + 1)
        new = old[:start] + text + (old[end + 1 :] if end >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument(
        "--random-30m",
        action="store_true",
        help="also a ~30M-parameter random Llama (default model's tokenizer)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of the batch-1 stream")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument(
        "--stream-tokens", type=int, default=64, help="output tokens of each concurrent stream"
    )
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help=(
            "torch/OpenMP threads of the worker processes and of the in-process runner "
            "(0: torch's default)"
        ),
    )
    args = ap.parse_args()
    if args.threads:
        # The same thread count on both sides; one steadies timings on a small shared CPU.
        torch.set_num_threads(args.threads)
    cmd = ".venv/bin/python bench/bench_streaming.py " + " ".join(sys.argv[1:])
    sink_server, sink, sink_port = start_sink()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
            models = [args.model]
            if args.random_30m:
                models.append(
                    make_random_llama(Path(tmp) / "random-llama-30m", args.model, **RANDOM_30M)
                )
            for m in models:
                results.append(bench_model(m, args, sink, sink_port))
    finally:
        sink_server.stop(0)
    text = section(results, args, cmd.strip())
    print(text, flush=True)
    if not args.no_write:
        write_section(args.out, text)
        print(f"# wrote the Streaming section of {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
