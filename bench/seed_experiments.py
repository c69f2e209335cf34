"""The seed experiments (shared/SEED-EXPERIMENTS.md) at full size, against real servers: not a test.

Starts `radixserve serve` (tests/server_util.Server) at page size 1 and at page size 16,
runs the five experiments and the two workloads of the second write-up (multi-turn chat,
customer service), prints every figure and writes docs/seed-experiments.md with one table
per experiment beside the published numbers, the relations checked (PASS/FAIL) and PNG
plots in docs/img/.

Experiment 5 needs a ~1,000-token prefix; when the default model's context is shorter,
a random-weight Llama with a longer context and the default model's tokenizer is built
in a temporary folder for it (said so in the document).

    .venv/bin/python bench/seed_experiments.py [--quick] [--out docs/seed-experiments.md]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.server_util when run as `python bench/...`


from radixserve.v1 import generation_pb2 as pb  # noqa: E402
from tests.server_util import (  # noqa: E402
    DEFAULT_MODEL,
    BackgroundStream,
    Server,
    common_prefix,
    greedy,
    scrape_metrics,
)

# Published figures (SGLang, L40S, Qwen2.5-7B-Instruct-AWQ), from SEED-EXPERIMENTS.md.
PUBLISHED_5 = {"shared_hit": 0.9587, "shared_s": 3.8, "distinct_hit": 0.0026, "distinct_s": 19.5}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


# ---- talking to a server -----------------------------------------------------------

common = common_prefix


class Client:
    """One server's public gRPC API plus its scheduler's /metrics (when enabled)."""

    def __init__(self, server: Server, metrics_port: int | None = None):
        self.server = server
        self.metrics_port = metrics_port
        self.info = server.stub.GetModelInfo(pb.GetModelInfoRequest())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()

    def ids(
        self, text: str | None = None, messages: list[tuple[str, str]] | None = None
    ) -> list[int]:
        if messages is not None:
            req = pb.TokenizeRequest(messages=_chat(messages))
        else:
            req = pb.TokenizeRequest(text=text)
        return list(self.server.stub.Tokenize(req).ids)

    def run(
        self, max_tokens: int = 1, ignore_eos: bool = False, **kw
    ) -> tuple[list[int], str, pb.GenerateResponse]:
        """(output ids, text, last message) of one greedy Generate."""
        return self.server.generate(
            sampling=greedy(max_tokens, ignore_eos=ignore_eos), timeout=600, **kw
        )

    def run_ids(
        self, ids: list[int], max_tokens: int = 1, ignore_eos: bool = False
    ) -> tuple[list[int], pb.GenerateResponse]:
        out, _, last = self.run(max_tokens, ignore_eos, input_ids=pb.InputIds(ids=ids))
        return out, last

    def flush(self) -> pb.FlushCacheResponse:
        return self.server.stub.FlushCache(pb.FlushCacheRequest())

    def metrics(self) -> dict[str, float]:
        """The scheduler's samples by name (labels summed away; one engine, one model)."""
        return scrape_metrics(self.metrics_port)


def _chat(messages: list[tuple[str, str]]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


def start_server(
    page_size: int,
    model: Path,
    max_total_tokens: int,
    metrics: bool,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
) -> Client:
    flags = ["--page-size", str(page_size), "--max-total-tokens", str(max_total_tokens), *extra]
    if metrics:
        flags += ["--enable-mfu-metrics"]
    t0 = time.monotonic()
    server = Server(*flags, model=model, timeout=600, env=env, metrics=metrics)
    client = Client(server, server.sched_metrics if metrics else None)
    print(
        f"# server up in {time.monotonic() - t0:.0f} s: {model.name}, page size {page_size}, "
        f"max_model_len {client.info.max_model_len}, {client.info.max_total_num_tokens} KV slots",
        flush=True,
    )
    client.run(text="warm up", max_tokens=2)  # first forward pays one-off costs
    return client


# ---- results -----------------------------------------------------------------------


@dataclass
class Section:
    """One experiment's output: prose, tables (markdown lines), relations, images."""

    title: str
    intro: str = ""
    tables: list[list[str]] = field(default_factory=list)
    relations: list[tuple[str, str, bool]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    claims: bool = False  # relations test a write-up's claim, not radixserve's promise

    def check(self, relation: str, measured: str, ok: bool) -> None:
        self.relations.append((relation, measured, bool(ok)))

    def table(self, header: list[str], rows: list[list]) -> None:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.tables.append(lines)

    def markdown(self) -> str:
        out = [f"## {self.title}", ""]
        if self.intro:
            out += [self.intro, ""]
        for t in self.tables:
            out += t + [""]
        if self.relations:
            out += ["| relation | measured | result |", "|---|---|---|"]
            out += [f"| {r} | {m} | {'PASS' if ok else 'FAIL'} |" for r, m, ok in self.relations]
            out.append("")
        for img in self.images:
            out += [f"![{self.title}]({img})", ""]
        out += [f"{n}\n" for n in self.notes]
        return "\n".join(out)


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


# ---- experiment 1 ------------------------------------------------------------------


def exp1_branches(c: Client) -> Section:
    s = Section(
        "1. The tree grows branches",
        "A, B, C sent in that order, greedy, max_tokens 1, page size 1.",
    )
    assert c.flush().flushed
    P = " Zephyr audit note zf732150a: the operator shall keep every record."
    A = P + " Question one: how long is the period?"
    B = P + " Request two: who may open the archive?"
    C = A + " Answer in one word."
    a, b, cc = (c.ids(x) for x in (A, B, C))
    hits = [c.run(text=x)[2].cached_tokens for x in (A, B, C)]
    s.table(
        [
            "request",
            "prompt tokens",
            "cached (radixserve)",
            "common prefix with A",
            "published: prompt / hit",
        ],
        [
            ["(P alone, not sent)", len(c.ids(P)), "-", common(a, c.ids(P)), "21 / -"],
            ["A", len(a), hits[0], "-", "30 / 0"],
            ["B", len(b), hits[1], common(a, b), "? / 21 (= P)"],
            ["C", len(cc), hits[2], common(a, cc), "? / 30 (= all of A)"],
        ],
    )
    s.check("cached(A) == 0 (fresh tree)", str(hits[0]), hits[0] == 0)
    s.check("cached(B) == common(A, B)", f"{hits[1]} vs {common(a, b)}", hits[1] == common(a, b))
    s.check("cached(C) == common(A, C)", f"{hits[2]} vs {common(a, cc)}", hits[2] == common(a, cc))
    s.check("cached(C) > cached(B)", f"{hits[2]} > {hits[1]}", hits[2] > hits[1])
    return s


# ---- experiment 2 ------------------------------------------------------------------


def pair(c: Client, n: int, marker: str) -> tuple[list[int], list[int]]:
    """Two prompts sharing marker + n repeats of a word, differing only in the last token."""
    first = c.ids(marker + " archive" * n + " end")
    other = next(t for t in c.ids(" start finish go") if t != first[-1])
    return first, first[:-1] + [other]


def exp2_rows(c: Client, ns: list[int]) -> list[tuple[int, int, int, int]]:
    """(N, prompt, shared, hit) per N on one server."""
    page = c.info.page_size
    rows = []
    for n in ns:
        first, second = pair(c, n, f"Marker {n}-{page} q{n * 7 + page}:")
        if len(first) + 1 > c.info.max_model_len:
            continue  # does not fit the context with max_tokens 1
        c.run_ids(first)
        hit = c.run_ids(second)[1].cached_tokens
        rows.append((n, len(second), common(first, second), hit))
    return rows


def exp2_section(r1: list, r16: list, img_dir: Path) -> Section:
    s = Section(
        "2. Any shared length is reused (page size 1), unlike full-block hashing",
        "Each pair shares a marker plus N repeats of a word and differs in its last token. "
        "`hit` is cached(second); page 16 is expected to give 16 x floor(shared / 16), "
        "what vLLM-style hash-of-full-blocks caches give.",
    )
    rows = []
    by16 = {r[0]: r for r in r16}
    for n, plen, sh, h1 in r1:
        _, _, sh16, h16 = by16.get(n, (n, "-", "-", "-"))
        want16 = 16 * (sh16 // 16) if n in by16 else "-"
        rows.append(
            [n, plen, sh, h1, plen - 1, sh16, h16, want16, sh16 - h16 if n in by16 else "-"]
        )
    s.table(
        [
            "N",
            "prompt",
            "shared",
            "hit p1",
            "want p1 (prompt-1)",
            "shared p16",
            "hit p16",
            "want p16 (16 floor(shared/16))",
            "gap p16",
        ],
        rows,
    )
    bad1 = [n for n, plen, sh, h in r1 if not (h == plen - 1 == sh)]
    bad16 = [n for n, _, sh, h in r16 if h != 16 * (sh // 16)]
    s.check(
        "page 1: hit == prompt - 1 for every N",
        f"{len(r1) - len(bad1)}/{len(r1)} N" + (f", off at N={bad1}" if bad1 else ""),
        not bad1,
    )
    s.check(
        "page 16: hit == 16 x floor(shared / 16) for every N",
        f"{len(r16) - len(bad16)}/{len(r16)} N" + (f", off at N={bad16}" if bad16 else ""),
        not bad16,
    )
    gaps = [sh - h for _, _, sh, h in r16]
    s.check(
        "page 16: gap == shared mod 16, never > 15",
        f"max gap {max(gaps)}",
        max(gaps) <= 15 and all(g == sh % 16 for g, (_, _, sh, _) in zip(gaps, r16, strict=True)),
    )
    s.images.append(plot_exp2(r1, r16, img_dir))
    return s


def plot_exp2(r1: list, r16: list, img_dir: Path) -> str:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(0, max(sh for _, _, sh, _ in r1 + r16) + 2)
    a1.plot(xs, xs, color="0.8", lw=1, label="all shared tokens")
    a1.step(
        xs,
        [16 * (x // 16) for x in xs],
        where="post",
        color="0.6",
        lw=1,
        ls="--",
        label="16 x floor(shared/16)",
    )
    a1.plot([r[2] for r in r1], [r[3] for r in r1], "o", ms=3, label="page size 1")
    a1.plot([r[2] for r in r16], [r[3] for r in r16], "s", ms=3, mfc="none", label="page size 16")
    a1.set_xlabel("shared prefix length (tokens)")
    a1.set_ylabel("cached tokens of the second request")
    a1.set_title("hit against shared length")
    a1.legend(fontsize=8)
    a2.step(
        xs, [x % 16 for x in xs], where="post", color="0.6", lw=1, ls="--", label="shared mod 16"
    )
    a2.plot([r[2] for r in r1], [r[2] - r[3] for r in r1], "o", ms=3, label="page size 1")
    a2.plot(
        [r[2] for r in r16], [r[2] - r[3] for r in r16], "s", ms=3, mfc="none", label="page size 16"
    )
    a2.set_xlabel("shared prefix length (tokens)")
    a2.set_ylabel("shared tokens computed again (shared - hit)")
    a2.set_title("what the page size leaves on the table")
    a2.legend(fontsize=8)
    fig.suptitle("Experiment 2: any shared length is reused at page size 1")
    return _save(fig, img_dir / "seed-exp2-hit-vs-shared.png")


# ---- experiment 3 ------------------------------------------------------------------

SETTLE_S = (
    1.0  # the pool gauges are refreshed when the scheduler goes idle, after the last response
)


def exp3_outlives(c: Client, wait_s: float) -> Section:
    s = Section(
        "3. The cache outlives the request",
        f"One prompt sent twice, {wait_s:.0f} s apart, max_tokens 1; "
        "scheduler /metrics read before and after.",
    )
    assert c.flush().flushed
    text = "The cache outlives the request: a prompt sent twice, five seconds apart, hits."
    prompt = len(c.ids(text))
    before = c.metrics()
    first = c.run(text=text)[2]
    time.sleep(wait_s)
    second = c.run(text=text)[2]
    at_once = c.metrics()
    time.sleep(SETTLE_S)
    after = c.metrics()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    d0 = {k: at_once[k] - before.get(k, 0.0) for k in at_once}
    want = {
        "radixserve:prompt_tokens_total": 2 * prompt,
        "radixserve:cached_tokens_total": prompt - 1,
        "radixserve:kv_evictable_tokens": prompt,
        "radixserve:kv_available_tokens": -prompt,
    }
    cum_rate = d["radixserve:cached_tokens_total"] / max(1, d["radixserve:prompt_tokens_total"])
    s.table(
        [
            "quantity",
            f"radixserve ({SETTLE_S} s after the response)",
            "read at once after the response",
            "expected",
        ],
        [
            ["prompt tokens", prompt, "", "-"],
            ["cached, first send", first.cached_tokens, "", 0],
            ["cached, second send", second.cached_tokens, "", prompt - 1],
        ]
        + [
            [f"delta {k}", f"{d.get(k, float('nan')):g}", f"{d0.get(k, float('nan')):g}", v]
            for k, v in want.items()
        ]
        + [
            [
                "radixserve:cache_hit_rate (last batch gauge)",
                f"{after.get('radixserve:cache_hit_rate', float('nan')):.4f}",
                "",
                f"{(prompt - 1) / prompt:.4f}",
            ],
            [
                "cumulative hit rate (cached / prompt counters, this experiment)",
                f"{cum_rate:.4f}",
                "",
                f"{(prompt - 1) / (2 * prompt):.4f}",
            ],
        ],
    )
    s.check(
        "second send hits prompt - 1",
        f"{second.cached_tokens} vs {prompt - 1}",
        second.cached_tokens == prompt - 1 and first.cached_tokens == 0,
    )
    for k, v in want.items():
        s.check(f"delta {k.split(':')[1]} == {v}", f"{d.get(k, float('nan')):g}", d.get(k) == v)
    gauge = after.get("radixserve:cache_hit_rate", -1.0)
    s.check(
        "cache_hit_rate gauge == (prompt - 1) / prompt",
        f"{gauge:.4f}",
        abs(gauge - (prompt - 1) / prompt) < 1e-6,
    )
    s.notes.append(
        "The per-batch gauge only shows the last prefill batch; the cumulative counters "
        "(`cached_tokens_total / prompt_tokens_total`) give the stable rate."
    )
    lag = [k for k in want if d0.get(k) != want[k]]
    if lag:
        lagging = ", ".join(k.split(":")[1] for k in lag)
        s.notes.append(
            f"Read at once after the response, {lagging} still showed the state during the "
            "second request's prefill: the pool gauges are refreshed at batches and when the "
            "scheduler loop goes idle, which can come after the client has its last message."
        )
    return s


# ---- experiment 4 ------------------------------------------------------------------


def exp4_flush(c: Client) -> Section:
    s = Section(
        "4. Flushing the tree removes the hits",
        "Send, repeat, flush, repeat; then a flush while a request runs.",
    )
    assert c.flush().flushed
    text = "Flushing the tree removes the hits; every token is computed again."
    prompt = len(c.ids(text))
    hits = [c.run(text=text)[2].cached_tokens, c.run(text=text)[2].cached_tokens]
    flushed = c.flush()
    hits.append(c.run(text=text)[2].cached_tokens)
    refused, after_refusal = flush_while_running(c, text)
    s.table(
        ["step", "radixserve", "expected"],
        [
            ["first send: cached", hits[0], 0],
            ["repeat: cached", hits[1], prompt - 1],
            ["flush (idle)", f"flushed={flushed.flushed}: {flushed.message!r}", "flushed"],
            ["repeat after flush: cached", hits[2], 0],
            [
                "flush while 1 request runs",
                f"flushed={refused.flushed}: {refused.message!r}",
                "refused, says so",
            ],
            ["send after the refused flush: cached", after_refusal, prompt - 1],
        ],
    )
    s.check("repeat before flush hits prompt - 1", str(hits[1]), hits[1] == prompt - 1)
    s.check("after flush the hit is 0", str(hits[2]), hits[2] == 0 and flushed.flushed)
    s.check(
        "flush refused while a request runs, message says so",
        repr(refused.message),
        not refused.flushed and "running" in refused.message,
    )
    s.check(
        "the refused flush changed nothing (prompt still cached)",
        str(after_refusal),
        after_refusal == prompt - 1,
    )
    return s


def flush_while_running(c: Client, text: str) -> tuple[pb.FlushCacheResponse, int]:
    """A flush asked for while a long request streams; then the cached hit of `text`."""
    stream = BackgroundStream(c.server, timeout=300)
    stream.started.wait(120)
    refused = c.flush()
    stream.stop(60)
    return refused, c.run(text=text)[2].cached_tokens


# ---- experiment 5 ------------------------------------------------------------------


def make_random_llama(folder: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama (safetensors) with the tokenizer files of ``tokenizer_from``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((tokenizer_from / "config.json").read_text())
    kw = dict(
        vocab_size=base["vocab_size"],
        eos_token_id=base.get("eos_token_id"),
        bos_token_id=base.get("bos_token_id"),
        pad_token_id=base.get("pad_token_id"),
        tie_word_embeddings=True,
        hidden_act="silu",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


EXP5_MODEL = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=2,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)


def count_parameters(model: Path) -> int:
    """Parameters stored in the model's safetensors (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def max_context(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def exp5_prompts(n: int, prefix_len: int, vocab: int, seed: int = 5) -> dict[str, list[list[int]]]:
    """Shared: one prefix + n different 8-token questions; distinct: n different prefixes of
    the same length."""
    rng = random.Random(seed)
    lo = 3  # keep clear of the special tokens at the start of the vocabulary

    def seq(k: int, first: int | None = None) -> list[int]:
        ids = [rng.randrange(lo, vocab) for _ in range(k)]
        if first is not None:
            ids[0] = first
        return ids

    firsts = rng.sample(
        range(lo, vocab), n
    )  # every question (and distinct prefix) starts differently
    questions = [seq(8, firsts[i]) for i in range(n)]
    prefix = seq(prefix_len)
    return {
        "shared": [prefix + q for q in questions],
        "distinct": [seq(prefix_len, firsts[i]) + q for i, q in enumerate(questions)],
    }


@dataclass
class GroupResult:
    prompt: int
    cached: int
    wall_s: float
    flops: float
    context_sum: int  # sum over computed tokens of (position + 1): the attention term


def run_group(c: Client, prompts: list[list[int]]) -> GroupResult:
    """All prompts at once (one thread each), max_tokens 1, after a flush."""
    assert c.flush().flushed
    before = c.metrics()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        finals = list(pool.map(lambda p: c.run_ids(p)[1], prompts))
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # let the scheduler publish the last batch's counters
    after = c.metrics()
    flops = after.get("radixserve:estimated_flops_total", 0.0) - before.get(
        "radixserve:estimated_flops_total", 0.0
    )
    ctx = sum(sum(range(f.cached_tokens + 1, f.prompt_tokens + 1)) for f in finals)
    return GroupResult(
        sum(f.prompt_tokens for f in finals), sum(f.cached_tokens for f in finals), wall, flops, ctx
    )


def expected_flops(cfg: dict, g: GroupResult, requests: int) -> float:
    """The same cost model written out independently: linear layers, attention, LM head."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    linear = h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"]
    computed = g.prompt - g.cached
    return (
        2 * L * linear * computed
        + 4 * L * cfg["num_attention_heads"] * d * g.context_sum
        + 2 * h * cfg["vocab_size"] * requests
    )


def exp5_compute(
    c: Client, model: Path, n: int, prefix_len: int, note: str, img_dir: Path
) -> Section:
    s = Section(
        "5. Hits save compute, not just bookkeeping",
        f"{n} concurrent requests (one thread each), max_tokens 1, a {prefix_len}-token prefix "
        f"plus an 8-token question each; shared = one prefix, distinct = {n} different prefixes "
        f"of the same length. Page size 1, default flags, flushed before each group. {note}",
    )
    cfg = json.loads((model / "config.json").read_text())
    prompts = exp5_prompts(n, prefix_len, cfg["vocab_size"])
    res = {name: run_group(c, ps) for name, ps in prompts.items()}
    params = count_parameters(model)
    sh, di = res["shared"], res["distinct"]
    ratio = di.wall_s / sh.wall_s
    rows = []
    for name, g in res.items():
        computed = g.prompt - g.cached
        two_pn = 2 * params * computed
        rows.append(
            [
                name,
                g.prompt,
                g.cached,
                pct(g.cached / g.prompt),
                f"{g.wall_s:.2f}",
                computed,
                f"{g.flops:.3e}",
                f"{two_pn:.3e}",
                f"{g.flops / two_pn:.3f}",
                f"{g.flops / expected_flops(cfg, g, n):.3f}",
                f"{pct(PUBLISHED_5[name + '_hit'])}, {PUBLISHED_5[name + '_s']} s",
            ]
        )
    s.table(
        [
            "group",
            "prompt tokens",
            "cached",
            "hit rate",
            "wall s",
            "computed tokens",
            "server FLOPs",
            "2 x params x computed",
            "FLOPs / 2PN",
            "FLOPs / (linear+attention+head)",
            "published",
        ],
        rows,
    )
    s.table(
        ["quantity", "radixserve", "published"],
        [
            ["distinct / shared wall time", f"{ratio:.2f}x", "5.2x (19.5 s / 3.8 s)"],
            ["parameters (safetensors)", f"{params:,}", "7B (AWQ)"],
        ],
    )
    s.check("shared hit rate >= 95 %", pct(sh.cached / sh.prompt), sh.cached / sh.prompt >= 0.95)
    s.check("distinct hit rate < 5 %", pct(di.cached / di.prompt), di.cached / di.prompt < 0.05)
    s.check("distinct / shared wall time >= 4x", f"{ratio:.2f}x", ratio >= 4)
    for name, g in res.items():
        r = g.flops / (2 * params * (g.prompt - g.cached))
        s.check(
            f"{name}: FLOPs counter within 10 % of 2 x params x computed",
            f"{r:.3f}",
            abs(r - 1) <= 0.10,
        )
    s.notes.append(
        "FLOPs / 2PN above 1 is the attention term (4 x layers x heads x head_dim x context per "
        "token), which 2 x parameters leaves out; it weighs more in a small model with a long "
        "context than in a 7B one. The last FLOPs column divides by that cost written out "
        "independently here (linear layers + attention + the LM head of each sampled token)."
    )
    s.images.append(plot_exp5(res, params, img_dir))
    return s


def plot_exp5(res: dict[str, GroupResult], params: int, img_dir: Path) -> str:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    names = list(res)
    colors = ["tab:green", "tab:red"]
    walls = [res[k].wall_s for k in names]
    a1.bar(names, walls, color=colors)
    for i, w in enumerate(walls):
        a1.annotate(f"{w:.2f} s", (i, w), ha="center", va="bottom")
    a1.set_ylim(0, 1.15 * max(walls))
    a1.set_ylabel("wall time (s)")
    a1.set_title("wall time of the group")
    flops = [res[k].flops for k in names]
    a2.bar(names, flops, color=colors, label="server's estimated_flops_total")
    two_pn = [2 * params * (res[k].prompt - res[k].cached) for k in names]
    a2.hlines(
        two_pn,
        [i - 0.4 for i in range(len(names))],
        [i + 0.4 for i in range(len(names))],
        colors="k",
        lw=2,
        label="2 x params x computed tokens",
    )
    a2.set_yscale("log")
    a2.set_ylabel("FLOPs (log scale)")
    a2.set_title("estimated FLOPs")
    a2.legend(fontsize=8, loc="upper left")
    fig.suptitle("Experiment 5: shared against distinct prefixes")
    return _save(fig, img_dir / "seed-exp5-shared-vs-distinct.png")


# ---- workloads of the second write-up ---------------------------------------------


def chat_turns_ids(c: Client, turns: int, answer_len: int) -> list[tuple[int, int, int]]:
    """Token-level multi-turn chat: prompt(n+1) = prompt(n) + answer(n) + user(n+1).
    Returns (prompt, answer, cached) per turn."""
    prompt = c.ids(
        f"System: a careful assistant, conversation on page {c.info.page_size}.\n"
        "User: hello, question 1?\nAssistant:"
    )
    rows = []
    for t in range(turns):
        answer, last = c.run_ids(prompt, answer_len, ignore_eos=True)
        rows.append((len(prompt), len(answer), last.cached_tokens))
        prompt = prompt + answer + c.ids(f"\nUser: thanks; now question {t + 2}?\nAssistant:")
    return rows


ZEN_STARTS = [
    "Beautiful is better than",
    "Explicit is better than",
    "Simple is better than",
    "Complex is better than",
    "Flat is better than",
    "Sparse is better than",
    "Readability",
    "Special cases aren't special enough to",
]


def chat_turns_template(c: Client, turns: int, answer_len: int) -> list[tuple[int, int, int, int]]:
    """Chat through the model's template (messages re-rendered each turn, the answer as text).
    Returns (prompt, answer, cached, common(prompt, previous prompt + answer ids)) per turn."""
    msgs = [
        ("system", "You complete lines of the Zen of Python.")
    ]  # the default model's training prompt
    prev: list[int] = []
    rows = []
    for t in range(turns):
        msgs.append(("user", ZEN_STARTS[t % len(ZEN_STARTS)]))
        ids = c.ids(messages=msgs)
        out, text, last = c.run(answer_len, messages=_chat(msgs))
        rows.append((len(ids), len(out), last.cached_tokens, common(ids, prev)))
        prev = ids + out
        msgs.append(("assistant", text))
    return rows


def chat_section(res: dict[int, dict], turns: int, answer_len: int) -> Section:
    s = Section(
        "Multi-turn chat",
        intro=f"Claim: turn n+1 hits at least all of turn n's prompt and answer. {turns} turns, "
        f"answers of {answer_len} tokens (greedy). Token level: prompt(n+1) = prompt(n) + "
        "answer ids + new user message ids. Template: the messages re-rendered by the chat "
        "template with the answer as text (what a chat client sends).",
    )
    rows, ok_ids, ok_tpl = [], {}, {}
    for page, r in res.items():
        ok_ids[page] = ok_tpl[page] = True
        for n in range(1, turns):
            p0, a0, _ = r["ids"][n - 1]
            hit = r["ids"][n][2]
            want = page * ((p0 + a0 - 1) // page)
            ok_ids[page] &= hit == want
            tp0, ta0, _, _ = r["tpl"][n - 1]
            _, _, thit, tcommon = r["tpl"][n]
            ok_tpl[page] &= thit == page * (min(tcommon, tp0 + ta0 - 1) // page)
            rows.append(
                [
                    page,
                    n + 1,
                    r["ids"][n][0],
                    p0 + a0,
                    hit,
                    p0 + a0 - hit,
                    r["tpl"][n][0],
                    tp0 + ta0,
                    tcommon,
                    thit,
                ]
            )
    s.table(
        [
            "page",
            "turn",
            "prompt (ids)",
            "prev prompt+answer",
            "cached",
            "short of prev by",
            "prompt (template)",
            "prev prompt+answer",
            "common with prev+answer",
            "cached",
        ],
        rows,
    )
    for page in res:
        s.check(
            f"page {page}, token level: "
            f"cached(n+1) == {page} x floor((prompt(n) + answer(n) - 1) / {page})",
            "all turns" if ok_ids[page] else "no",
            ok_ids[page],
        )
        s.check(
            f"page {page}, template: "
            f"cached(n+1) == {page} x floor(min(common, prompt(n)+answer(n)-1) / {page})",
            "all turns" if ok_tpl[page] else "no",
            ok_tpl[page],
        )
    s.notes.append(
        "Verdict on the claim: at page size 1 turn n+1 reuses all of turn n's prompt and answer "
        "except the answer's last token, whose KV was never computed (it was sampled, not fed "
        "back); at page size 16 up to 15 more tokens are lost to the partial last page. Through a "
        "chat template, re-tokenising the answer text and the end-of-turn markers can end the "
        "common prefix earlier (column 'common')."
    )
    return s


def cs_prompts(n: int, vocab: int, seed: int = 7) -> tuple[list[int], list[list[int]]]:
    """A 64-token shared opening and n conversations of 64 more tokens (first token distinct)."""
    rng = random.Random(seed)
    opening = [rng.randrange(3, vocab) for _ in range(64)]
    firsts = rng.sample(range(3, vocab), n)
    rests = [[firsts[i]] + [rng.randrange(3, vocab) for _ in range(63)] for i in range(n)]
    return opening, rests


def customer_service(c: Client, n: int, answer_len: int) -> dict[str, tuple[int, int]]:
    """(prompt, cached) summed, for single-shot and multi-turn versions of the workload.

    single: each 128-token conversation sent once. turns: the conversation is sent growing,
    4 turns of (8 user tokens + the model's 8-token answer) after the opening, up to 128."""
    opening, rests = cs_prompts(n, c.info.vocab_size)
    assert c.flush().flushed
    with ThreadPoolExecutor(8) as pool:
        singles = list(pool.map(lambda r: c.run_ids(opening + r)[1], rests))
    assert c.flush().flushed

    def conversation(rest: list[int]) -> tuple[int, int]:
        hist, prompt, cached = list(opening), 0, 0
        for t in range(4):
            hist += rest[16 * t : 16 * t + 8]
            ans, last = c.run_ids(hist, answer_len, ignore_eos=True)
            prompt, cached = prompt + last.prompt_tokens, cached + last.cached_tokens
            hist += ans
        return prompt, cached

    with ThreadPoolExecutor(8) as pool:
        convs = list(pool.map(conversation, rests))
    return {
        "single": (sum(f.prompt_tokens for f in singles), sum(f.cached_tokens for f in singles)),
        "turns": (sum(p for p, _ in convs), sum(k for _, k in convs)),
    }


def cs_section(res: dict[int, dict], n: int) -> Section:
    s = Section(
        "Customer-service workload",
        claims=True,
        intro=f"Claim: 96 % hit rate against 23 % for a block-hashing cache. {n} conversations "
        "of 128 tokens whose first 64 are one shared opening (random token ids), 8 at a time. "
        "single: each conversation sent once as a 128-token prompt (max_tokens 1); turns: each "
        "conversation sent 4 times, growing by 8 user tokens + the model's 8-token answer, up to "
        "128 tokens. Here PASS/FAIL says whether the measurement confirms the claim.",
    )
    rows = []
    for page, r in res.items():
        for kind, (p, k) in r.items():
            rows.append([page, kind, p, k, pct(k / p)])
    s.table(["page size", "version", "prompt tokens", "cached", "hit rate"], rows)
    best = max(k / p for p, k in res.get(1, {}).values()) if 1 in res else 0.0
    s.check("claim: a 96 % hit rate (page 1, best version)", pct(best), best >= 0.96)
    for kind in ("single", "turns"):
        if 1 in res and 16 in res:
            r1, r16 = (res[page][kind][1] / res[page][kind][0] for page in (1, 16))
            s.check(
                f"claim: a block cache (page 16) gets far less than page 1 (23 % vs 96 %), {kind}",
                f"{pct(r16)} vs {pct(r1)}",
                r16 < 0.5 * r1,
            )
    s.notes.append(
        "A 64-token opening is 4 whole pages of 16, so a page-16 cache keeps all of it; the gap "
        "between page sizes 1 and 16 here comes only from the partial last page of each turn's "
        "history. With one send per conversation no cache can pass 64/128 = 50 %: the claimed "
        "96 % needs each conversation to be re-sent as it grows."
    )
    return s


# ---- plotting and document -----------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return str(path.relative_to(path.parents[1]))  # relative to docs/


def write_doc(out: Path, sections: list[Section], header: str) -> None:
    body = [header] + [s.markdown() for s in sections]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(body).rstrip() + "\n")


def summary(sections: list[Section]) -> str:
    rows = [
        f"| {s.title} | {sum(ok for *_, ok in s.relations)}/{len(s.relations)} "
        f"{'claims of the second write-up confirmed' if s.claims else 'relations hold'} |"
        for s in sections
    ]
    return "\n".join(["| experiment | result |", "|---|---|", *rows, ""])


# ---- main ----------------------------------------------------------------------------


def sizes(quick: bool) -> dict:
    if quick:
        return dict(
            ns=[0, 2, 7, 20], exp5_n=10, exp5_prefix=200, wait_s=2.0, turns=3, answer=12, cs_n=8
        )
    return dict(
        ns=list(range(0, 61)) + [70, 80, 90],
        exp5_n=50,
        exp5_prefix=1000,
        wait_s=5.0,
        turns=8,
        answer=24,
        cs_n=64,
    )


def timed(label: str, fn: Callable, *a):
    t0 = time.monotonic()
    out = fn(*a)
    print(f"# {label}: {time.monotonic() - t0:.1f} s", flush=True)
    if isinstance(out, Section):
        print(out.markdown(), flush=True)
    return out


def exp5_model(args, tmp: Path, prefix: int) -> tuple[Path, str]:
    """The model for experiment 5 and a sentence saying which it is."""
    if args.exp5_model:
        return Path(args.exp5_model), f"Model: {args.exp5_model}."
    if max_context(args.model) >= prefix + 16:
        return args.model, f"Model: the default model ({args.model.name})."
    folder = make_random_llama(tmp / "exp5-llama", args.model, **EXP5_MODEL)
    return folder, (
        f"The default model's context ({max_context(args.model)} tokens, config.json "
        f"max_position_embeddings) cannot hold a {prefix}-token prefix, so this experiment runs "
        f"on a random-weight Llama built for it with transformers ({count_parameters(folder):,} "
        f"parameters: hidden {EXP5_MODEL['hidden_size']}, {EXP5_MODEL['num_hidden_layers']} "
        f"layers, intermediate {EXP5_MODEL['intermediate_size']}, "
        f"{EXP5_MODEL['num_attention_heads']} heads / "
        f"{EXP5_MODEL['num_key_value_heads']} KV heads, max_position_embeddings "
        f"{EXP5_MODEL['max_position_embeddings']}) with the default model's tokenizer files."
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "seed-experiments.md")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument(
        "--exp5-model", default="", help="model folder for experiment 5 (default: see above)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of the servers (0: torch's default)"
    )
    args = ap.parse_args()
    # On a small CPU shared with other work, torch's default (one OpenMP thread per core)
    # stalls at every sync point when a core is taken away; one thread gives steadier timings.
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if not (args.model / "config.json").exists():
        print(
            f"no model at {args.model} (train it: scripts/train_default_model.py)", file=sys.stderr
        )
        return 2
    z = sizes(args.quick)
    img_dir = args.out.parent / "img"
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections: list[Section] = []
    chat: dict[int, dict] = {}
    cs: dict[int, dict] = {}
    exp2: dict[int, list] = {}
    with tempfile.TemporaryDirectory(prefix="seed-exp-") as tmp:
        with start_server(1, args.model, 60000, metrics=True, env=env) as c:
            sections.append(timed("experiment 1", exp1_branches, c))
            exp2[1] = timed("experiment 2, page 1", exp2_rows, c, z["ns"])
            sections.append(timed("experiment 3", exp3_outlives, c, z["wait_s"]))
            sections.append(timed("experiment 4", exp4_flush, c))
            chat[1] = {
                "ids": timed("chat ids, page 1", chat_turns_ids, c, z["turns"], z["answer"]),
                "tpl": timed(
                    "chat template, page 1", chat_turns_template, c, z["turns"], z["answer"]
                ),
            }
            cs[1] = timed("customer service, page 1", customer_service, c, z["cs_n"], 8)
            max_len = c.info.max_model_len
        with start_server(16, args.model, 60000, metrics=False, env=env) as c:
            exp2[16] = timed("experiment 2, page 16", exp2_rows, c, z["ns"])
            chat[16] = {
                "ids": timed("chat ids, page 16", chat_turns_ids, c, z["turns"], z["answer"]),
                "tpl": timed(
                    "chat template, page 16", chat_turns_template, c, z["turns"], z["answer"]
                ),
            }
            cs[16] = timed("customer service, page 16", customer_service, c, z["cs_n"], 8)
        sections.insert(1, timed("experiment 2 table", exp2_section, exp2[1], exp2[16], img_dir))
        model5, note5 = exp5_model(args, Path(tmp), z["exp5_prefix"])
        need = z["exp5_n"] * (z["exp5_prefix"] + 10) + 4096
        with start_server(1, model5, need, metrics=True, env=env) as c:
            sections.append(
                timed(
                    "experiment 5",
                    exp5_compute,
                    c,
                    model5,
                    z["exp5_n"],
                    z["exp5_prefix"],
                    note5,
                    img_dir,
                )
            )
    sections.append(chat_section(chat, z["turns"], z["answer"]))
    sections.append(cs_section(cs, z["cs_n"]))
    header = doc_header(args, started, max_len)
    write_doc(args.out, sections, header + summary(sections))
    print(f"# wrote {args.out}", flush=True)
    return 0


def doc_header(args, started: str, max_len: int) -> str:
    cmd = "make bench-seeds" if not args.quick else "python bench/seed_experiments.py --quick"
    return (
        "# Seed experiments\n\n"
        "The experiments of `shared/SEED-EXPERIMENTS.md`, run through radixserve's "
        "public gRPC API and its scheduler's Prometheus metrics by `bench/seed_experiments.py` "
        f"(`{cmd}`{', QUICK sizes' if args.quick else ''}), started {started}. "
        f"Servers: `radixserve serve` on `{args.model.name}` (max_model_len {max_len}), "
        "page size 1 (metrics on) and `--page-size 16`; CPU only, "
        f"OMP_NUM_THREADS={args.threads or 'default'} for the servers, on a 2-core "
        "machine shared with other work (load average well above 2), so wall times are noisy. "
        f"Published figures: SGLang on one L40S with Qwen2.5-7B-Instruct-AWQ, page size 1.\n\n"
    )


if __name__ == "__main__":
    sys.exit(main())
