"""GPU benchmark of the AWQ dequant-GEMM (kernels/triton/awq_gemm.py) against fp16 torch.matmul.

One 4,096 x 11,008 GEMM (a 7B model's gate/up projection), group size 128, at decode sizes
(M = 1, 16, 64) and a prefill size (M = 2,048): achieved TFLOP/s and GB/s of each, and the
speed-up over fp16 ``torch.matmul`` on the same shapes. Target at decode: >= 2x (the kernel
reads ~4x fewer weight bytes). Times are triton.testing.do_bench's (L2 flushed between
runs, so the 22 MB of packed weights are read from HBM as in serving). A short sweep of
decode tiles reports the best one, for tuning ``choose_config``.

    .venv/bin/python bench/gpu_awq.py [--budget-s 60]     # prints a markdown table

From bench/gpu_bench.py: ``for r in awq_rows(budget_s): table.add(r["name"], r["measured"],
r["target"], verdict(r["pass"]) if r["pass"] is not None else "")``.
Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

K, N, GROUP = 4096, 11008, 128
DECODE_M = (1, 16, 64)
PREFILL_M = 2048
DECODE_TARGET = 2.0


def _row(name: str, measured: str, target: str = "", ok: bool | None = None) -> dict:
    return {"name": name, "measured": measured, "target": target, "pass": ok}


def _packed_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random AWQ tensors: every int32 bit pattern is a valid set of 8 nibbles."""
    g = torch.Generator(device=device).manual_seed(0)
    words = dict(dtype=torch.int32, device=device, generator=g)
    qweight = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), **words)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (K // GROUP, N // 8), **words)
    scales = (0.002 + 0.02 * torch.rand(K // GROUP, N, device=device, generator=g)).half()
    return qweight, qzeros, scales


def _ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def _figures(m: int, ms: float, nbytes: int) -> str:
    tflops = 2 * m * N * K / (ms * 1e-3) / 1e12
    return f"{tflops:.2f} TFLOP/s, {nbytes / (ms * 1e-3) / 1e9:.0f} GB/s, {ms * 1e3:.1f} us"


def _compare(m: int, weights, dense: torch.Tensor) -> dict:
    from kernels.triton.awq_gemm import awq_gemm

    qweight, qzeros, scales = weights
    x = torch.randn(m, K, device=dense.device, dtype=torch.float16)
    out_bytes = m * N * 2
    awq_bytes = x.nbytes + qweight.nbytes + qzeros.nbytes + scales.nbytes + out_bytes
    ours = _ms(lambda: awq_gemm(x, qweight, qzeros, scales))
    base = _ms(lambda: torch.matmul(x, dense))
    speedup = base / ours
    decode = m < PREFILL_M
    measured = (
        f"awq {_figures(m, ours, awq_bytes)}; fp16 matmul "
        f"{_figures(m, base, x.nbytes + dense.nbytes + out_bytes)}; {speedup:.2f}x"
    )
    target = f">= {DECODE_TARGET:.0f}x fp16 matmul" if decode else "(reported)"
    kind = "decode" if decode else "prefill"
    return _row(
        f"awq gemm {kind} M={m} ({K}x{N}, g{GROUP})",
        measured,
        target,
        speedup >= DECODE_TARGET if decode else None,
    )


def _accuracy(weights, device: torch.device) -> dict:
    from kernels.triton.awq_gemm import awq_gemm, awq_gemm_ref

    x = torch.randn(16, K, device=device, dtype=torch.float16)
    got, want = awq_gemm(x, *weights).float(), awq_gemm_ref(x, *weights).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    return _row("awq gemm: max error / max |ref| (fp16, M=16)", f"{err:.1e}", "< 1e-2", err < 1e-2)


def _sweep(m: int, weights, deadline: float) -> dict:
    """Decode tiles x K splits at one M: the fastest, beside the default choice."""
    from kernels.triton.awq_gemm import GemmConfig, awq_gemm, choose_config

    x = torch.randn(m, K, device=weights[0].device, dtype=torch.float16)
    default = choose_config(m, N, K, GROUP, x.device, x.dtype)
    timings: dict[GemmConfig, float] = {}
    for bn in (64, 128):
        for bk in (64, 128):
            for split in (1, 2, 4, 8):
                if time.monotonic() > deadline:
                    break
                cfg = GemmConfig(16, bn, bk, split, 4, 4)
                timings[cfg] = _ms(lambda cfg=cfg: awq_gemm(x, *weights, config=cfg))
    timings.setdefault(default, _ms(lambda: awq_gemm(x, *weights, config=default)))
    best = min(timings, key=timings.__getitem__)
    return _row(
        f"awq gemm sweep M={m} ({len(timings)} configs)",
        f"best BN={best.block_n} BK={best.block_k} split={best.split_k}: "
        f"{timings[best] * 1e3:.1f} us; default BN={default.block_n} BK={default.block_k} "
        f"split={default.split_k}: {timings[default] * 1e3:.1f} us",
    )


def awq_rows(budget_s: float = 60.0) -> list[dict]:
    """The benchmark's rows: name, measured, target, pass (True/False, None: no target)."""
    if not torch.cuda.is_available():
        return [_row("awq gemm", "skipped: no CUDA device")]
    start = time.monotonic()
    device = torch.device("cuda")
    weights = _packed_weights(device)
    dense = torch.randn(K, N, device=device, dtype=torch.float16)
    rows = [_accuracy(weights, device)]
    for m in (*DECODE_M, PREFILL_M):
        if time.monotonic() - start > budget_s:
            rows.append(_row(f"awq gemm M={m}", "skipped: time budget spent"))
            continue
        rows.append(_compare(m, weights, dense))
    sweep_deadline = start + budget_s
    if time.monotonic() < sweep_deadline:
        rows.append(_sweep(1, weights, sweep_deadline))
    return rows


def markdown(rows: list[dict]) -> str:
    verdict = {True: "PASS", False: "FAIL", None: ""}
    lines = ["| check | measured | target | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {r['name']} | {r['measured']} | {r['target']} | {verdict[r['pass']]} |" for r in rows
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=60.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_awq: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    rows = awq_rows(args.budget_s)
    print(markdown(rows))
    return 1 if any(r["pass"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
