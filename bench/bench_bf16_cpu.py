"""bfloat16 against float32 on the CPU worker (issue 42): decode steps, prefill, and where
the 16-bit small-M kernel hands over to oneDNN.

Two ModelRunners on the same model folder, one per dtype (``--dtypes``), run the same
batches alternately (which goes first alternates too): per-step wall times of decode
batches (medians; the slot layout of bench/bench_decode_step.py) and prefill tokens/s of
one batch of fresh prompts per round. ``--crossing`` times the linears alone instead: each
of the model's linear shapes, one weight per layer (cold, as in a decode step), at M rows,
through the C kernel and through oneDNN, per dtype, interleaved, so that the row count
where oneDNN overtakes the kernel (services/worker/cpu_linear.py's crossings) can be read
off. On a shared machine every figure is a median of interleaved repeats; rerun on a quiet
one before quoting it.

    .venv/bin/python bench/bench_bf16_cpu.py --model small --batches 1 8 16 --steps 32
    .venv/bin/python bench/bench_bf16_cpu.py --model qwen-0.5b --batches 1 8 16 --steps 16 \
        --prefill-prompts 2 --prompt-len 512 --rounds 3
    .venv/bin/python bench/bench_bf16_cpu.py --model qwen-0.5b --crossing --rows 1 2 4 8 16 32

``--model`` builds bench/peers/make_model.py's models (small: 24M, qwen-0.5b: Qwen2-0.5B's
shape, 358M) when missing; ``--model-path`` takes any folder instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.worker import host_memory  # noqa: E402

host_memory.tune()  # as the worker process does, before torch loads

import torch  # noqa: E402
from bench_decode_step import batches  # noqa: E402

from kernels.cpu import gemm as cpu_gemm  # noqa: E402
from services.common.config import WorkerConfig  # noqa: E402
from services.worker import wire  # noqa: E402
from services.worker.layers import Linear  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_folder(args: argparse.Namespace) -> str:
    if args.model_path:
        return args.model_path
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import make_model

    return str(make_model.make(args.model))


def make_runner(path: str, dtype: str, tokens: int) -> ModelRunner:
    cfg = WorkerConfig(
        model_path=path, device="cpu", dtype=dtype, max_total_tokens=tokens,
        max_running_requests=65,
    )  # fmt: skip
    return ModelRunner(cfg)


def interleaved(sides: list[str], rounds: int, run: Callable[[str, int], float | None]) -> dict:
    """{side: [value per round]}: every round runs each side once, the order alternating."""
    out: dict[str, list[float]] = {s: [] for s in sides}
    for i in range(rounds):
        for s in sides if i % 2 == 0 else reversed(sides):
            value = run(s, i)
            if value is not None:
                out[s].append(value)
    return out


def decode(runners: dict[str, ModelRunner], sizes: list[int], prompt_len: int, steps: int) -> None:
    """Per-step ms of decode batches of each size, per dtype (medians of interleaved steps)."""
    names = list(runners)
    rng = random.Random(0)
    print(f"decode, {torch.get_num_threads()} threads, prompts of {prompt_len} tokens, "
          f"{steps} steps; medians of per-step wall ms")  # fmt: skip
    print(
        "| batch | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} tok/s" for n in names)
        + f" | {names[-1]} / {names[0]} speed |"
    )
    print("|---:|" + "---:|" * (2 * len(names) + 1))
    for b in sizes:
        vocab = runners[names[0]].vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(b)]
        todo = {n: batches(prompts, steps) for n in names}
        for n in names:
            wire.forward(runners[n], todo[n][0])  # the prompts' prefill

        def step(n: str, i: int, todo: dict = todo) -> float | None:
            start = time.perf_counter()
            wire.forward(runners[n], todo[n][i + 1])
            return time.perf_counter() - start if i else None  # step 0 warms up

        times = interleaved(names, steps, step)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        row = [f"{ms[n]:.1f}" for n in names] + [f"{b / ms[n] * 1e3:,.0f}" for n in names]
        print(f"| {b} | " + " | ".join(row) + f" | {ms[names[0]] / ms[names[-1]]:.2f}x |",
              flush=True)  # fmt: skip


def prefill(runners: dict[str, ModelRunner], prompts: int, length: int, rounds: int) -> None:
    """Cold prefill tokens/s of one batch of fresh prompts per round (round 0 warms up)."""
    names = list(runners)
    rng = random.Random(1)
    vocab = runners[names[0]].vocab_size

    def once(n: str, i: int) -> float | None:
        texts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(prompts)]
        start = time.perf_counter()
        wire.forward(runners[n], batches(texts, 0)[0])
        return prompts * length / (time.perf_counter() - start) if i else None

    rates = interleaved(names, rounds + 1, once)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(
        f"prefill {prompts} x {length} tokens, {torch.get_num_threads()} threads, tokens/s "
        "(medians): "
        + ", ".join(f"{n} {med[n]:,.0f}" for n in names)
        + f"; {names[-1]} / {names[0]} {med[names[-1]] / med[names[0]]:.2f}x; rounds: "
        + "; ".join(f"{n} " + " / ".join(f"{v:,.0f}" for v in rates[n]) for n in names)
    )


def linear_shapes(runner: ModelRunner) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's linears."""
    layer = runner.model.model.layers[0]
    return [(m.out_features, m.in_features) for m in layer.modules() if isinstance(m, Linear)]


def crossing(runner: ModelRunner, rows: list[int], repeats: int) -> None:
    """ms per pass over every layer's linears (fresh weights of the model's shapes, one per
    layer: cold, as a decode step reads them), C kernel vs oneDNN, float32 and bfloat16."""
    shapes, layers = linear_shapes(runner), len(runner.model.model.layers)
    op = torch.ops.mkldnn._linear_pointwise.default
    g = torch.Generator().manual_seed(0)
    w32 = [[torch.randn(n, k, generator=g) * k**-0.5 for n, k in shapes] for _ in range(layers)]
    w16 = [[w.bfloat16() for w in ws] for ws in w32]
    pk = {
        "float32": [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in w32],
        "bfloat16": [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in w16],
    }
    k32, k16 = cpu_gemm.load(), cpu_gemm.load16()
    sides = ["kernel float32", "oneDNN float32", "kernel bfloat16", "oneDNN bfloat16"]
    print(f"linears of {layers} layers {shapes}, {torch.get_num_threads()} threads, ms per "
          f"pass (medians of {repeats} interleaved); 16-bit kernel: "
          f"{cpu_gemm.ISA16_NAMES[cpu_gemm.isa16()]}")  # fmt: skip
    print("| rows | " + " | ".join(sides) + " |")
    print("|---:|" + "---:|" * len(sides))
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}

        def run(side: str, _i: int, xs: dict = xs, xs16: dict = xs16) -> float:
            kind, dtype = side.split()
            start = time.perf_counter()
            for layer in range(layers):
                for j, (_, k) in enumerate(shapes):
                    x = xs[k] if dtype == "float32" else xs16[k]
                    w = (w32 if dtype == "float32" else w16)[layer][j]
                    if kind == "kernel":
                        (k32 if dtype == "float32" else k16)(x, w)
                    else:
                        op(x, pk[dtype][layer][j], None, "none", [], "")
            return (time.perf_counter() - start) * 1e3

        interleaved(sides, 2, run)  # warm-up
        times = interleaved(sides, repeats, run)
        print(f"| {m} | " + " | ".join(f"{statistics.median(times[s]):.2f}" for s in sides)
              + " |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="small", choices=["small", "qwen-0.5b"])
    ap.add_argument("--model-path", default="", help="a model folder instead of --model")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill-prompts", type=int, default=0, help="0: no prefill figure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--crossing", action="store_true", help="time the linears alone")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_folder(args)
    if args.crossing:
        crossing(make_runner(path, "float32", 64), args.rows, args.repeats)
        return
    tokens = max([*args.batches, 1]) * (args.prompt_len + args.steps) + 16
    tokens = max(tokens, args.prefill_prompts * args.prompt_len + 16)
    runners = {d: make_runner(path, d, tokens) for d in args.dtypes}
    if args.batches:
        decode(runners, args.batches, args.prompt_len, args.steps)
    if args.prefill_prompts:
        prefill(runners, args.prefill_prompts, args.prompt_len, args.rounds)


if __name__ == "__main__":
    main()
