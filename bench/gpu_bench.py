"""GPU check of the Triton kernels, the model path and CUDA-graph decode: the bench steps of
bench/gpu_check.sh (model, kernels, awq, profile, tokens: bench/gpu_plan.py), each row printed
as it is measured (bench/gpu_rows.py). On a CUDA machine with torch, triton and transformers:

    python3 bench/gpu_bench.py [--only model,kernels] [--peak-tbps 4.8] [--budget-s 220]

Rows:
  * decode attention, 64 requests x 4,096 tokens of context, 32 q / 8 kv heads, D=128, bf16:
    bytes of K+V read / median time, against the device's peak memory bandwidth (target
    >= 70 %), with the backend's split count, a sweep of splits x BLOCK_N, and shuffled slots;
  * extend attention vs torch SDPA (flash, is_causal) on the same contiguous shapes
    (target >= 0.6x SDPA's speed);
  * a random-weight Llama end to end through ModelRunner: decode tokens/s with CUDA graphs
    on and off, at batch 1 and batch 32;
  * on the same model, a speculative verify step (1 + 4 rows a request) against a decode step
    of the same requests: its time and its token (must be the decode step's).
Every section is guarded: a failure or an exhausted time budget becomes a row saying so.
Progress goes to stderr, rows to stdout (and to $GPU_CHECK_ROWS); exit 1 if a row FAILs.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.gpu_plan import BENCH_STEPS, BY_NAME  # noqa: E402
from bench.gpu_rows import emit  # noqa: E402

# Peak HBM bandwidth in TB/s by device name; the first matching fragment wins (so the more
# specific names come first: "GH200" before "H200", "H100 PCIe" before "H100").
PEAK_TBPS = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.04),
    ("A100 80GB PCIe", 1.94),
    ("A100", 1.56),
    ("A800", 2.04),
    ("L40S", 0.864),
    ("L40", 0.864),
    ("A10G", 0.6),
    ("A10", 0.6),
    ("L4", 0.3),
    ("RTX 4090", 1.01),
    ("RTX 3090", 0.936),
    ("T4", 0.32),
]


@dataclass(frozen=True)
class Sizes:
    """The measured shapes; --smoke shrinks them to exercise this script on a CPU."""

    device: str = "cuda"
    decode: tuple[int, int, int, int, int] = (64, 4096, 32, 8, 128)  # B, context, Hq, Hkv, D
    extend: tuple[int, int, int, int, int] = (8, 2048, 32, 8, 128)  # B, length, Hq, Hkv, D
    model: dict = field(
        default_factory=lambda: dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
        )
    )
    model_batches: tuple[int, ...] = (1, 32)
    prompt_len: int = 128
    new_tokens: int = 64
    dtype: torch.dtype = torch.bfloat16


SMOKE = Sizes(
    device="cpu",
    decode=(3, 40, 4, 2, 32),
    extend=(2, 40, 4, 2, 32),
    model=dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    model_batches=(2,),
    prompt_len=8,
    new_tokens=4,
    dtype=torch.float32,
)


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Table:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, check: str, measured: str, target: str = "", verdict: str = "") -> None:
        self.rows.append((check, measured, target, verdict))
        emit(check, measured, target, verdict)  # printed now: a kill later keeps it


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def peak_bandwidth(name: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-tbps"
    for fragment, tbps in PEAK_TBPS:
        if fragment.lower() in name.lower():
            return tbps, f"table ({fragment})"
    return None, "unknown device: pass --peak-tbps"


def time_ms(fn) -> float:
    """Median milliseconds of fn() (triton's do_bench: warm-up, L2 flushed between runs)."""
    if not torch.cuda.is_available():  # --smoke on a CPU: a rough figure is all it needs
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


# ---- decode attention ---------------------------------------------------------------------


def bench_decode(table: Table, sizes: Sizes, peak: float | None, budget: Budget) -> None:
    from kernels.triton.decode_attention import decode_attention, decode_attention_ref
    from services.worker.attention.triton_backend import choose_num_kv_splits

    dev, dtype = torch.device(sizes.device), sizes.dtype
    b, ctx, hq, hkv, d = sizes.decode
    n = b * ctx
    k_pool = torch.randn(n + 1, hkv, d, dtype=dtype, device=dev)
    v_pool = torch.randn(n + 1, hkv, d, dtype=dtype, device=dev)
    q = torch.randn(b, hq, d, dtype=dtype, device=dev)
    # The request-to-slot table as the kernels read it: request i in row i.
    rows = torch.arange(b, dtype=torch.int32, device=dev)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    contiguous = torch.arange(1, n + 1, device=dev).view(b, ctx).int()  # req_to_token
    shuffled = (torch.randperm(n, device=dev) + 1).view(b, ctx).int()
    scale = d**-0.5
    nbytes = 2 * n * hkv * d * dtype.itemsize  # every K and V row read once
    default_splits = choose_num_kv_splits(b, hkv, dev)

    def run(req_to_token, splits, block_n=None):
        return lambda: decode_attention(
            q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, splits, block_n=block_n
        )

    out = run(shuffled, default_splits)()
    ref = decode_attention_ref(q, k_pool, v_pool, shuffled, rows, seq_lens, scale)
    err = (out.float() - ref.float()).abs().max().item()
    table.add(
        f"decode: max abs error vs reference ({dtype})", f"{err:.2e}", "< 2e-2", verdict(err < 2e-2)
    )

    def report(label: str, ms: float, target: bool) -> None:
        tbps = nbytes / (ms * 1e-3) / 1e12
        share = f" = {100 * tbps / peak:.0f}% of {peak} TB/s" if peak else ""
        ok = peak is not None and tbps >= 0.7 * peak
        target = target and sizes.device == "cuda"  # --smoke: the figure means nothing
        table.add(
            label,
            f"{ms * 1e3:.0f} us, {tbps:.2f} TB/s{share}",
            ">= 70% of peak" if target else "info",
            verdict(ok) if target else "",
        )

    shape = f"{b} x {ctx} ctx, {hq}q/{hkv}kv heads, D={d}, {dtype}"
    report(
        f"decode attention ({shape}; backend default: {default_splits} splits, contiguous slots)",
        time_ms(run(contiguous, default_splits)),
        target=True,
    )
    report(
        f"decode attention, shuffled slots ({default_splits} splits)",
        time_ms(run(shuffled, default_splits)),
        target=False,
    )
    best = None
    sweep = (
        []
        if sizes.device != "cuda"
        else [
            (splits, block_n)
            for splits in sorted({4, 8, 16, default_splits})
            for block_n in (32, 64, 128)
        ]
    )
    for splits, block_n in sweep:
        if budget.left() < 10:  # the step's own budget: leave the later steps their time
            table.add("decode sweep", "stopped early: time budget", "", "")
            break
        ms = time_ms(run(contiguous, splits, block_n))
        if best is None or ms < best[0]:
            best = (ms, splits, block_n)
    if best:
        report(
            f"decode attention, best of sweep ({best[1]} splits, BLOCK_N={best[2]})",
            best[0],
            target=False,
        )


# ---- extend attention ---------------------------------------------------------------------


def sdpa_baseline(q4, k4, v4):
    """(fn, description): causal SDPA, flash backend preferred, GQA native when supported.

    Tries flash with enable_gqa, flash with K/V repeated to every query head, then whatever
    backend torch picks; the description says which one ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = q4.shape[1] // k4.shape[1]
    k_rep, v_rep = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    candidates = [
        ("flash, enable_gqa", [SDPBackend.FLASH_ATTENTION], k4, v4, True),
        ("flash, K/V repeated", [SDPBackend.FLASH_ATTENTION], k_rep, v_rep, False),
        (
            "torch's choice, K/V repeated",
            [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            k_rep,
            v_rep,
            False,
        ),
    ]
    for how, backends, k, v, gqa in candidates:

        def fn(k=k, v=v, backends=backends, gqa=gqa):
            with sdpa_kernel(backends):
                return sdpa(q4, k, v, is_causal=True, enable_gqa=gqa)

        try:
            fn()
            return fn, how
        except RuntimeError as e:
            log(f"SDPA {how} unavailable: {str(e).splitlines()[0][:120]}")
    raise RuntimeError("no SDPA backend ran")


def bench_extend(table: Table, sizes: Sizes) -> None:
    from kernels.triton.extend_attention import extend_attention

    dev, dtype = torch.device(sizes.device), sizes.dtype
    b, length, hq, hkv, d = sizes.extend
    t = b * length
    q4 = torch.randn(b, hq, length, d, dtype=dtype, device=dev)  # q4: [B, Hq, L, D]
    k4 = torch.randn(b, hkv, length, d, dtype=dtype, device=dev)  # k4: [B, Hkv, L, D]
    v4 = torch.randn(b, hkv, length, d, dtype=dtype, device=dev)
    # The same tensors as the kernel sees them: rows of all requests, pool slot = 1 + row.
    q = q4.transpose(1, 2).reshape(t, hq, d).contiguous()  # q: [T, Hq, D]
    pad = torch.zeros(1, hkv, d, dtype=dtype, device=dev)
    k_pool = torch.cat([pad, k4.transpose(1, 2).reshape(t, hkv, d)])  # [T+1, Hkv, D]
    v_pool = torch.cat([pad, v4.transpose(1, 2).reshape(t, hkv, d)])
    indptr = (torch.arange(b + 1, device=dev) * length).int()
    req_to_token = torch.arange(1, t + 1, device=dev).view(b, length).int()  # request i: row i
    rows = torch.arange(b, dtype=torch.int32, device=dev)
    prefix = torch.zeros(b, dtype=torch.int32, device=dev)
    scale = d**-0.5

    def ours():
        return extend_attention(
            q, k_pool, v_pool, indptr, req_to_token, rows, prefix, scale, length
        )

    sdpa, how = sdpa_baseline(q4, k4, v4)
    err = (ours().float() - sdpa().transpose(1, 2).reshape(t, hq, d).float()).abs().max().item()
    table.add(
        f"extend: max abs error vs SDPA ({dtype})", f"{err:.2e}", "< 3e-2", verdict(err < 3e-2)
    )
    ms_ours, ms_sdpa = time_ms(ours), time_ms(sdpa)
    flops = 4 * b * hq * d * length * length / 2  # causal: half of QK^T and PV
    ratio = ms_sdpa / ms_ours
    table.add(
        f"extend attention vs SDPA ({b} x {length} causal, {hq}q/{hkv}kv, D={d}, {dtype}; {how})",
        f"ours {ms_ours * 1e3:.0f} us ({flops / ms_ours / 1e9:.0f} TFLOP/s), "
        f"SDPA {ms_sdpa * 1e3:.0f} us ({flops / ms_sdpa / 1e9:.0f} TFLOP/s): {ratio:.2f}x",
        ">= 0.6x",
        verdict(ratio >= 0.6) if sizes.device == "cuda" else "",
    )


# ---- AWQ ------------------------------------------------------------------------------------


def bench_awq(table: Table, budget: Budget) -> None:
    """bench/gpu_awq.py's rows: accuracy, M = 1/16/64/2,048 vs fp16 matmul (decode >= 2x)."""
    from bench.gpu_awq import awq_rows

    for r in awq_rows(max(budget.left() - 10, 5.0)):
        ok = r["pass"]
        table.add(r["name"], r["measured"], r["target"], verdict(ok) if ok is not None else "")


# ---- end to end -----------------------------------------------------------------------------


def build_model(folder: Path, sizes: Sizes) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **sizes.model,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(sizes.dtype)
    model.save_pretrained(folder, safe_serialization=True)


def decode_tokens_per_s(folder: Path, sizes: Sizes, graphs: bool, batch: int) -> tuple[float, bool]:
    """(decode tokens/s, whether the runner holds captured graphs). Prefill time is removed
    by also timing a 1-token generation: tokens/s = batch * (N - 1) / (t(N) - t(1))."""
    from bench.gpu_model_check import generate
    from services.common.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    prompt_len, new_tokens, vocab = sizes.prompt_len, sizes.new_tokens, sizes.model["vocab_size"]
    cfg = WorkerConfig(
        model_path=str(folder),
        device=sizes.device,
        dtype=str(sizes.dtype).removeprefix("torch."),
        attention_backend="triton",
        max_running_requests=batch,
        context_length=prompt_len + new_tokens + 8,
        max_total_tokens=batch * (prompt_len + new_tokens) + 16,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=batch,
    )
    runner = ModelRunner(cfg)
    captured = runner.graphs is not None and len(runner.graphs.graphs) > 0
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]

    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        generate(runner, prompts, n)
        sync()
        return time.perf_counter() - start

    timed(4)  # warm-up: compiles the kernels for these shapes
    t1, tn = timed(1), timed(new_tokens)
    return batch * (new_tokens - 1) / max(tn - t1, 1e-9), captured


def bench_model(table: Table, sizes: Sizes, budget: Budget) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        log(f"building a random-weight Llama {sizes.model}")
        build_model(folder, sizes)
        for batch in sizes.model_batches:
            speeds = {}
            for graphs in (False, True):
                if budget.left() < 25:
                    table.add(
                        f"model decode, batch {batch}, graphs {'on' if graphs else 'off'}",
                        "skipped: time budget",
                        "",
                        "",
                    )
                    continue
                tps, captured = decode_tokens_per_s(folder, sizes, graphs, batch)
                empty_cache()  # the runner (KV pool, graphs) is gone: give its memory back
                speeds[graphs] = tps
                note = "" if captured == graphs else f" (runner holds graphs: {captured})"
                mode = "on" if graphs else "off"
                table.add(
                    f"model decode tokens/s, batch {batch}, CUDA graphs {mode}",
                    f"{tps:,.0f} tok/s{note}",
                    "info",
                    "",
                )
            if len(speeds) == 2:
                table.add(
                    f"CUDA graph speed-up, batch {batch}",
                    f"{speeds[True] / speeds[False]:.2f}x",
                    "> 1x",
                    verdict(speeds[True] > speeds[False]) if sizes.device == "cuda" else "",
                )


VERIFY_K = 4  # drafts per request in the verify-step row (the server's default k)


def verify_vs_decode(
    folder: Path, sizes: Sizes, batch: int, steps: int
) -> tuple[float, float, bool]:
    """(plain decode step ms, verify step ms, same tokens): from one state, a decode step of
    every request and a verify step of 1 + VERIFY_K rows each (wrong drafts: each keeps only
    its own next token), each run ``steps`` times over the same KV slots; the verify step's
    token must be the decode step's (greedy)."""
    from bench.gpu_model_check import decode_batch, prefill_batch
    from services.common.config import WorkerConfig
    from services.worker.batch import Batch, ReqInput
    from services.worker.model_runner import ModelRunner

    n, vocab = sizes.prompt_len, sizes.model["vocab_size"]
    span = n + VERIFY_K + 2
    runner = ModelRunner(WorkerConfig(
        model_path=str(folder), device=sizes.device, attention_backend="triton",
        dtype=str(sizes.dtype).removeprefix("torch."), max_running_requests=batch,
        context_length=span + 8, max_total_tokens=batch * span + 16, cuda_graph_max_bs=batch,
    ))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for _ in range(batch)]
    first = runner.forward(prefill_batch([(i, p, 1 + i * span) for i, p in enumerate(prompts)]))
    plain = decode_batch([(i, t, n, 1 + i * span + n) for i, t in enumerate(first.token_ids)])
    drafts = [torch.randint(3, vocab, (VERIFY_K,), generator=gen).numpy().astype(np.int32)
              for _ in range(batch)]  # fmt: skip
    verify = Batch(is_decode=False, reqs=[
        ReqInput(req_slot=i, input_ids=np.array([t], np.int32),
                 out_slots=np.arange(1 + i * span + n, 1 + i * span + n + 1 + VERIFY_K,
                                     dtype=np.int32),
                 prefix_len=n, sample=True, use_last_sampled=False, drafts=drafts[i])
        for i, t in enumerate(first.token_ids)
    ])  # fmt: skip
    want = runner.forward(plain).token_ids
    got = runner.forward(verify)
    # A draft the model agrees with is kept: then it is the decode step's token.
    same = all(
        (x[0] if x else t) == w
        for x, t, w in zip(got.extra_token_ids, got.token_ids, want, strict=True)
    )

    def timed(b: Batch) -> float:
        runner.forward(b)  # warm-up: compiles the kernels for these shapes
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            runner.forward(b)
            sync()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return timed(plain), timed(verify), same


def bench_verify(table: Table, sizes: Sizes, budget: Budget) -> None:
    """Speculative decoding's verify step (docs/speculative.md) on the model above, against a
    plain decode step of the same requests: eager (graphs replay plain steps only)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, sizes)
        for batch in sizes.model_batches:
            if budget.left() < 10:
                table.add(f"verify step, batch {batch}", "skipped: time budget", "", "")
                continue
            steps = 20 if sizes.device == "cuda" else 2  # --smoke: interpreted Triton
            plain_ms, verify_ms, same = verify_vs_decode(folder, sizes, batch, steps)
            empty_cache()
            table.add(
                f"verify step (1 + {VERIFY_K} rows a request) vs decode step, batch {batch}",
                f"{verify_ms:.2f} vs {plain_ms:.2f} ms ({verify_ms / plain_ms:.2f}x); "
                f"tokens {'same' if same else 'DIFFER'}",
                "same tokens",
                verdict(same),
            )


def bench_tensor_parallel(table: Table, sizes: Sizes, budget: Budget) -> None:
    """TP=1 vs TP=N (NCCL, rank r on GPU r) on the model above: needs N >= 2 GPUs."""
    from bench.bench_tp import Plan, compare

    gpus = torch.cuda.device_count() if sizes.device == "cuda" else 0
    heads = sizes.model["num_key_value_heads"]
    world = max((n for n in (2, 4, 8) if n <= gpus and heads % n == 0), default=0)
    check = "tensor parallelism, TP=1 vs TP=N (bench/bench_tp.py)"
    if world == 0:
        table.add(check, f"not run: {gpus} GPU(s) here, needs >= 2", "", "")
        return
    if budget.left() < 30:
        table.add(check, f"skipped: {budget.left():.0f} s of budget left, needs ~30 s", "", "")
        return
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), sizes)
        plan = Plan(tmp, 4, 256, 3, 16, 32, device="cuda")
        med = compare({"1": (1, 1), str(world): (world, 1)}, plan, repeats=1)
    one, n = med["1"], med[str(world)]
    table.add(
        f"TP={world} / TP=1, batch 16 ({world} GPUs)",
        f"prefill {n['prefill_tok_s'] / one['prefill_tok_s']:.2f}x, decode "
        f"{one['decode_ms'] / n['decode_ms']:.2f}x (TP=1 {one['decode_ms']:.2f} ms/step); "
        f"all-reduce {n['all_reduce_us']:.0f} us",
        "info",
        "",
    )


# ---- main -------------------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guarded(table: Table, name: str, budget: Budget, need_s: float, fn, *args) -> None:
    if budget.left() < need_s:
        table.add(
            name,
            f"skipped: {budget.left():.0f} s of budget left, needs ~{need_s:.0f} s "
            f"(rerun: --only {os.environ.get('GPU_CHECK_STEP', name)})",
            "",
            "SKIP",
        )
        return
    start = time.monotonic()
    try:
        fn(table, *args)
    except Exception as e:  # a broken section must not hide the others' rows
        traceback.print_exc(file=sys.stderr)
        table.add(
            name,
            f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
            "",
            "FAIL",
        )
    finally:
        empty_cache()
        log(f"{name} took {time.monotonic() - start:.0f} s")


def step_sections(step: str, sizes: Sizes, peak: float | None, budget: Budget) -> list:
    """(name, fn, need_s, args) of one bench step, in order."""
    from bench.gpu_hicache import bench_copies
    from bench.gpu_model_check import GPU_SIZES, SECTIONS, SMOKE_SIZES

    model_sizes = SMOKE_SIZES if sizes.device == "cpu" else GPU_SIZES
    model = {name: (fn, need) for name, fn, need in SECTIONS}
    if step == "model":
        return [
            (name, fn, need, (model_sizes, verdict))
            for name, (fn, need) in model.items()
            if name != "default-config profile"
        ]
    if step == "kernels":
        return [
            ("decode attention", bench_decode, 15, (sizes, peak, budget)),
            ("extend attention", bench_extend, 10, (sizes,)),
            ("hicache copies", bench_copies, 10, (sizes.device, verdict)),
        ]
    if step == "awq":
        return [("AWQ int4 GEMM", bench_awq, 15, (budget,))]
    if step == "profile":
        fn, need = model["default-config profile"]
        return [("default-config profile", fn, need, (model_sizes, verdict))]
    return [
        ("model end to end", bench_model, 20, (sizes, budget)),
        ("speculative verify step", bench_verify, 10, (sizes, budget)),
        ("tensor parallelism", bench_tensor_parallel, 1, (sizes, budget)),
    ]


def run_step(table: Table, step: str, sizes: Sizes, peak: float | None, left_s: float) -> None:
    """One step under its own budget (its cap, within what the whole run has left)."""
    os.environ["GPU_CHECK_STEP"] = step  # names the step of any FAIL row (gpu_rows.py)
    budget = Budget(min(BY_NAME[step].cap_s, left_s))
    if step == "awq" and sizes.device != "cuda":
        table.add("AWQ int4 GEMM (bench/gpu_awq.py)", "skipped: needs CUDA", "", "")
        return
    for name, fn, need_s, args in step_sections(step, sizes, peak, budget):
        guarded(table, name, budget, need_s, fn, *args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peak-tbps",
        type=float,
        default=None,
        help="peak memory bandwidth, TB/s (default: by device name)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=sum(BY_NAME[s].estimate_s for s in BENCH_STEPS),
        help="the whole run's seconds: no section starts that cannot finish in what is left",
    )
    parser.add_argument(
        "--only",
        default=",".join(BENCH_STEPS),
        help=f"comma-separated steps, of {','.join(BENCH_STEPS)}",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter): checks this script runs",
    )
    args = parser.parse_args()
    steps = [s for s in args.only.split(",") if s]
    unknown = [s for s in steps if s not in BENCH_STEPS]
    if unknown:
        parser.error(f"unknown step {', '.join(unknown)}; steps: {', '.join(BENCH_STEPS)}")
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    table = Table()
    sizes = SMOKE if args.smoke else Sizes()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device visible to torch; this check needs a GPU (or --smoke).",
            file=sys.stderr,
        )
        return 2
    whole = Budget(args.budget_s)
    name = (
        torch.cuda.get_device_name()
        if sizes.device == "cuda"
        else "cpu (--smoke: figures meaningless)"
    )
    peak, source = peak_bandwidth(name, args.peak_tbps)
    import triton

    table.add(
        "device",
        f"{name}, torch {torch.__version__}, triton {triton.__version__}",
        f"peak {peak} TB/s ({source})" if peak else source,
        "",
    )
    # Correctness of the model path first: a short budget must cut speed rows, not these.
    for step in [s for s in BENCH_STEPS if s in steps]:
        run_step(table, step, sizes, peak, whole.left())
    return 1 if any(r[3] == "FAIL" for r in table.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
