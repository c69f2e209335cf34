"""Speculative decoding side by side: speculation off, ngram and suffix, one server each,
on four workloads at batch 1 and batch 16. Prints one markdown table (output tokens/s,
acceptance, tokens per verify step, ratio vs off, the share of draft steps the goodput
gate ran plain) for docs/benchmarks.md.

    .venv/bin/python bench/bench_spec.py [--quick] [--model-path DIR] [--output-len N]
    .venv/bin/python bench/bench_spec.py --servers none,ngram,ngram/always,suffix,suffix/always
    .venv/bin/python bench/bench_spec.py --servers none,none+--cpu-wait=spin,ngram

Batch B runs 4 x B streams (--streams-per-slot), B at a time: when one ends the next starts,
as in a server under steady load, so the batch stays B until the last B streams (with only
B, speculation's requests end at different steps and the batch drains: docs/benchmarks.md).

Workloads (the text is the Zen of Python, read from the `this` module's source):
- code-edit: "rewrite this text" followed by a document, each stream its own shuffle of the
  Zen's lines; the answer repeats much of it (drafts from the request's own prompt: both
  ngram and suffix);
- multi-turn: conversations whose every turn asks for the text again from a later line,
  so each answer repeats the earlier answer in the history (ngram and suffix) and other
  conversations' answers (suffix's index); answers end at the model's EOS;
- agentic: an agent transcript of tool calls; each step the model writes the next call,
  whose arguments repeat an earlier call's, ending at the stop string "</tool_call>" (the
  transcript grows by its own output);
- random: a random prompt, sampled at temperature 3 (seeded), so the output repeats
  nothing: the adaptive length must switch speculation off, costing (almost) nothing.
  (The shipped model has memorised its text so firmly that at temperature 1.5 it still
  recites: 40-60 % of drafts accepted in a trial; at 3, one in ten, and that run's drafts
  stopped after a few steps.)
Greedy, and seeded sampling, are token-exact with speculation off, so every algorithm
produces the same tokens (the table's last column checks it) and tokens/s compare alike.

Model. The default is the shipped radixserve-zen, and deliberately: it is the one model in
the repo whose outputs are text, not noise, and having memorised the Zen it copies what it
is shown, which is what these workloads need (a random-weight model never repeats its
prompt, so every draft would fail and the figures would only show the off switch). Its
limit is 512 positions: the code-edit prompt is the whole Zen once (~200 tokens), not the
~1k tokens of a real edit; pass --model-path (any HF Llama/Qwen folder, e.g. a 0.5B
instruct model) and --prompt-tokens 1024 for that shape. The figures are CPU-bound and
noisy on a shared machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import codecs
import importlib.util
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.* when run as `python bench/...`

from radixserve.v1 import generation_pb2 as pb  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH  # noqa: E402
from tests.server_util import Server, scrape_metrics  # noqa: E402

ALGORITHMS = ("none", "ngram", "suffix")
WORKLOADS = ("code-edit", "multi-turn", "agentic", "random")
P = "radixserve:"
PAUSE_S = 1.0  # before each measurement: the server before it goes idle


def zen() -> str:
    """The Zen of Python, from the `this` module's source (importing it prints it)."""
    spec = importlib.util.find_spec("this")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    m = re.search(r's = """(.*?)"""', source, re.S)
    assert m is not None
    return codecs.decode(m.group(1), "rot13").strip()


@dataclass
class Call:
    """One Generate: a prompt and how to sample it."""

    text: str
    sampling: pb.SamplingParams

    def request(self) -> dict:
        return {"text": self.text, "sampling": self.sampling}


@dataclass
class Stream:
    """Calls run in order (a conversation, an agent); ``follow`` builds the next call from
    the previous one, its answer and the number of calls made (None: the stream is done)."""

    first: Call
    follow: Callable[[Call, str, int], Call | None] | None = None
    outputs: list[list[int]] = field(default_factory=list)


def greedy(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def document(tokens: int, tokenizer, seed: int = 7) -> str:
    """The Zen, repeated and line-shuffled (seeded) to about ``tokens`` tokens."""
    lines, rng, out = zen().splitlines(), random.Random(seed), []
    while len(tokenizer.encode("\n".join(out))) < tokens:
        out.extend(rng.sample(lines, len(lines)))
    while len(out) > 1 and len(tokenizer.encode("\n".join(out))) > tokens:
        out.pop()
    return "\n".join(out)


def code_edit(i: int, args, tok) -> Stream:
    """Each stream its own document (its own shuffle): no two streams ask the same edit."""
    doc = document(args.prompt_tokens, tok, seed=7 + i)
    lines = doc.splitlines()
    start = i % max(1, len(lines) - 1)
    text = f"Rewrite this text, changing nothing:\n{doc}\n\nRewritten:\n{lines[start]}\n"
    return Stream(Call(text, greedy(args.output_len)))


def multi_turn(i: int, args, tok) -> Stream:
    """A conversation as a plain transcript: each turn asks for the Zen again from a later
    line, so each answer repeats most of the answer before it, and conversations start at
    different lines (real ones are not in lockstep). A plain transcript, not the chat
    template: the shipped model learnt single-turn chat only, and answers a second chat turn
    with about ten tokens of noise."""
    lines = zen().splitlines()
    first = i % max(1, len(lines) - 2 * args.turns)
    sp = pb.SamplingParams(max_tokens=args.turn_len, temperature=0.0)  # to its EOS

    def ask(line: int) -> str:
        line = min(line, len(lines) - 1)  # many --turns: the later ones ask for the last line
        return f"Recite the Zen of Python from line {line + 1}.\n{lines[line]}\n"

    def follow(prev: Call, answer: str, n: int) -> Call | None:
        if n >= args.turns:
            return None
        return Call(f"{prev.text}{answer}\n\n{ask(first + 2 * n)}", sp)

    return Stream(Call(ask(first), sp), follow)


def agentic(i: int, args, tok) -> Stream:
    lines = zen().splitlines()
    rng = random.Random(i)

    def call(k: int) -> str:
        text = " ".join(lines[(k + j) % len(lines)] for j in range(3))
        return f'{{"name": "write_file", "arguments": {{"path": "zen_{k}.txt", "text": "{text}"}}}}'

    transcript = "".join(f"<tool_call>{call(rng.randrange(6))}</tool_call>\nok\n" for _ in range(3))
    steps = args.agent_steps
    sp = pb.SamplingParams(max_tokens=args.step_len, temperature=0.0, stop=["</tool_call>"])

    def follow(prev: Call, answer: str, n: int) -> Call | None:
        if n >= steps:
            return None
        return Call(f"{prev.text}{answer}</tool_call>\nok\n<tool_call>", sp)

    return Stream(Call(transcript + "<tool_call>", sp), follow)


def random_text(i: int, args, tok) -> Stream:
    rng = random.Random(1000 + i)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(40)]
    t = args.random_temperature
    sp = pb.SamplingParams(max_tokens=args.output_len, temperature=t, seed=i, ignore_eos=True)
    return Stream(Call(" ".join(words), sp))


MAKERS = {
    "code-edit": code_edit,
    "multi-turn": multi_turn,
    "agentic": agentic,
    "random": random_text,
}


def fit(call: Call, tok, context: int) -> Call | None:
    """The call with max_tokens capped to what the context leaves after its prompt (the
    server refuses more); None when under 8 tokens are left (the stream ends)."""
    room = context - len(tok.encode(call.text)) - 4  # a margin for the server's own rendering
    if room < 8:
        return None
    sp = pb.SamplingParams()
    sp.CopyFrom(call.sampling)
    sp.max_tokens = min(sp.max_tokens, room)
    return Call(call.text, sp)


def run_stream(server: Server, s: Stream, tok, context: int) -> int:
    """Runs the stream's calls in order; returns the output tokens."""
    call: Call | None = fit(s.first, tok, context)
    n = total = 0
    while call is not None:
        ids, text, _ = server.generate(timeout=600, **call.request())
        s.outputs.append(ids)
        total += len(ids)
        n += 1
        nxt = s.follow(call, text, n) if s.follow is not None else None
        call = fit(nxt, tok, context) if nxt is not None else None
    return total


def counters(server: Server) -> dict[str, float]:
    m = scrape_metrics(server.sched_metrics)
    names = ("draft_tokens", "accepted_tokens", "drafts", "verify_steps", "declined_steps")
    return {n: m.get(f"{P}spec_decode_num_{n}_total", 0.0) for n in names}


@dataclass
class Row:
    tok_s: float
    accept: float  # accepted / drafted tokens
    per_step: float  # tokens per verify step: 1 + accepted / drafts
    outputs: list[list[list[int]]]
    declined: float = 0.0  # share of decode steps due to draft that the gate ran plain


def measure(server: Server, workload: str, batch: int, args, tok) -> Row:
    """``batch`` streams at a time, each call of a stream after the one before; the next
    stream starts when one ends. Cold cache and index."""
    assert server.stub.FlushCache(pb.FlushCacheRequest()).flushed
    streams = [MAKERS[workload](i, args, tok) for i in range(args.streams(batch))]
    before = counters(server)
    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(lambda s: run_stream(server, s, tok, args.context), streams))
    wall = time.perf_counter() - start
    after = counters(server)
    d = {k: after[k] - before[k] for k in after}
    return Row(
        tokens / wall,
        d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
        1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 1.0,
        [s.outputs for s in streams],
        d["declined_steps"] / max(1.0, d["declined_steps"] + d["verify_steps"]),
    )


def median_row(rows: list[Row]) -> Row:
    """Medians of the repeats; the outputs of the first (every repeat's are the same
    tokens: greedy, or sampled with seeds)."""
    return Row(
        statistics.median(r.tok_s for r in rows),
        statistics.median(r.accept for r in rows),
        statistics.median(r.per_step for r in rows),
        rows[0].outputs,
        statistics.median(r.declined for r in rows),
    )


def warm_up(server: Server, args, tok) -> None:
    """One code-edit call (a long prefill, decode and verify steps) before anything is
    timed: the CPU kernels are built and the allocator warmed on first use."""
    run_stream(server, code_edit(0, args, tok), tok, args.context)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    p.add_argument("--quick", action="store_true", help="fewer streams and turns")
    p.add_argument(
        "--streams-per-slot", type=int, default=4,
        help="batch B runs B x this many streams, B at a time (a finished stream's place "
        "goes to the next, so the batch stays B until the last B)",
    )  # fmt: skip
    p.add_argument("--batches", default="1,16", help="concurrent streams, comma separated")
    p.add_argument("--output-len", type=int, default=160, help="tokens per single-call answer")
    p.add_argument("--turn-len", type=int, default=256, help="max tokens of a chat answer")
    p.add_argument("--turns", type=int, default=2, help="turns per conversation (512 positions)")
    p.add_argument("--step-len", type=int, default=96, help="max tokens of an agent step")
    p.add_argument("--agent-steps", type=int, default=4, help="steps per agent")
    p.add_argument("--prompt-tokens", type=int, default=200, help="code-edit document length")
    p.add_argument("--draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens")
    p.add_argument("--random-temperature", type=float, default=3.0, help="random's sampling")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--context-length", type=int, default=0, help="0: the model's")
    p.add_argument("--flags", default="", help="more server flags, space separated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement (median)")
    p.add_argument(
        "--servers",
        default=",".join(ALGORITHMS),
        help="one server each, comma separated: ALGORITHM or ALGORITHM/GATE "
        "(--speculative-gate, e.g. ngram/always), then +FLAG=VALUE for flags of that "
        "server alone (e.g. none+--cpu-wait=spin); the first is the baseline",
    )
    args = p.parse_args()
    if args.quick:
        args.agent_steps, args.output_len = 2, 64
    per_slot = min(2, args.streams_per_slot) if args.quick else args.streams_per_slot
    args.streams = lambda batch: batch * per_slot
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path)
    args.context = (
        args.context_length or AutoConfig.from_pretrained(args.model_path).max_position_embeddings
    )
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")
    results: dict[tuple[str, str, int], Row] = {}
    ratios: dict[tuple[str, str, int], float] = {}
    if args.context_length:
        args.flags += f" --context-length {args.context_length}"

    variants = args.servers.split(",")

    def flags(variant: str) -> list[str]:
        base, *own = variant.split("+")
        algorithm, _, gate = base.partition("/")
        return ["--speculative-algorithm", algorithm,
                "--speculative-num-draft-tokens", str(args.draft_tokens),
                "--max-running-requests", str(max(batches)),
                *(["--speculative-gate", gate] if gate else []), *args.flags.split(),
                *own]  # fmt: skip

    # All servers up at once; each measurement runs on every one back to back, the order
    # rotated every repeat so that each server takes each place alike (a drift in the
    # machine's speed hits all alike), after a pause: a server that just finished does its
    # idle work (the slot check's tree recount), which would land on the next one's time.
    with ExitStack() as stack:
        servers = {
            v: stack.enter_context(Server(*flags(v), model=args.model_path, metrics=True,
                                          timeout=600))
            for v in variants
        }  # fmt: skip
        for server in servers.values():
            warm_up(server, args, tok)
        for w in workloads:
            for b in batches:
                runs: dict[str, list[Row]] = {v: [] for v in variants}
                for rep in range(args.repeats):
                    for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                        time.sleep(PAUSE_S)
                        runs[v].append(measure(servers[v], w, b, args, tok))
                for v in variants:
                    r = results[v, w, b] = median_row(runs[v])
                    # Each repeat's servers ran back to back: their ratio is paired, and
                    # the median of those holds less of the machine's drift.
                    ratios[v, w, b] = statistics.median(
                        x.tok_s / y.tok_s for x, y in zip(runs[v], runs[variants[0]], strict=True)
                    )
                    print(f"{v} {w} batch {b}: {r.tok_s:.1f} tok/s (median of "
                          f"{args.repeats}), {ratios[v, w, b]:.2f}x, accept {r.accept:.2f}, "
                          f"{r.per_step:.2f} tokens/step, declined {r.declined:.2f}",
                          file=sys.stderr, flush=True)  # fmt: skip
    print(table(variants, workloads, batches, results, ratios, args.model_path, args.draft_tokens))
    return 0


def table(
    variants: list[str],
    workloads: list[str],
    batches: list[int],
    results: dict[tuple[str, str, int], Row],
    ratios: dict[tuple[str, str, int], float],
    model_path: str,
    k: int,
) -> str:
    """Markdown: the first variant's tok/s, then each other's tok/s, ratio to the first (the
    median of the repeats' paired ratios), acceptance (tokens per verify step) and the share
    of draft steps the gate ran plain."""
    base, others = variants[0], variants[1:]
    head = f"| workload | batch | {base} tok/s |" + "".join(
        f" {v} tok/s | {v} vs {base} | {v} accept (tok/step) | {v} declined |" for v in others
    )
    lines = [f"\nmodel {Path(model_path).name}, k = {k}\n", head + " same tokens |"]
    lines.append("|---|---:|---:|" + "---:|" * 4 * len(others) + "---|")
    for w in workloads:
        for b in batches:
            first = results[base, w, b]
            row = f"| {w} | {b} | {first.tok_s:.1f} |"
            for v in others:
                r = results[v, w, b]
                row += (f" {r.tok_s:.1f} | {ratios[v, w, b]:.2f}x | {r.accept:.2f} "
                        f"({r.per_step:.2f}) | {r.declined:.2f} |")  # fmt: skip
            same = all(results[v, w, b].outputs == first.outputs for v in others)
            lines.append(row + (" yes |" if same else " NO |"))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
