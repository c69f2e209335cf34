"""One decode step of the worker, A/B, interleaved step by step (issue 18).

Two ModelRunners on the same model folder, differing in one switch, run the same decode
batches alternately (which goes first alternates too); per-step wall times, medians and
the ratio. The slot layout is the server's: each prompt's slots contiguous (one prefill),
then one slot per request per step, interleaved across the batch, as the scheduler's
allocator hands them out.

Switches (--ab):
- ``decode-kernel``: the C decode-attention kernel (kernels/cpu/decode_attention.py) vs the
  torch gather + SDPA path.
- ``cpu-gemm``: the small-M C linear kernel (kernels/cpu/gemm.py, rows < default_kernel_rows()) vs
  oneDNN (F.linear for single rows), both keeping the plain weights (``--cpu-linear hybrid``).
- ``mixed-decode``: with ``--mixed-prefill N``, steps that also carry a new N-token prompt
  (mixed batches): their one-row (decode) requests through the decode-attention kernel
  together vs with the other requests (one gather + SDPA each, as before; where the C
  extend kernel runs, in its one call with the prompt's rows).
- ``extend-split``: not a decode step but a prefill: --prefill-prompts prompts of
  --prompt-len tokens in one batch, run as groups of at most CPU_EXTEND_ROWS rows
  (services/worker/models/llama.py) vs as one forward; prefill tokens/s per round.
- ``elementwise``: the fused C rotary and silu(gate) * up passes (kernels/cpu/elementwise.py,
  ``layers.FUSED_ELEMENTWISE``) vs torch's op chains, switched per forward call: first
  prefill tokens/s (--prefill-prompts x --prompt-len, --rounds), then the decode steps.
- ``extend-kernel``: the C extend-attention kernel (kernels/cpu/extend_attention.py) vs one
  SDPA per request (its ``supports`` made False per forward call): prefill tokens/s only.
- ``rows-kernel``: with ``--verify K`` (each step a speculative verify step: the request's
  token and K drafts, all accepted), attention through the decode kernel's rows entry
  (``decode_attention.load_rows``) vs the extend kernel.
- ``verify-step``: verify steps with ``--verify K`` drafts (A) vs plain decode steps (B):
  what a verify step costs in decode steps (forward only, nothing rejected).

    M=~/.cache/radixserve-peers/models/small
    .venv/bin/python bench/bench_decode_step.py --model-path $M --batches 16 64 --steps 64
    .venv/bin/python bench/bench_decode_step.py --model-path $M --ab extend-split \
        --prefill-prompts 8 --prompt-len 1000 --rounds 4
    .venv/bin/python bench/bench_decode_step.py --model-path $M --ab elementwise \
        --prefill-prompts 2 --prompt-len 1000 --rounds 4 --batches 16 --steps 32
    .venv/bin/python bench/bench_decode_step.py --model-path $M --ab extend-kernel \
        --prefill-prompts 8 --prompt-len 1000 --rounds 6
    Z=services/common/default_model/radixserve-zen
    .venv/bin/python bench/bench_decode_step.py --model-path $Z --ab verify-step --verify 4 \
        --batches 1 16 --prompt-len 300 --steps 40
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker import host_memory  # noqa: E402

host_memory.tune()  # as the worker process does, before torch loads: malloc keeps activations

import torch  # noqa: E402

from kernels.cpu import extend_attention as cpu_extend_attention  # noqa: E402
from radixserve.internal.v1 import engine_pb2  # noqa: E402
from services.common.config import WorkerConfig  # noqa: E402
from services.common.transport import pack_i32  # noqa: E402
from services.worker import layers, wire  # noqa: E402
from services.worker.attention.torch_backend import TorchBackend  # noqa: E402
from services.worker.cpu_linear import PackedLinear, default_kernel_rows  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import llama  # noqa: E402


def batches(
    prompts: list[list[int]], steps: int, mixed: int = 0, verify: int = 0
) -> list[engine_pb2.ForwardBatch]:
    """[prefill, decode 0, decode 1, ...] with the server's slot layout. ``mixed`` > 0: each
    step also carries a new prompt of that many tokens first (a mixed batch, as the
    scheduler builds while requests arrive), in the spare request row ``len(prompts)``.
    ``verify`` > 0: each request carries that many drafts, all taken (1 + verify slots)."""
    b = len(prompts)
    prefill = engine_pb2.ForwardBatch()
    nxt = 1
    for i, p in enumerate(prompts):
        prefill.reqs.add(
            req_slot=i,
            input_ids=pack_i32(p),
            prefix_len=0,
            out_slots=pack_i32(range(nxt, nxt + len(p))),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=0.0),
        )
        nxt += len(p)
    out = [prefill]
    rows = 1 + verify
    spare = nxt + steps * b * rows  # the mixed prompts' slots, after every decode slot
    for step in range(steps):
        batch = engine_pb2.ForwardBatch(batch_id=step + 1, is_decode=not (mixed or verify))
        if mixed:
            batch.reqs.add(
                req_slot=b,
                input_ids=pack_i32([7 + (step + i) % 50 for i in range(mixed)]),
                prefix_len=0,
                out_slots=pack_i32(range(spare + step * mixed, spare + (step + 1) * mixed)),
                is_new=True,
                sample=True,
                sampling=engine_pb2.SamplingParams(temperature=0.0),
            )
        for i, p in enumerate(prompts):
            first = nxt + (step * b + i) * rows
            batch.reqs.add(
                req_slot=i,
                input_ids=pack_i32([5]),
                prefix_len=len(p) + step * rows,
                out_slots=pack_i32(range(first, first + rows)),
                sample=True,
                draft_tokens=pack_i32([6 + (step + j) % 50 for j in range(verify)]),
            )
        out.append(batch)
    return out


def runner(path: str, tokens: int, make: Callable[[], AbstractContextManager]) -> ModelRunner:
    cfg = WorkerConfig(
        model_path=path, device="cpu", dtype="float32", max_total_tokens=tokens,
        max_running_requests=65,  # 64 streams + the spare row of --mixed-prefill
    )  # fmt: skip
    with make():
        return ModelRunner(cfg)


def prefill_rates(
    path: str, prompts: int, length: int, rounds: int,
    sides: dict[str, Callable[[], AbstractContextManager]],
) -> dict[str, list[float]]:  # fmt: skip
    """Prefill tokens/s of one batch of ``prompts`` new prompts per side and round, the
    sides interleaved (which goes first alternates); round 0 warms up."""
    r = runner(path, prompts * length + 16, nullcontext)
    rng = random.Random(0)
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(rounds + 1):
        for side in sides if i % 2 else reversed(sides):
            texts = [
                [rng.randrange(3, r.vocab_size) for _ in range(length)] for _ in range(prompts)
            ]
            with sides[side]():
                start = time.perf_counter()
                wire.forward(r, batches(texts, 0)[0])
                if i:
                    rates[side].append(prompts * length / (time.perf_counter() - start))
    return rates


def prefill_split(path: str, prompts: int, length: int, rounds: int) -> None:
    """Prefill tokens/s of one batch of ``prompts`` prompts, split vs whole, interleaved."""
    caps = {"split": llama.CPU_EXTEND_ROWS, "whole": 1 << 40}
    rates = prefill_rates(path, prompts, length, rounds, {
        side: functools.partial(mock.patch.object, llama, "CPU_EXTEND_ROWS", cap)
        for side, cap in caps.items()
    })  # fmt: skip
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{prompts} x {length}-token prompts in one batch, {torch.get_num_threads()} threads, "
          f"groups of <= {caps['split']} rows vs one forward; prefill tokens/s")  # fmt: skip
    pairs = zip(rates["split"], rates["whole"], strict=True)
    print(f"split {med['split']:,.0f}, whole {med['whole']:,.0f}, "
          f"split / whole {med['split'] / med['whole']:.2f}x; rounds (split / whole): "
          + ", ".join(f"{a:,.0f} / {b:,.0f}" for a, b in pairs))  # fmt: skip


def _hybrid(kernel: bool) -> AbstractContextManager:
    """Every PackedLinear keeps its plain weight (as --cpu-linear hybrid), C kernel or not."""
    init = PackedLinear.__init__
    rows = default_kernel_rows() if kernel else 0

    def patched(self, weight, bias=None, **kw) -> None:
        init(self, weight, bias, **{**kw, "keep_plain": True, "kernel_rows": rows})

    return mock.patch.object(PackedLinear, "__init__", patched)


def _no_mixed_decode_kernel() -> AbstractContextManager:
    """Backends built inside run each one-row request of a mixed batch alone, as before
    (the switch must hold per instance: forward runs after the runner is built)."""
    init = TorchBackend.__init__

    def patched(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self._single_rows = lambda meta, qo: None

    return mock.patch.object(TorchBackend, "__init__", patched)


def _no_rows_kernel() -> AbstractContextManager:
    """Backends built inside send every extend to the extend kernel, as before."""
    init = TorchBackend.__init__

    def patched(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self._rows_kernel = None

    return mock.patch.object(TorchBackend, "__init__", patched)


SWITCHES: dict[
    str, tuple[Callable[[], AbstractContextManager], Callable[[], AbstractContextManager]]
] = {
    "decode-kernel": (
        nullcontext,
        lambda: mock.patch.object(TorchBackend, "use_cpu_kernel", False),
    ),
    "cpu-gemm": (lambda: _hybrid(True), lambda: _hybrid(False)),
    "mixed-decode": (nullcontext, lambda: _no_mixed_decode_kernel()),
    "extend-split": (nullcontext, nullcontext),  # prefill_split() patches per call
    "elementwise": (nullcontext, nullcontext),  # PER_CALL
    "extend-kernel": (nullcontext, nullcontext),  # PER_CALL
    "rows-kernel": (nullcontext, lambda: _no_rows_kernel()),
    "verify-step": (nullcontext, nullcontext),  # side B's steps carry no drafts
}


def _fused(on: bool) -> AbstractContextManager:
    return mock.patch.object(layers, "FUSED_ELEMENTWISE", on)


# Switches read at every forward, not when the runner is built: (A, B) around each call.
PER_CALL: dict[str, tuple[Callable[[], AbstractContextManager], ...]] = {
    "elementwise": (lambda: _fused(True), lambda: _fused(False)),
    "extend-kernel": (
        nullcontext,
        lambda: mock.patch.object(cpu_extend_attention, "supports", lambda *a: False),
    ),
}


def prefill_per_call(switch: str, path: str, prompts: int, length: int, rounds: int) -> None:
    on, off = PER_CALL[switch]
    rates = prefill_rates(path, prompts, length, rounds, {"A": on, "B": off})
    med = {k: statistics.median(v) for k, v in rates.items()}
    pairs = zip(rates["A"], rates["B"], strict=True)
    print(f"prefill {prompts} x {length} tokens, {torch.get_num_threads()} threads, tokens/s: "
          f"{switch} on (A) {med['A']:,.0f}, off (B) {med['B']:,.0f}, "
          f"A / B {med['A'] / med['B']:.2f}x; rounds (A / B): "
          + ", ".join(f"{a:,.0f} / {b:,.0f}" for a, b in pairs))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--ab", choices=sorted(SWITCHES), default="decode-kernel")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=288)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill-prompts", type=int, default=8, help="extend-split: prompts")
    ap.add_argument("--rounds", type=int, default=4, help="extend-split: rounds")
    ap.add_argument(
        "--mixed-prefill", type=int, default=0, help="a new prompt of N tokens in every step"
    )
    ap.add_argument("--verify", type=int, default=0, help="drafts per request in every step")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ab == "extend-split":
        prefill_split(args.model_path, args.prefill_prompts, args.prompt_len, args.rounds)
        return
    if args.ab in ("elementwise", "extend-kernel"):
        prefill_per_call(args.ab, args.model_path, args.prefill_prompts, args.prompt_len,
                         args.rounds)  # fmt: skip
    if args.ab == "extend-kernel":  # decode steps do not run it
        return
    tokens = max(args.batches) * (args.prompt_len + args.steps * (1 + args.verify)) + 16
    tokens += args.steps * args.mixed_prefill
    on, off = SWITCHES[args.ab]
    sides = {"A": runner(args.model_path, tokens, on), "B": runner(args.model_path, tokens, off)}
    calls = dict(zip(sides, PER_CALL.get(args.ab, (nullcontext, nullcontext)), strict=True))
    rng = random.Random(0)
    print(f"A/B: {args.ab} on (A) / off (B); {torch.get_num_threads()} threads; "
          f"prompts {args.prompt_len} tokens; {args.steps} steps; {args.verify} drafts; "
          "medians of per-step wall ms")  # fmt: skip
    print("| decode batch | A ms/step | B ms/step | A tok/s | B tok/s | A / B speed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in args.batches:
        vocab = sides["A"].vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
        drafts = {"A": args.verify, "B": 0 if args.ab == "verify-step" else args.verify}
        todo = {s: batches(prompts, args.steps, args.mixed_prefill, drafts[s]) for s in sides}
        for s, r in sides.items():
            with calls[s]():
                wire.forward(r, todo[s][0])
        times: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(1, args.steps + 1):
            order = list(sides) if i % 2 else list(reversed(sides))
            for s in order:
                with calls[s]():
                    start = time.perf_counter()
                    wire.forward(sides[s], todo[s][i])
                times[s].append(time.perf_counter() - start)
        ms = {s: statistics.median(t[1:]) * 1e3 for s, t in times.items()}
        print(f"| {b} | {ms['A']:.1f} | {ms['B']:.1f} | {b / ms['A'] * 1e3:,.0f} | "
              f"{b / ms['B'] * 1e3:,.0f} | {ms['B'] / ms['A']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
