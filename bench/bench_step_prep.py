"""Host work to prepare one decode step: before (every context slot listed per step) vs now
(the kernels read the request-to-slot table; per-step work is O(batch)).

    .venv/bin/python bench/bench_step_prep.py [--batch 64] [--contexts 4096 32768]

"before" is the previous worker's index path, kept here as the baseline: write the new slots
with repeat_interleave, then gather every request's whole context from the table into one
flat kv_slots list (and, on CPU, the torch backend's padded slot matrix built from it).
"now" is StepStager.stage + ReqToTokenTable.write_tokens (+ the torch backend's padded slot
matrix, read from table rows). Medians over --steps steps, one thread, CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker.attention.base import AttentionMeta  # noqa: E402
from services.worker.attention.torch_backend import TorchBackend  # noqa: E402
from services.worker.req_table import ReqToTokenTable  # noqa: E402
from services.worker.step_inputs import StepStager  # noqa: E402


def segment_arange(lens: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    total = int(lens.sum())
    offsets = torch.cumsum(lens, 0) - lens
    idx = torch.arange(total) - torch.repeat_interleave(offsets, lens, output_size=total)
    if starts is not None:
        idx += torch.repeat_interleave(starts, lens, output_size=total)
    return idx


def before(table: torch.Tensor, rows: np.ndarray, ctx: int, slots: np.ndarray) -> torch.Tensor:
    """The old decode prepare: write + flat gather of every context + the backend's matrix."""
    req = torch.from_numpy(rows)
    prefix = torch.full((len(rows),), ctx - 1, dtype=torch.int64)
    ones = torch.ones(len(rows), dtype=torch.int64)
    seq = prefix + ones
    w_rows = torch.repeat_interleave(req, ones, output_size=len(rows))
    table[w_rows, segment_arange(ones, prefix)] = torch.from_numpy(slots).int()
    flat_rows = torch.repeat_interleave(req, seq, output_size=int(seq.sum()))
    kv_slots = table[flat_rows, segment_arange(seq)].long()
    positions = segment_arange(ones, prefix)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seq, 0)])
    cols = torch.arange(ctx)[None, :]
    idx = (kv_indptr[:-1][:, None] + cols).clamp_(max=kv_slots.numel() - 1)
    return kv_slots[idx], positions


def now(
    table: ReqToTokenTable, stager: StepStager, backend: TorchBackend, rows, ctx, slots, ids
) -> None:
    step = stager.stage(
        ids, [slots[i : i + 1] for i in range(len(rows))], rows, [ctx - 1] * len(rows)
    )
    table.write_tokens(step.token_rows, step.positions, step.out_slots)
    meta = AttentionMeta(
        is_decode=True,
        out_slots=step.out_slots,
        qo_indptr=step.qo_indptr,
        req_to_token=table.table,
        req_slots=step.req_slots,
        prefix_lens=step.prefix_lens,
        extend_lens=step.extend_lens,
        seq_lens=step.seq_lens,
        max_seq_len=step.max_seq_len,
        max_extend_len=step.max_extend_len,
    )
    backend.prepare(meta)


def median_ms(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(b: int, ctx: int, steps: int) -> tuple[float, float, float]:
    """(before, now, now without the torch backend's matrix), ms per step."""
    table = ReqToTokenTable(b, ctx, torch.device("cpu"))
    table.table[:b] = torch.arange(1, b * ctx + 1, dtype=torch.int32).view(b, ctx)
    rows = np.random.default_rng(0).permutation(b).astype(np.int64)
    slots = np.arange(1, b + 1, dtype=np.int64) * ctx
    ids = [np.array([7], dtype=np.int32)] * b
    stager, backend = StepStager(torch.device("cpu")), TorchBackend(8, 4, 64, 0.125)

    def staged_only() -> None:
        step = stager.stage(ids, [slots[i : i + 1] for i in range(b)], rows, [ctx - 1] * b)
        table.write_tokens(step.token_rows, step.positions, step.out_slots)

    return (
        median_ms(lambda: before(table.table, rows, ctx, slots), steps),
        median_ms(lambda: now(table, stager, backend, rows, ctx, slots, ids), steps),
        median_ms(staged_only, steps),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        "| batch x context | before (ms/step) | now (ms/step) | now, without the torch "
        "backend's slot matrix (ms/step) |"
    )
    print("|---|---|---|---|")
    for ctx in args.contexts:
        old, new, bare = measure(args.batch, ctx, args.steps)
        print(f"| {args.batch} x {ctx:,} | {old:.2f} | {new:.2f} | {bare:.3f} |")


if __name__ == "__main__":
    main()
