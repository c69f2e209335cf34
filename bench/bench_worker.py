"""Worker benchmark: radixserve's ModelRunner, packed and plain linears, beside
transformers' generate, same run.

A ~30M-parameter Llama-shaped model with random weights (float32, CPU), or any model
folder (--model-path, e.g. bench/peers/make_model.py's qwen-0.5b):
- prefill tokens/s of one 1,024-token prompt;
- decode tokens/s at batch 1, 16 and 64 (prompts of mixed length; HF pads the batch);
- the share of a batch-64 decode step spent outside the linear layers' matrix products.

Two runners side by side: linears packed for oneDNN (the CPU default, --cpu-linear
packed) and plain F.linear (--cpu-linear plain). All sides run interleaved; medians of
--repeats runs. Prints a markdown table for docs/benchmarks.md ("## Worker and CPU kernels").

    .venv/bin/python bench/bench_worker.py [--quick] [--model-path M] [--no-hf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.internal.v1 import engine_pb2  # noqa: E402
from services.common.config import WorkerConfig  # noqa: E402
from services.common.transport import pack_i32  # noqa: E402
from services.worker import wire  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.offline import generate  # noqa: E402

MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model(folder: Path) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    model.save_pretrained(folder)
    return model


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median of what each fn returns (seconds), runs interleaved (the order rotating each
    round) so that load from other processes hits every side alike."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(fns[n]())
    return {n: statistics.median(t) for n, t in times.items()}


def wall(fn):
    """fn as a function returning the seconds it took."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def hf_generate(model, prompts: list[list[int]], new_tokens: int, stopping=None) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, what decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            stopping_criteria=stopping,
        )


def rs_generate(runner, prompts, new_tokens: int) -> None:
    generate(runner, prompts, new_tokens, stop_at_eos=False)


class _StepClock(transformers.StoppingCriteria):
    """Stamps the time after every token HF generates (it never stops generation)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class _TimedRunner:
    """A ModelRunner that stamps the time after every forward (what offline.generate calls,
    through wire.forward: a Batch in, a ForwardOutput out)."""

    def __init__(self, runner):
        self.runner, self.stamps = runner, []

    def info(self):
        return self.runner.info()

    def forward(self, batch):
        result = self.runner.forward(batch)
        self.stamps.append(time.perf_counter())
        return result


def decode_seconds_hf(hf, prompts, new_tokens: int) -> float:
    """From the first generated token to the last: the decode steps alone."""
    clock = _StepClock()
    hf_generate(hf, prompts, new_tokens, stopping=transformers.StoppingCriteriaList([clock]))
    return clock.stamps[-1] - clock.stamps[0]


def decode_seconds_rs(runner, prompts, new_tokens: int) -> float:
    timed_runner = _TimedRunner(runner)
    rs_generate(timed_runner, prompts, new_tokens)
    return timed_runner.stamps[-1] - timed_runner.stamps[0]


def sides(runners: dict, hf, prompts, new_tokens: int, decode: bool) -> dict:
    """One timing function per side: the decode steps (decode) or the whole 1-token run."""
    fns = {}
    for name, runner in runners.items():
        if decode:
            fns[name] = lambda r=runner: decode_seconds_rs(r, prompts, new_tokens)
        else:
            fns[name] = wall(lambda r=runner: rs_generate(r, prompts, 1))
    if hf is not None:
        if decode:
            fns["transformers"] = lambda: decode_seconds_hf(hf, prompts, new_tokens)
        else:
            fns["transformers"] = wall(lambda: hf_generate(hf, prompts, 1))
    return fns


def decode_batches(runner, prompts: list[list[int]], steps: int) -> list[engine_pb2.ForwardBatch]:
    """Prefills ``prompts`` (rows 0..B-1) and returns ``steps`` consecutive decode batches."""
    prefill = engine_pb2.ForwardBatch()
    span = max(len(p) for p in prompts) + steps + 1
    for i, p in enumerate(prompts):
        prefill.reqs.add(
            req_slot=i,
            input_ids=pack_i32(p),
            prefix_len=0,
            out_slots=pack_i32(range(1 + i * span, 1 + i * span + len(p))),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=0.0),
        )
    wire.forward(runner, prefill)
    batches = []
    for step in range(steps):
        batch = engine_pb2.ForwardBatch(batch_id=step, is_decode=True)
        for i, p in enumerate(prompts):
            pos = len(p) + step
            batch.reqs.add(
                req_slot=i,
                input_ids=pack_i32([5]),
                prefix_len=pos,
                out_slots=pack_i32([1 + i * span + pos]),
                sample=True,
            )
        batches.append(batch)
    return batches


def outside_matmul_share(runner, prompts, steps: int) -> tuple[float, float]:
    """(share outside the linear layers' GEMMs, share outside all matrix products) of the
    wall time of ``steps`` decode steps, from torch.profiler's per-op times."""
    from torch.profiler import ProfilerActivity, profile

    batches = decode_batches(runner, prompts, steps)
    wire.forward(runner, batches[0])  # warm-up (the same positions are simply rewritten)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for batch in batches:
            wire.forward(runner, batch)
        total_us = (time.perf_counter() - start) * 1e6
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    linear_ops = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
    linear = sum(ops.get(k, 0) for k in linear_ops)
    attention = sum(v for k, v in ops.items() if "scaled_dot_product" in k or k == "aten::bmm")
    return 1 - linear / total_us, 1 - (linear + attention) / total_us


def per_step(path: str, batches: list[int], steps: int) -> None:
    """One decode step timed alone: packed, hybrid and plain runners interleaved step by
    step (the steadiest comparison on a loaded machine); medians over the steps."""
    runners = {c: make_runner(path, c) for c in ("packed", "hybrid", "plain")}
    rng = random.Random(0)
    print("| decode batch | packed tok/s | hybrid tok/s | plain tok/s | packed / plain |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        vocab = runners["plain"].vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(b)]
        todo = {c: decode_batches(r, prompts, steps) for c, r in runners.items()}
        times: dict[str, list[float]] = {c: [] for c in runners}
        for i in range(steps):
            for c, r in runners.items():
                start = time.perf_counter()
                wire.forward(r, todo[c][i])
                times[c].append(time.perf_counter() - start)
        rate = {c: b / statistics.median(t[1:]) for c, t in times.items()}
        print(
            f"| {b} | {rate['packed']:,.0f} | {rate['hybrid']:,.0f} | {rate['plain']:,.0f} "
            f"| {rate['packed'] / rate['plain']:.2f}x |",
            flush=True,
        )


def make_runner(path: str, cpu_linear: str) -> ModelRunner:
    cfg = WorkerConfig(
        model_path=path,
        device="cpu",
        dtype="float32",
        max_total_tokens=16384,
        max_running_requests=64,
        cpu_linear=cpu_linear,
    )
    return ModelRunner(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--model-path", default="", help="a model folder (default: a random Llama)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument(
        "--no-profile", action="store_true", help="skip the outside-GEMM share (batch 64)"
    )
    ap.add_argument("--per-step", action="store_true", help="per-step decode table only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.per_step:
        if not args.model_path:
            ap.error("--per-step needs --model-path")
        per_step(args.model_path, args.batches, 1 + (8 if args.quick else args.new_tokens))
        return
    repeats = 1 if args.quick else args.repeats
    new_tokens = 12 if args.quick else args.new_tokens
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or tmp
        hf = None
        if not args.model_path:
            hf = build_model(Path(tmp))
        elif not args.no_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            hf.eval()
        if args.no_hf:
            hf = None
        runners = {c: make_runner(path, c) for c in ("packed", "plain")}
        vocab = runners["packed"].vocab_size
        n_params = runners["packed"].num_parameters
        long_prompt = [rng.randrange(3, vocab) for _ in range(1024)]
        secs = interleaved(sides(runners, hf, [long_prompt], 1, decode=False), repeats)
        rows.append(("prefill, 1 x 1,024 tokens", {n: 1024 / t for n, t in secs.items()}))
        for b in args.batches:
            prompts = [
                [rng.randrange(3, vocab) for _ in range(rng.randrange(48, 81))] for _ in range(b)
            ]
            secs = interleaved(sides(runners, hf, prompts, new_tokens, decode=True), repeats)
            tokens = b * (new_tokens - 1)
            rows.append((f"decode, batch {b}", {n: tokens / t for n, t in secs.items()}))
        prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(64)]
        shares = {
            c: outside_matmul_share(r, prompts, new_tokens)
            for c, r in runners.items()
            if not args.no_profile
        }
    print(
        f"model: {Path(path).name if args.model_path else 'random Llama'}, "
        f"{n_params / 1e6:.1f}M parameters, float32, CPU threads {torch.get_num_threads()}"
    )
    print(f"{new_tokens} new tokens per request, median of {repeats}\n")
    print_table(rows, hf is not None)
    for c, (share_lin, share_all) in shares.items():
        print(
            f"\n{c}: decode batch 64 (prompts of 64 tokens): {share_lin:.0%} of a step's wall "
            f"time outside the linear layers' GEMMs, {share_all:.0%} outside them and attention"
        )


def print_table(rows: list[tuple[str, dict[str, float]]], with_hf: bool) -> None:
    head = "| workload | packed tok/s | plain tok/s | packed / plain |"
    rule = "|---|---:|---:|---:|"
    if with_hf:
        head += " transformers tok/s | packed / transformers |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    for name, r in rows:
        line = (
            f"| {name} | {r['packed']:,.0f} | {r['plain']:,.0f} | {r['packed'] / r['plain']:.2f}x |"
        )
        if with_hf:
            hf = r["transformers"]
            line += f" {hf:,.0f} | {r['packed'] / hf:.2f}x |"
        print(line)


if __name__ == "__main__":
    main()
