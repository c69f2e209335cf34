"""CPU linear benchmark: every way this torch build can run ``x @ W^T + b`` on CPU.

Issue 18: the worker's linears go through ``F.linear`` (MKL sgemm); oneDNN with prepacked
weights (what vLLM's CPU engine and inductor's freezing use) is faster on AMD CPUs. This
script measures, for the linear shapes of two models, at several M (tokens in the batch)
and 1 / 2 threads:

  F.linear        fp32, MKL sgemm (the worker today)
  addmm_wt        fp32, MKL sgemm with W^T stored [K, N] contiguous
  onednn_packed   fp32, torch.ops.mkldnn._linear_pointwise, weight packed once by
                  torch.ops.mkldnn._reorder_linear_weight (services/worker/cpu_linear.py)
  onednn_plain    fp32, the same op on the original (plain [N, K]) weight: oneDNN's kernels
                  without a second copy of the weight
  onednn_wt       fp32, the same op on W^T stored [K, N] contiguous (passed as its [N, K]
                  transposed view; oneDNN sees layout "ba")
  mkldnn_linear   fp32, torch._C._nn.mkldnn_linear with to_mkldnn weights (input converted
                  to an mkldnn tensor and the output back to dense each call, as
                  torch.utils.mkldnn.to_mkldnn's MkldnnLinear does)
  mkl_packed@M    fp32, torch.ops.mkl._mkl_linear, weight packed by _mkl_reorder_linear_weight
                  for exactly this M (any other M falls back to F.linear): inductor's
                  choice for static shapes
  bf16_linear     weights bf16, x cast to bf16, output cast back (F.linear)
  onednn_bf16     _linear_pointwise with bf16 packed weights (needs avx512bw/vl/dq or
                  avx_ne_convert; reported as unsupported otherwise)
  int8_wo         aten._weight_int8pack_mm, int8 weights with per-row scales (not exact;
                  for later)

Each (shape, M, threads) point runs the candidates interleaved, round after round, and
reports the median of the rounds (GFLOP/s and the ratio to F.linear measured in the same
rounds), twice: by wall clock and by process CPU time (at 1 thread the latter is
not inflated by other processes' load on a shared machine). Other sections: exactness
against float64, the oneDNN path's handling of 3-D / non-contiguous inputs / bias / other
Python threads, the cost of a first call at a new M (oneDNN builds a primitive per shape),
and torch.compile (inductor freezing) of the MLP block.

    .venv/bin/python bench/bench_linear.py              # everything: ~1 h on a busy 2-core box
    .venv/bin/python bench/bench_linear.py --quick      # smoke run: 3 M values, 3 rounds
    .venv/bin/python bench/bench_linear.py --sections linear --models qwen2 --threads 1
    .venv/bin/python bench/bench_linear.py --json out.json      # also every raw figure

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_linear.py --sections gemm --threads 2
        # the C small-M kernel (kernels/cpu/gemm.py) vs oneDNN packed vs F.linear, the
        # weights of 8 layers cycling (cold, as in decode)

Sections: linear, exact, features, cold, compile, gemm (not in the default run).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ---- shapes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # out_features
    k: int  # in_features
    bias: bool
    max_m: int = 1 << 30  # larger M is not a case the worker meets (the lm head: last tokens only)


def model_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int, qkv_bias: bool
) -> list[Shape]:
    return [
        Shape("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, qkv_bias),
        Shape("o_proj", heads * head_dim, hidden, False),
        Shape("gate_up_proj", 2 * inter, hidden, False),
        Shape("down_proj", hidden, inter, False),
        Shape("lm_head", vocab, hidden, False, max_m=256 if vocab > 10_000 else 1 << 30),
    ]


MODELS = {
    # (a) a small Llama: hidden 512, 8 q / 4 kv heads of 64, intermediate 1376, vocab 600
    "llama": model_shapes(512, 8, 4, 64, 1376, 600, qkv_bias=False),
    # (b) Qwen2-0.5B: hidden 896, 14 q / 2 kv heads of 64, intermediate 4864,
    # vocab 151936, q/k/v bias
    "qwen2": model_shapes(896, 14, 2, 64, 4864, 151936, qkv_bias=True),
    # (c) the peers' small Llama (~/.cache/radixserve-peers/models/small): hidden 512,
    # 8 q / 4 kv heads of 64, intermediate 1408, 8 layers; not in the default --models
    "small": model_shapes(512, 8, 4, 64, 1408, 600, qkv_bias=False),
}
DECODER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MS = (1, 8, 16, 64, 256, 1024, 2048, 8192)

# ---- candidates -----------------------------------------------------------------------


def onednn_bf16_supported() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError):
        return False


@dataclass
class Candidate:
    name: str
    exact: bool  # an fp32 path that must match F.linear to ~1e-5
    max_m: int = 1 << 30  # skipped above (too slow to be worth the minutes)
    per_m: bool = False  # its prepared weights depend on M


def candidates(bf16_packed: bool) -> list[Candidate]:
    out = [
        Candidate("F.linear", True),
        Candidate("addmm_wt", True),
        Candidate("onednn_packed", True),
        Candidate("onednn_plain", True),
        Candidate("onednn_wt", True),
        Candidate("mkldnn_linear", True),
        Candidate("mkl_packed@M", True, per_m=True),
        Candidate("bf16_linear", False, max_m=1024),
    ]
    if bf16_packed:
        out.append(Candidate("onednn_bf16", False))
    out.append(Candidate("int8_wo", False, max_m=64))
    return out


class Prepared:
    """The weights of one shape in every candidate's format."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, names: set[str]):
        self.w, self.b = w, b
        self.names = names
        self.wt = w.t().contiguous() if ("addmm_wt" in names or "onednn_wt" in names) else None
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(w) if "onednn_packed" in names else None
        )
        self.mkldnn_w = w.to_mkldnn() if "mkldnn_linear" in names else None
        self.mkldnn_b = b.to_mkldnn() if (b is not None and "mkldnn_linear" in names) else None
        self.wb = w.bfloat16() if ("bf16_linear" in names or "onednn_bf16" in names) else None
        self.bb = b.bfloat16() if (b is not None and self.wb is not None) else None
        self.packed_bf16 = (
            torch.ops.mkldnn._reorder_linear_weight(self.wb) if "onednn_bf16" in names else None
        )
        if "int8_wo" in names:
            scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
            self.w8 = torch.round(w / scale[:, None]).to(torch.int8).contiguous()
            self.s8 = scale.float()
        self.mkl_m: int | None = None
        self.mkl_w: torch.Tensor | None = None

    def prepare_m(self, m: int) -> None:
        if "mkl_packed@M" in self.names and self.mkl_m != m:
            self.mkl_w = None
            gc.collect()
            self.mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(self.w, m)
            self.mkl_m = m

    def fn(self, name: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        w, b = self.w, self.b
        if name == "F.linear":
            return lambda: F.linear(x, w, b)
        if name == "addmm_wt":
            wt = self.wt
            return (lambda: torch.addmm(b, x, wt)) if b is not None else (lambda: torch.mm(x, wt))
        if name == "onednn_packed":
            p = self.packed
            return lambda: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
        if name == "onednn_wt":
            wtv = self.wt.t()
            return lambda: torch.ops.mkldnn._linear_pointwise(x, wtv, b, "none", [], "")
        if name == "onednn_plain":
            return lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        if name == "mkldnn_linear":
            mw, mb = self.mkldnn_w, self.mkldnn_b
            return lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), mw, mb).to_dense()
        if name == "mkl_packed@M":
            mk, m = self.mkl_w, x.shape[0]
            return lambda: torch.ops.mkl._mkl_linear(x, mk, w, b, m)
        if name == "bf16_linear":
            wb, bb = self.wb, self.bb
            return lambda: F.linear(x.bfloat16(), wb, bb).float()
        if name == "onednn_bf16":
            p, bb = self.packed_bf16, self.bb
            return lambda: torch.ops.mkldnn._linear_pointwise(
                x.bfloat16(), p, bb, "none", [], ""
            ).float()
        if name == "int8_wo":
            w8, s8 = self.w8, self.s8
            return (
                (lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8) + b)
                if b is not None
                else (lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8))
            )
        raise KeyError(name)


def make_weights(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nn.Linear's initialisation (uniform +-1/sqrt(K)), float32."""
    gen = torch.Generator().manual_seed(seed)
    bound = shape.k**-0.5
    w = (torch.rand(shape.n, shape.k, generator=gen) * 2 - 1) * bound
    b = (torch.rand(shape.n, generator=gen) * 2 - 1) * bound if shape.bias else None
    return w, b


# ---- timing ---------------------------------------------------------------------------


def _calls_for(fn: Callable[[], object], target_s: float) -> int:
    """How many back-to-back calls make one sample of about target_s."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return max(1, min(2000, int(target_s / max(dt, 1e-7))))


def _sample(fn: Callable[[], object], n: int, cpu: list[float] | None = None) -> float:
    """Wall seconds per call over n calls; appends the process CPU seconds per call to
    `cpu` (the clock that other processes' load does not inflate, at 1 thread)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    wall = (time.perf_counter() - t0) / n
    if cpu is not None:
        cpu.append((time.process_time() - c0) / n)
    return wall


# Process CPU seconds of the last interleaved() call, by name (see _sample).
LAST_CPU: dict[str, list[float]] = {}


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, target_s: float
) -> dict[str, list[float]]:
    """Wall seconds per call of each fn: `rounds` samples each, the fns taking turns (the
    order rotating each round) so that load from other processes hits them alike.
    The CPU-time samples of the same calls are left in LAST_CPU."""
    for fn in fns.values():  # warm up: primitive creation, first-touch of buffers
        fn()
        fn()
    calls = {name: _calls_for(fn, target_s) for name, fn in fns.items()}
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    LAST_CPU.clear()
    LAST_CPU.update({name: [] for name in names})
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            out[name].append(_sample(fns[name], calls[name], LAST_CPU[name]))
    return out


def ratio_median(a: list[float], b: list[float]) -> float:
    """Median over rounds of b/a (speed-up of `a` over `b`, taken round by round)."""
    return statistics.median(bb / aa for aa, bb in zip(a, b, strict=True))


# ---- section: linear ------------------------------------------------------------------


@dataclass
class LinearResult:
    model: str
    shape: str
    m: int
    threads: int
    flops: float
    seconds: dict[str, list[float]] = field(default_factory=dict)  # wall clock
    cpu_seconds: dict[str, list[float]] = field(default_factory=dict)  # process CPU time


def section_linear(
    models: list[str],
    ms: list[int],
    threads: list[int],
    rounds: int,
    target_s: float,
    bf16_packed: bool,
    only: set[str] | None,
) -> list[LinearResult]:
    results: list[LinearResult] = []
    cands = [
        c for c in candidates(bf16_packed) if only is None or c.name in only or c.name == "F.linear"
    ]
    for model in models:
        for shape in MODELS[model]:
            w, b = make_weights(shape)
            names = {c.name for c in cands}
            prep = Prepared(w, b, names)
            for m in ms:
                if m > shape.max_m:
                    continue
                x = torch.randn(m, shape.k, generator=torch.Generator().manual_seed(m))
                prep.prepare_m(m)
                active = [c for c in cands if m <= c.max_m]
                fns = {c.name: prep.fn(c.name, x) for c in active}
                r_rounds = rounds if 2.0 * m * shape.n * shape.k < 2e10 else max(3, rounds // 2)
                for nt in threads:
                    torch.set_num_threads(nt)
                    secs = interleaved(fns, r_rounds, target_s)
                    res = LinearResult(
                        model,
                        shape.name,
                        m,
                        nt,
                        2.0 * m * shape.n * shape.k,
                        secs,
                        {k: list(v) for k, v in LAST_CPU.items()},
                    )
                    results.append(res)
                    base = statistics.median(secs["F.linear"])
                    line = "  ".join(
                        f"{n}={res.flops / statistics.median(s) / 1e9:6.1f}"
                        f"({ratio_median(s, secs['F.linear']):.2f}x)"
                        for n, s in secs.items()
                    )
                    print(
                        f"[linear] {model:5s} {shape.name:12s} M={m:5d} t={nt}  F.linear "
                        f"{base * 1e6:9.1f}us  {line}",
                        flush=True,
                    )
                del fns
            del prep
            gc.collect()
    return results


def aggregate(
    results: list[LinearResult],
    model: str,
    shapes: tuple[str, ...],
    m: int,
    threads: int,
    clock: str = "wall",
) -> dict[str, tuple[float, float]] | None:
    """GFLOP/s over a set of shapes (sum of flops / sum of median seconds) and the ratio
    to F.linear (sum of F.linear medians / sum of the candidate's medians)."""
    rows = [
        r
        for r in results
        if r.model == model and r.shape in shapes and r.m == m and r.threads == threads
    ]
    if len(rows) != len(shapes):
        return None
    secs = [r.seconds if clock == "wall" else r.cpu_seconds for r in rows]
    names = [n for n in secs[0] if all(n in s for s in secs)]
    flops = sum(r.flops for r in rows)
    base = sum(statistics.median(s["F.linear"]) for s in secs)
    out = {}
    for n in names:
        t = sum(statistics.median(s[n]) for s in secs)
        out[n] = (flops / t / 1e9, base / t)
    return out


def print_linear_tables(
    results: list[LinearResult],
    models: list[str],
    ms: list[int],
    threads: list[int],
    clock: str = "wall",
) -> None:
    what = (
        "wall clock"
        if clock == "wall"
        else "process CPU time (per CPU-second; immune to other processes' load at 1 thread)"
    )
    for model in models:
        for group, shapes in (
            ("decoder layer (qkv+o+gate_up+down)", DECODER),
            ("lm_head", ("lm_head",)),
        ):
            print(
                f"\n### {model}: {group} - GFLOP/s (ratio to F.linear), {what}, "
                "median of interleaved rounds\n"
            )
            names: list[str] = []
            rows = []
            for nt in threads:
                for m in ms:
                    agg = aggregate(results, model, shapes, m, nt, clock)
                    if agg is None:
                        continue
                    for n in agg:
                        if n not in names:
                            names.append(n)
                    rows.append((nt, m, agg))
            print("| threads | M | " + " | ".join(names) + " |")
            print("|---|---|" + "---|" * len(names))
            for nt, m, agg in rows:
                cells = [f"{agg[n][0]:.1f} ({agg[n][1]:.2f}x)" if n in agg else "-" for n in names]
                print(f"| {nt} | {m} | " + " | ".join(cells) + " |")


# ---- section: exactness ---------------------------------------------------------------


def section_exact(models: list[str], ms: list[int], bf16_packed: bool) -> list[dict]:
    """Error against float64 of every candidate, and against F.linear in float32.

    rel_inf = max|y - ref| / max|ref|; rel_2 = ||y - ref||_2 / ||ref||_2."""
    torch.set_num_threads(2)
    out = []
    print("\n### exactness: error vs float64 (rel_inf / rel_2) and vs F.linear fp32 (rel_inf)\n")
    print(
        "| model | shape | M | candidate | vs fp64 rel_inf | vs fp64 rel_2 | "
        "vs F.linear rel_inf | max abs vs F.linear |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cands = [c.name for c in candidates(bf16_packed)]
    for model in models:
        for shape in MODELS[model]:
            w, b = make_weights(shape, seed=1)
            prep = Prepared(w, b, set(cands))
            for m in ms:
                if m > shape.max_m:
                    continue
                x = torch.randn(m, shape.k, generator=torch.Generator().manual_seed(100 + m))
                prep.prepare_m(m)
                ref = F.linear(x.double(), w.double(), None if b is None else b.double())
                y_f = F.linear(x, w, b)
                for name in cands:
                    y = prep.fn(name, x)().float()
                    e64 = y.double() - ref
                    row = dict(
                        model=model,
                        shape=shape.name,
                        m=m,
                        candidate=name,
                        rel_inf_fp64=(e64.abs().max() / ref.abs().max()).item(),
                        rel_2_fp64=(e64.norm() / ref.norm()).item(),
                        rel_inf_flinear=((y - y_f).abs().max() / y_f.abs().max()).item(),
                        abs_flinear=(y - y_f).abs().max().item(),
                    )
                    if shape.name == "lm_head":
                        row["argmax_agree"] = (y.argmax(-1) == y_f.argmax(-1)).float().mean().item()
                    out.append(row)
                    print(
                        f"| {model} | {shape.name} | {m} | {name} | {row['rel_inf_fp64']:.2e} | "
                        f"{row['rel_2_fp64']:.2e} | {row['rel_inf_flinear']:.2e} | "
                        f"{row['abs_flinear']:.2e} |"
                    )
            del prep
            gc.collect()
    return out


# ---- section: features of the oneDNN packed path --------------------------------------


def _pw(x, p, b):
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def section_features(rounds: int, target_s: float) -> dict:
    """3-D, non-contiguous and empty inputs, bias, inference mode, other Python threads."""
    out: dict = {}
    shape = MODELS["qwen2"][0]  # qkv_proj with bias
    w, b = make_weights(shape)
    p = torch.ops.mkldnn._reorder_linear_weight(w)
    print("\n### oneDNN packed path: input handling (qwen2 qkv_proj 1152x896 with bias)\n")

    def err(y, ref):
        return ((y - ref).abs().max() / ref.abs().max()).item()

    x3 = torch.randn(3, 7, shape.k)
    out["3d"] = err(_pw(x3, p, b), F.linear(x3, w, b))
    wide = torch.randn(64, 2 * shape.k)
    xs = wide[:, ::2]  # strided rows
    xt = torch.randn(shape.k, 64).t()  # transposed
    out["strided"] = err(_pw(xs, p, b), F.linear(xs, w, b))
    out["transposed"] = err(_pw(xt, p, b), F.linear(xt, w, b))
    out["nobias"] = err(_pw(xt, p, None), F.linear(xt, w))
    out["empty_shape"] = tuple(_pw(torch.randn(0, shape.k), p, b).shape)
    with torch.inference_mode():
        xi = torch.randn(5, shape.k)
        out["inference_mode"] = err(_pw(xi, p, b), F.linear(xi, w, b))
        p_inf = torch.ops.mkldnn._reorder_linear_weight(w)
    out["packed_in_inference_mode_used_outside"] = err(_pw(x3, p_inf, b), F.linear(x3, w, b))
    for k, v in out.items():
        print(f"- {k}: {v}")

    # Cost of non-contiguous inputs (both paths copy them), at 1 thread.
    torch.set_num_threads(1)
    for m in (64, 1024):
        wide = torch.randn(m, 2 * shape.k)
        xs, xc = wide[:, ::2], wide[:, ::2].contiguous()
        secs = interleaved(
            {
                "F.linear contig": lambda xc=xc: F.linear(xc, w, b),
                "F.linear strided": lambda xs=xs: F.linear(xs, w, b),
                "packed contig": lambda xc=xc: _pw(xc, p, b),
                "packed strided": lambda xs=xs: _pw(xs, p, b),
            },
            rounds,
            target_s,
        )
        med = {k: statistics.median(v) * 1e6 for k, v in secs.items()}
        out[f"noncontig_us_m{m}"] = med
        print(
            f"- M={m}, 1 thread, us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        )

    # Threads: the worker sets torch.set_num_threads in its main thread; does a call made
    # from another Python thread honour it? (OpenMP keeps the count per thread.)
    gate = MODELS["qwen2"][2]
    wg, _ = make_weights(gate)
    pg = torch.ops.mkldnn._reorder_linear_weight(wg)
    x = torch.randn(256, gate.k)

    def timed() -> float:
        _pw(x, pg, None)
        return statistics.median(_sample(lambda: _pw(x, pg, None), 5) for _ in range(5))

    res = {}
    for nt in (1, 2):
        torch.set_num_threads(nt)
        res[f"main_t{nt}"] = timed()
        box: list[float] = []
        th = threading.Thread(target=lambda box=box: box.append(timed()))
        th.start()
        th.join()
        res[f"thread_t{nt}"] = box[0]
    out["threads_s"] = res
    print(
        "- gate_up M=256, ms per call: "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in res.items())
        + "  (main_t1/main_t2 ~2 means oneDNN follows torch.set_num_threads)"
    )
    return out


# ---- section: first call at a new M -----------------------------------------------------


def section_cold(threads: int) -> list[dict]:
    """oneDNN creates (and caches) a primitive per input shape: the first call at an M it
    has not seen costs extra. F.linear has no such cost."""
    torch.set_num_threads(threads)
    print(f"\n### first call at a new M vs warm ({threads} thread(s)), us\n")
    print(
        "| shape | M | F.linear first | F.linear warm | packed first | packed warm "
        "| packed first - warm |"
    )
    print("|---|---|---|---|---|---|---|")
    out = []
    for shape in MODELS["qwen2"][:4]:
        w, b = make_weights(shape)
        p = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in (3, 37, 129, 517, 1999):
            x = torch.randn(m, shape.k)
            t0 = time.perf_counter()
            F.linear(x, w, b)
            f_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            _pw(x, p, b)
            p_first = time.perf_counter() - t0
            fns = {
                "f": lambda x=x, w=w, b=b: F.linear(x, w, b),
                "p": lambda x=x, p=p, b=b: _pw(x, p, b),
            }
            secs = interleaved(fns, 5, 0.01)
            f_warm, p_warm = statistics.median(secs["f"]), statistics.median(secs["p"])
            row = dict(
                shape=shape.name,
                m=m,
                f_first=f_first,
                f_warm=f_warm,
                p_first=p_first,
                p_warm=p_warm,
            )
            out.append(row)
            print(
                f"| {shape.name} | {m} | {f_first * 1e6:.0f} | {f_warm * 1e6:.0f} | "
                f"{p_first * 1e6:.0f} | {p_warm * 1e6:.0f} | {(p_first - p_warm) * 1e6:.0f} |"
            )
    return out


# ---- section: small-M C kernel vs oneDNN, weights cold ---------------------------------

GEMM_MS = (1, 4, 16, 32, 64, 128)
GEMM = ("kernel", "packed", "F.linear")


def _gemm_step(name: str, kernel: Callable, items: list[tuple]) -> None:
    for x, w, b, p in items:
        if name == "kernel":
            kernel(x, w, b)
        elif name == "packed":
            _pw(x, p, b)
        else:
            F.linear(x, w, b)


def section_gemm(
    models: list[str], ms: list[int], threads: list[int], rounds: int, target_s: float, layers: int
) -> list[dict]:
    """A decode step's linears as the worker meets them: the four decoder linears of
    `layers` layers, called in order, so that every weight comes from memory (more than
    L3 between two uses), timed per whole step. kernels/cpu/gemm.py on the plain weight vs
    the oneDNN packed path vs F.linear, interleaved rounds, medians."""
    from kernels.cpu import gemm as cpu_gemm

    kernel = cpu_gemm.load()
    if kernel is None:
        print("\n### gemm: no C kernel here (no compiler or RADIXSERVE_CPU_KERNELS=0)")
        return []
    out = []
    for model in models:
        shapes = [s for s in MODELS[model] if s.name in DECODER]
        ws = [[make_weights(s, seed=i) for s in shapes] for i in range(layers)]
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w, _ in lay] for lay in ws]
        weight_bytes = 4 * layers * sum(s.n * s.k for s in shapes)
        for nt in threads:
            torch.set_num_threads(nt)
            print(
                f"\n### gemm: {model}, {layers} layers cycling ({weight_bytes / 1e6:.0f} MB of "
                f"weights), {nt} thread(s): ms per step (GFLOP/s), ratio = other / kernel\n"
            )
            print("| M | kernel | oneDNN packed | F.linear | packed/kernel | F.linear/kernel |")
            print("|---|---|---|---|---|---|")
            for m in ms:
                xs = [torch.randn(m, s.k) for s in shapes]

                # (x, w, b, packed) in call order: layer by layer, the four linears each
                items = [
                    (xs[i], *ws[li][i], packed[li][i])
                    for li in range(layers)
                    for i in range(len(shapes))
                ]
                fns: dict[str, Callable[[], object]] = {
                    name: functools.partial(_gemm_step, name, kernel, items) for name in GEMM
                }
                secs = interleaved(fns, rounds, target_s)
                flops = 2.0 * m * weight_bytes / 4
                med = {k: statistics.median(v) for k, v in secs.items()}
                row = dict(model=model, threads=nt, m=m, layers=layers, seconds=secs)
                row["packed_over_kernel"] = ratio_median(secs["kernel"], secs["packed"])
                row["flinear_over_kernel"] = ratio_median(secs["kernel"], secs["F.linear"])
                out.append(row)
                cells = " | ".join(f"{med[k] * 1e3:.2f} ({flops / med[k] / 1e9:.1f})" for k in fns)
                print(
                    f"| {m} | {cells} | {row['packed_over_kernel']:.2f}x | "
                    f"{row['flinear_over_kernel']:.2f}x |",
                    flush=True,
                )
        del ws, packed, items, fns
        gc.collect()
    return out


# ---- section: torch.compile with inductor freezing ------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class _PackedMLP:
    """The same block with services/worker/cpu_linear.py's PackedLinear."""

    def __init__(self, mlp: _MLP):
        from services.worker.cpu_linear import PackedLinear

        self.gate_up = PackedLinear(mlp.gate_up.weight, None)
        self.down = PackedLinear(mlp.down.weight, None)
        self.inter = mlp.inter

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


def section_compile(
    models: list[str], ms: list[int], threads: list[int], rounds: int, target_s: float
) -> list[dict]:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    out = []
    print("\n### MLP block (gate_up -> silu*mul -> down): eager vs torch.compile(freezing)\n")
    print(
        "| model | M | threads | variant | GFLOP/s | ratio to eager F.linear "
        "| max rel diff vs eager |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in models:
        shapes = {s.name: s for s in MODELS[model]}
        hidden, inter = shapes["gate_up_proj"].k, shapes["down_proj"].k
        torch.manual_seed(0)
        mlp = _MLP(hidden, inter).eval()
        packed = _PackedMLP(mlp)
        variants: dict[str, Callable] = {"eager F.linear": mlp, "eager PackedLinear": packed}
        compile_s: dict[str, float] = {}
        for label, dynamic, cpp in (
            ("compile dynamic", True, False),
            ("compile dynamic cpp_wrapper", True, True),
        ):
            torch._dynamo.reset()
            inductor_config.freezing = True
            inductor_config.cpp_wrapper = cpp
            fn = torch.compile(_MLP(hidden, inter).eval(), dynamic=dynamic)
            fn._orig_mod.load_state_dict(mlp.state_dict())
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(torch.randn(max(2, ms[0]), hidden))
            compile_s[label] = time.perf_counter() - t0
            variants[label] = fn
        print(
            f"compile seconds ({model}): " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
        )
        inductor_config.cpp_wrapper = False
        for m in ms:
            x = torch.randn(m, hidden)
            flops = 2.0 * m * hidden * 2 * inter + 2.0 * m * inter * hidden
            with torch.no_grad():
                ref = mlp(x)
                static = torch.compile(mlp, dynamic=False)  # freezing, static M: _mkl_linear
                t0 = time.perf_counter()
                static(x)
                cs = time.perf_counter() - t0
                fns = dict(variants)
                fns["compile static M"] = static
                calls = {k: (lambda f=f, x=x: f(x)) for k, f in fns.items()}
                diffs = {
                    k: ((c() - ref).abs().max() / ref.abs().max()).item() for k, c in calls.items()
                }
                for nt in threads:
                    torch.set_num_threads(nt)
                    secs = interleaved(calls, rounds, target_s)
                    for k, s in secs.items():
                        row = dict(
                            model=model,
                            m=m,
                            threads=nt,
                            variant=k,
                            gflops=flops / statistics.median(s) / 1e9,
                            ratio=ratio_median(s, secs["eager F.linear"]),
                            rel_diff=diffs[k],
                            compile_s=cs if k == "compile static M" else compile_s.get(k),
                        )
                        out.append(row)
                        print(
                            f"| {model} | {m} | {nt} | {k} | {row['gflops']:.1f} | "
                            f"{row['ratio']:.2f}x | {row['rel_diff']:.1e} |",
                            flush=True,
                        )
            torch._dynamo.reset()
    inductor_config.freezing = False
    return out


# ---- main -------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["llama", "qwen2"], choices=list(MODELS))
    ap.add_argument("--ms", nargs="+", type=int, default=list(MS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=20.0, help="length of one timed sample")
    ap.add_argument(
        "--sections", nargs="+", default=["linear", "exact", "features", "cold", "compile"]
    )
    ap.add_argument(
        "--candidates", nargs="+", default=None, help="only these (F.linear always runs)"
    )
    ap.add_argument("--compile-ms", nargs="+", type=int, default=[1, 8, 64, 1024])
    ap.add_argument("--gemm-ms", nargs="+", type=int, default=list(GEMM_MS))
    ap.add_argument("--gemm-layers", type=int, default=8, help="layers cycling (gemm section)")
    ap.add_argument("--quick", action="store_true", help="few M, 3 rounds, short samples")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.ms, args.rounds, args.target_ms = [1, 64, 1024], 3, 5.0
        args.compile_ms = [8, 256]

    bf16_packed = onednn_bf16_supported()
    print(
        f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"mkldnn {torch.backends.mkldnn.is_available()}, oneDNN bf16 packed {bf16_packed}, "
        f"cores {torch.get_num_threads()}",
        flush=True,
    )
    target = args.target_ms / 1e3
    report: dict = {
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bf16_packed,
    }
    only = set(args.candidates) if args.candidates else None
    with torch.inference_mode():
        if "linear" in args.sections:
            res = section_linear(
                args.models, args.ms, args.threads, args.rounds, target, bf16_packed, only
            )
            print_linear_tables(res, args.models, args.ms, args.threads)
            print_linear_tables(res, args.models, args.ms, args.threads, clock="cpu")
            report["linear"] = [r.__dict__ for r in res]
        if "exact" in args.sections:
            report["exact"] = section_exact(
                args.models, [m for m in (1, 64, 2048) if m in args.ms or args.quick], bf16_packed
            )
        if "features" in args.sections:
            report["features"] = section_features(args.rounds, target)
        if "cold" in args.sections:
            report["cold"] = {nt: section_cold(nt) for nt in args.threads}
        if "gemm" in args.sections:
            report["gemm"] = section_gemm(
                args.models, args.gemm_ms, args.threads, args.rounds, target, args.gemm_layers
            )
    if "compile" in args.sections:
        report["compile"] = section_compile(
            args.models, args.compile_ms, args.threads, args.rounds, target
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
