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

from services.common.config import WorkerConfig  # noqa: E402
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


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):   # left padding, what decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=True, pad_token_id=0,
        )


def rs_generate(runner, prompts, new_tokens: int) -> None:
    generate(runner, prompts, new_tokens, stop_at_eos=False)


def decode_rate(run, model_or_runner, prompts, new_tokens: int, repeats: int) -> float:
    """Tokens/s of the decode steps alone: (full run - prefill-only run)."""
    full = timed(lambda: run(model_or_runner, prompts, new_tokens), repeats)
    prefill = timed(lambda: run(model_or_runner, prompts, 1), repeats)
    return len(prompts) * (new_tokens - 1) / max(full - prefill, 1e-9)


def outside_matmul_share(runner, prompts, new_tokens: int) -> tuple[float, float]:
    """(share outside linear-layer GEMMs, share outside all matmuls) of decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        rs_generate(runner, prompts, new_tokens)
        total = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof_prefill:
        start = time.perf_counter()
        rs_generate(runner, prompts, 1)
        total_prefill = time.perf_counter() - start

    def gemm_us(p, names):
        return sum(e.self_cpu_time_total for e in p.key_averages() if e.key in names)

    linear = ("aten::mm", "aten::addmm")
    every = linear + ("aten::bmm",)
    decode_time = (total - total_prefill) * 1e6
    lin = gemm_us(prof, linear) - gemm_us(prof_prefill, linear)
    allm = gemm_us(prof, every) - gemm_us(prof_prefill, every)
    return 1 - lin / decode_time, 1 - allm / decode_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    new_tokens = 12 if args.quick else args.new_tokens
    batches = [1, 16, 64]
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(Path(tmp))
        n_params = sum(p.numel() for p in hf.parameters())
        runner = ModelRunner(
            WorkerConfig(model_path=tmp, device="cpu", dtype="float32", max_total_tokens=16384, max_running_requests=64)
        )
        long_prompt = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(1024)]
        t_hf = timed(lambda: hf_generate(hf, [long_prompt], 1), repeats)
        t_rs = timed(lambda: rs_generate(runner, [long_prompt], 1), repeats)
        rows.append(("prefill, 1 x 1,024 tokens", 1024 / t_rs, 1024 / t_hf))
        for b in batches:
            prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(48, 81))] for _ in range(b)]
            rs = decode_rate(rs_generate, runner, prompts, new_tokens, repeats)
            ref = decode_rate(hf_generate, hf, prompts, new_tokens, repeats)
            rows.append((f"decode, batch {b}", rs, ref))
        prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(64)] for _ in range(64)]
        share_lin, share_all = outside_matmul_share(runner, prompts, new_tokens)
    print(f"model: Llama-shaped, {n_params / 1e6:.1f}M parameters, float32, CPU threads {torch.get_num_threads()}")
    print(f"{new_tokens} new tokens per request, median of {repeats}\n")
    print("| workload | radixserve tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for name, rs, ref in rows:
        print(f"| {name} | {rs:,.0f} | {ref:,.0f} | {rs / ref:.2f}x |")
    print(f"\ndecode batch 64: {share_lin:.0%} of the step outside the linear layers' GEMMs "
          f"({share_all:.0%} outside all matrix products incl. attention)")


if __name__ == "__main__":
    main()
