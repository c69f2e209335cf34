"""Worker benchmark: radixserve's ModelRunner beside transformers' generate, same run.

A ~30M-parameter Llama-shaped model with random weights (float32, CPU):
- prefill tokens/s of one 1,024-token prompt;
- decode tokens/s at batch 1, 16 and 64 (prompts of mixed length; HF pads the batch);
- the share of a batch-64 decode step spent outside the linear layers' matrix products.

Medians of --repeats runs. Prints a markdown table for docs/benchmarks.md ("## Worker").

    .venv/bin/python bench/bench_worker.py [--quick]
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


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Median seconds of fn_a and fn_b, runs interleaved so that load from other processes
    hits both alike."""
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, a), (fn_b, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


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


def decode_rates(runner, hf, prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    """Decode tokens/s (radixserve, transformers), timing the decode steps inside each run."""
    rs, ref = [], []
    for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
        rs.append(decode_seconds_rs(runner, prompts, new_tokens))
        ref.append(decode_seconds_hf(hf, prompts, new_tokens))
    tokens = len(prompts) * (new_tokens - 1)
    return tokens / statistics.median(rs), tokens / statistics.median(ref)


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
    linear = ops.get("aten::mm", 0) + ops.get("aten::addmm", 0)
    attention = sum(v for k, v in ops.items() if "scaled_dot_product" in k or k == "aten::bmm")
    return 1 - linear / total_us, 1 - (linear + attention) / total_us


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    new_tokens = 12 if args.quick else args.new_tokens
    batches = [1, 16, 64]
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(Path(tmp))
        n_params = sum(p.numel() for p in hf.parameters())
        runner = ModelRunner(
            WorkerConfig(
                model_path=tmp,
                device="cpu",
                dtype="float32",
                max_total_tokens=16384,
                max_running_requests=64,
            )
        )
        long_prompt = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(1024)]
        t_rs, t_hf = timed_pair(
            lambda: rs_generate(runner, [long_prompt], 1),
            lambda: hf_generate(hf, [long_prompt], 1),
            repeats,
        )
        rows.append(("prefill, 1 x 1,024 tokens", 1024 / t_rs, 1024 / t_hf))
        for b in batches:
            prompts = [
                [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(48, 81))]
                for _ in range(b)
            ]
            rs, ref = decode_rates(runner, hf, prompts, new_tokens, repeats)
            rows.append((f"decode, batch {b}", rs, ref))
        prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(64)] for _ in range(64)]
        share_lin, share_all = outside_matmul_share(runner, prompts, new_tokens)
    print(
        f"model: Llama-shaped, {n_params / 1e6:.1f}M parameters, float32, "
        f"CPU threads {torch.get_num_threads()}"
    )
    print(f"{new_tokens} new tokens per request, median of {repeats}\n")
    print("| workload | radixserve tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for name, rs, ref in rows:
        print(f"| {name} | {rs:,.0f} | {ref:,.0f} | {rs / ref:.2f}x |")
    print(
        f"\ndecode batch 64 (prompts of 64 tokens): {share_lin:.0%} of a step's wall time "
        f"outside the linear layers' GEMMs, {share_all:.0%} outside them and the attention kernel"
    )


if __name__ == "__main__":
    main()
