"""Serving benchmark: drive any OpenAI-compatible server with a workload, report what users feel.

Like `sglang.bench_serving` and `vllm bench serve`, it judges a server from outside, so it
measures radixserve and its peers alike. Every request is a streaming /v1/completions call
with usage included, so

- TTFT is the time to the first streamed token, ITL the gaps between streamed chunks (a
  chunk may carry several tokens; one with no text is no arrival: the user saw nothing);
- token counts come from the server's usage (else the client's tokenizer or a word count);
- the cache hit rate is sum(cached_tokens) / sum(prompt_tokens) over the requests that
  report usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details).

A failed request (HTTP error, error event, dropped connection) is counted and its message
kept; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from services.loadgen import workloads
from services.loadgen.workloads import SEP, Session, TextMaker

if TYPE_CHECKING:
    import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:30080"


def _httpx() -> ModuleType:
    """httpx, imported when a benchmark runs: the CLI builds this parser for every
    subcommand, and a server's image need not carry a client library."""
    try:
        import httpx
    except ImportError as e:
        raise SystemExit("radixserve bench needs httpx: pip install 'httpx>=0.27,<1'") from e
    return httpx


# ---- arguments ----------------------------------------------------------------------


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `radixserve bench` (names follow vLLM's and SGLang's bench clients)."""
    a = parser.add_argument
    a(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help="server root (a trailing /v1 is accepted); several, comma separated, share the "
        "sessions round robin (one fleet behind several frontends)",
    )
    a("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    a(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder for exact prompt lengths "
        "(default: --model when it is a local folder, else ~1 token per word)",
    )
    a("--workload", choices=sorted(workloads.WORKLOADS), default="random")
    a(
        "--num-prompts",
        type=int,
        default=50,
        help="requests (multi-turn: conversations; prefill-stall: decode streams)",
    )
    a("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    a(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    a(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens (shared-prefix: the distinct tail; multi-turn: per message)",
    )
    a("--output-len", type=int, default=128, help="max_tokens per request")
    a("--prefix-len", type=int, default=1000, help="shared-prefix: tokens of the shared prefix")
    a("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [L * ratio, L]")
    a("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    a(
        "--system-prompt-len",
        type=int,
        default=0,
        help="multi-turn: tokens of one system prompt every conversation starts with (0: none)",
    )
    _add_gsp_args(parser)
    _add_stall_args(parser)
    _add_request_args(parser)


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """Seeds, ordering and what every request body carries; where the figures go."""
    a = parser.add_argument
    a(
        "--seed",
        type=int,
        default=0,
        help="seed of the random texts: a new seed gives texts no server has cached",
    )
    a("--shuffle", action="store_true", help="send the workload's requests in random order")
    a(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true so every request decodes max_tokens",
    )
    a("--temperature", type=float, default=0.0)
    a(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request body",
    )
    a("--timeout", type=float, default=600.0, help="seconds per request")
    a("--output-json", default=None, help="write every figure to this file")
    a("--disable-tqdm", action="store_true")


def _add_gsp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("generated-shared-prefix (SGLang's names)")
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument(
        "--gsp-interleave",
        action="store_true",
        help="send the groups' questions round robin instead of group after group",
    )


def _add_stall_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "prefill-stall: long prompts arriving while --num-prompts streams decode"
    )
    g.add_argument("--stall-prompts", type=int, default=8)
    g.add_argument("--stall-input-len", type=int, default=1000)
    g.add_argument("--stall-output-len", type=int, default=1)
    g.add_argument(
        "--stall-delay",
        type=float,
        default=0.0,
        help="seconds after every decode stream has its first token",
    )


# ---- one request --------------------------------------------------------------------


@dataclass
class Result:
    """What one request measured; times in seconds from just before it was sent."""

    group: str = "main"
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    prompt: str = field(default="", repr=False)


class ServerError(Exception):
    """An error event inside a 200 stream."""


class StreamReader:
    """Folds the server-sent events of one /v1/completions stream into a Result."""

    def __init__(
        self, res: Result, start: float, on_first: Callable[[], None] | None = None
    ) -> None:
        self.res, self.start, self.on_first = res, start, on_first
        self.last: float | None = None
        self.parts: list[str] = []
        self.finished = False

    def line(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.finished = True
        elif data:
            self.event(json.loads(data), now)

    def event(self, ev: dict[str, Any], now: float) -> None:
        if "error" in ev:
            err = ev["error"]
            raise ServerError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if ev.get("usage"):
            self.usage(ev["usage"])
        for choice in ev.get("choices") or []:
            self.choice(choice, now)

    def choice(self, choice: dict[str, Any], now: float) -> None:
        text = choice.get("text") or ""
        if choice.get("finish_reason"):
            self.finished = True
        # a chunk with no text is no arrival, unless a bare finish is all the request gets
        if text or (self.last is None and self.finished):
            self.token(text, now)

    def token(self, text: str, now: float) -> None:
        if self.last is None:
            self.res.ttft = now - self.start
            if self.on_first is not None:
                self.on_first()
        else:
            self.res.itl.append(now - self.last)
        self.last = now
        self.parts.append(text)

    def usage(self, u: dict[str, Any]) -> None:
        self.res.usage = True
        self.res.prompt_tokens = int(u.get("prompt_tokens") or 0)
        self.res.completion_tokens = int(u.get("completion_tokens") or 0)
        details = u.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.res.cached_tokens = int(details["cached_tokens"])

    def close(self) -> None:
        self.res.text = "".join(self.parts)
        if not self.finished:
            raise ServerError("stream ended before the request finished")
        if self.last is None:
            raise ServerError("stream carried no token")
        if not self.res.usage:
            self.res.completion_tokens = len(self.parts)
        self.res.ok = True


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        msg = (
            err.get("message", body.decode(errors="replace")) if isinstance(err, dict) else str(err)
        )
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {msg[:300]}"


async def send(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    group: str,
    on_first: Callable[[], None] | None = None,
) -> Result:
    """One streaming completion, timed; failures land in Result.error, never raise."""
    httpx = _httpx()
    res = Result(group, prompt=body["prompt"])
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = _error_text(resp.status_code, await resp.aread())
            else:
                reader = StreamReader(res, start, on_first)
                async for line in resp.aiter_lines():
                    reader.line(line, time.perf_counter())
                reader.close()
    except ServerError as e:
        res.error = f"server error: {e}"
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


# ---- a workload ---------------------------------------------------------------------


class Gates:
    """Per group, an event set once every session of the group has its first token (or ended)."""

    def __init__(self, sessions: list[Session]) -> None:
        self.left = Counter(s.group for s in sessions)
        self.events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def arrive(self, group: str) -> None:
        self.left[group] -= 1
        if self.left[group] == 0:
            self.events[group].set()

    async def wait(self, group: str) -> None:
        if self.left[group] > 0:
            await self.events[group].wait()

    def once(self, group: str) -> Callable[[], None]:
        done = False

        def arrive() -> None:
            nonlocal done
            if not done:
                done = True
                self.arrive(group)

        return arrive


class Runner:
    """Sends a workload's sessions with a concurrency cap and arrival times; keeps results."""

    def __init__(
        self,
        clients: list[httpx.AsyncClient],
        ns: argparse.Namespace,
        model: str,
        sessions: list[Session],
    ) -> None:
        # One client per --base-url; session i talks to clients[i % n] (several frontends).
        self.clients, self.ns, self.model = clients, ns, model
        self.sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
        self.gates = Gates(sessions)
        self.results: list[Result] = []
        total = sum(len(s.turns) for s in sessions)
        self.bar = tqdm(total=total, disable=ns.disable_tqdm, desc=ns.workload, leave=False)

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.ns.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ns.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **(self.ns.extra_body or {})}

    async def request(
        self,
        client: httpx.AsyncClient,
        prompt: str,
        max_tokens: int,
        group: str,
        on_first: Callable[[], None],
    ) -> Result:
        if self.sem is None:
            res = await send(client, self.body(prompt, max_tokens), group, on_first)
        else:
            async with self.sem:
                res = await send(client, self.body(prompt, max_tokens), group, on_first)
        self.results.append(res)
        self.bar.update(1)
        return res

    async def session(self, s: Session, at: float, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        if s.after is not None:
            await self.gates.wait(s.after)
            await asyncio.sleep(s.delay)
        arrived = self.gates.once(s.group)
        try:
            await self.turns(s, arrived, client)
        finally:
            arrived()

    async def turns(
        self, s: Session, arrived: Callable[[], None], client: httpx.AsyncClient
    ) -> None:
        prompt = ""
        for i, turn in enumerate(s.turns):
            prompt = turn.message if i == 0 else prompt + SEP + turn.message
            res = await self.request(client, prompt, turn.max_tokens, s.group, arrived)
            if not res.ok:
                self.skip(s, len(s.turns) - i - 1)
                return
            prompt += res.text

    def skip(self, s: Session, n: int) -> None:
        for _ in range(n):
            self.results.append(
                Result(s.group, error="skipped: an earlier turn of its conversation failed")
            )
            self.bar.update(1)

    async def run(self, sessions: list[Session]) -> float:
        """Runs every session; returns the wall time in seconds."""
        t0 = time.perf_counter()
        arrivals = arrival_offsets(len(sessions), self.ns.request_rate, self.ns.seed)
        n = len(self.clients)
        await asyncio.gather(
            *(
                self.session(s, t0 + off, self.clients[i % n])
                for i, (s, off) in enumerate(zip(sessions, arrivals, strict=True))
            )
        )
        self.bar.close()
        return time.perf_counter() - t0


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each session arrives: all at 0, or a Poisson process."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng, t, out = random.Random(seed + 2), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- figures ------------------------------------------------------------------------


def distribution_ms(xs: list[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 / max in milliseconds (None when there is no sample)."""
    if not xs:
        return {k: None for k in ("mean", "p50", "p90", "p99", "max")}
    a = np.asarray(xs, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def figures(results: list[Result], wall: float) -> dict[str, Any]:
    """Counts, throughputs, latency distributions and the cache hit rate of some results."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    reported_prompt = sum(r.prompt_tokens for r in reported)
    wall = max(wall, 1e-9)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "input_tokens": prompt,
        "output_tokens": output,
        "request_throughput": len(ok) / wall,
        "input_throughput": prompt / wall,
        "output_throughput": output / wall,
        "total_token_throughput": (prompt + output) / wall,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl]),
        "tpot_ms": distribution_ms(
            [
                (r.latency - r.ttft) / (r.completion_tokens - 1)
                for r in ok
                if r.completion_tokens > 1
            ]
        ),
        "e2e_latency_ms": distribution_ms([r.latency for r in ok]),
        "cached_tokens": cached if reported else None,
        "cache_hit_rate": cached / reported_prompt if reported and reported_prompt else None,
    }


def error_counts(results: list[Result], top: int = 10) -> dict[str, int]:
    return dict(Counter(r.error for r in results if not r.ok).most_common(top))


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    """Figures of the whole run, plus per group when the workload has several."""
    out = {"wall_s": wall, **figures(results, wall), "error_messages": error_counts(results)}
    groups = sorted({r.group for r in results})
    if len(groups) > 1:
        out["groups"] = {g: figures([r for r in results if r.group == g], wall) for g in groups}
    return out


# ---- the run ------------------------------------------------------------------------


def root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def discover_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def load_tokenizer(ns: argparse.Namespace) -> Any | None:
    path = ns.tokenizer or (ns.model if ns.model and Path(ns.model).is_dir() else None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def fill_prompt_counts(results: list[Result], mk: TextMaker) -> None:
    """Prompt tokens for requests whose server reported no usage: counted here, after the run."""
    for r in results:
        if r.ok and not r.usage:
            r.prompt_tokens = mk.count(r.prompt)


async def run_sessions(
    ns: argparse.Namespace, sessions: list[Session], tokenizer: Any | None
) -> dict[str, Any]:
    n = ns.max_concurrency or max(1, sum(len(s.turns) for s in sessions))
    httpx = _httpx()
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(ns.timeout, connect=30.0)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=root_url(url), timeout=timeout, limits=limits)
            )
            for url in ns.base_url.split(",")
        ]
        model = ns.model or await discover_model(clients[0])
        runner = Runner(clients, ns, model, sessions)
        wall = await runner.run(sessions)
    fill_prompt_counts(runner.results, TextMaker(random.Random(0), tokenizer))
    report = summarize(runner.results, wall)
    return {
        "model": model,
        "base_url": ns.base_url,
        "workload": ns.workload,
        "config": config_of(ns),
        **report,
    }


def config_of(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and math.isinf(v) else v)
        for k, v in vars(ns).items()
        if isinstance(v, (int, float, str, bool, type(None), dict)) and k != "func"
    }


def benchmark(ns: argparse.Namespace) -> dict[str, Any]:
    """Builds the workload from ns, runs it against ns.base_url, returns the report."""
    tokenizer = load_tokenizer(ns)
    sessions = workloads.build(ns, tokenizer)
    return asyncio.run(run_sessions(ns, sessions, tokenizer))


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"{' Serving benchmark: ' + rep['workload'] + ' ':=^60}",
        f"{'model':<40}{rep['model']}",
        f"{'server':<40}{rep['base_url']}",
    ]
    lines += _format_figures(rep, rep["wall_s"])
    for name, g in rep.get("groups", {}).items():
        lines += [f"{' group ' + name + ' ':-^60}", *_format_figures(g, None)]
    for msg, n in rep["error_messages"].items():
        lines.append(f"error x{n}: {msg}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _format_figures(f: dict[str, Any], wall: float | None) -> list[str]:
    rows = [("requests completed / errors", f"{f['completed']} / {f['errors']}")]
    if wall is not None:
        rows.append(("wall time (s)", _fmt(wall, 3)))
    rows += [
        ("input / output tokens", f"{f['input_tokens']:,} / {f['output_tokens']:,}"),
        ("request throughput (req/s)", _fmt(f["request_throughput"])),
        (
            "input / output throughput (tok/s)",
            f"{_fmt(f['input_throughput'], 1)} / {_fmt(f['output_throughput'], 1)}",
        ),
        ("cache hit rate", _fmt(f["cache_hit_rate"], 3)),
    ]
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("itl_ms", "ITL"),
        ("tpot_ms", "TPOT"),
        ("e2e_latency_ms", "E2E latency"),
    ):
        d = f[key]
        rows.append(
            (f"{label} ms p50 / p90 / p99", " / ".join(_fmt(d[p]) for p in ("p50", "p90", "p99")))
        )
    return [f"{k:<40}{v}" for k, v in rows]


def run_bench(ns: argparse.Namespace) -> int:
    """`radixserve bench`: runs, prints the report, writes --output-json; 1 if nothing completed."""
    httpx = _httpx()
    try:
        rep = benchmark(ns)
    except httpx.HTTPError as e:
        print(f"cannot reach {ns.base_url}: {type(e).__name__}: {e}")
        return 2
    print(format_report(rep))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(rep, indent=2) + "\n")
    return 0 if rep["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="radixserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
