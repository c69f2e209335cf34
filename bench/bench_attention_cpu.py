"""CPU extend (prefill) attention: the torch backend's per-request loop vs batched calls.

services/worker/attention/torch_backend.py runs one scaled_dot_product_attention per
request in an extend batch. This measures, on the same q/k/v, side by side (interleaved
rounds, medians):

  loop            the backend itself (TorchBackend.prepare + forward: store K/V, then one
                  SDPA per request); every other variant stores K/V the same way first
  batched view    equal lengths, no prefix: q/k/v viewed as [B, H, L, D], one SDPA with
                  is_causal (no copies; only possible when every request has the same length)
  padded+mask     any lengths / prefixes: q gathered into a padded [B, H, Lmax, D], K/V of
                  each context gathered from the pool into [B, KVH, Smax, D], one SDPA with a
                  [B, 1, Lmax, Smax] boolean mask (causal shifted by the prefix, padding
                  masked), the valid rows gathered back
  nested          torch.nested jagged tensors, one SDPA with is_causal (if this build runs it
                  on CPU)
  varlen          torch.nn.attention.varlen.varlen_attn (reported if it runs on CPU)

    .venv/bin/python bench/bench_attention_cpu.py [--rounds 5] [--threads 1 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker.attention.base import AttentionMeta  # noqa: E402
from services.worker.attention.torch_backend import TorchBackend  # noqa: E402

HEADS = {"qwen2": (14, 2, 64), "llama": (8, 4, 64)}


def make_meta(extend: list[int], prefix: list[int]) -> tuple[AttentionMeta, int]:
    """Contexts laid out one after another in the pool (slot 0 is the zero pad slot)."""
    seq = [e + p for e, p in zip(extend, prefix, strict=True)]
    qo = [0]
    out_slots = []
    table = torch.zeros(len(seq), max(seq), dtype=torch.int32)  # request b in row b
    nxt = 1
    for b, (e, s) in enumerate(zip(extend, seq, strict=True)):
        ctx = list(range(nxt, nxt + s))
        nxt += s
        table[b, :s] = torch.tensor(ctx)
        out_slots += ctx[s - e :]
        qo.append(qo[-1] + e)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMeta(
        is_decode=False,
        out_slots=torch.tensor(out_slots, dtype=torch.int64),
        qo_indptr=torch.tensor(qo, **i32),
        req_to_token=table,
        req_slots=torch.arange(len(seq), **i32),
        prefix_lens=torch.tensor(prefix, **i32),
        extend_lens=torch.tensor(extend, **i32),
        seq_lens=torch.tensor(seq, **i32),
        max_seq_len=max(seq),
        max_extend_len=max(extend),
    )
    return meta, nxt


class Padded:
    """One SDPA over a padded batch; the index tensors are built once per batch."""

    def __init__(self, meta: AttentionMeta, h: int, kvh: int, d: int, scale: float):
        self.h, self.kvh, self.d, self.scale = h, kvh, d, scale
        ext, seq, pre = meta.extend_lens.long(), meta.seq_lens.long(), meta.prefix_lens.long()
        b, lq, ls = len(ext), int(ext.max()), int(seq.max())
        rows = torch.arange(lq)[None, :]
        cols = torch.arange(ls)[None, :]
        q_valid = rows < ext[:, None]  # [B, Lq]
        self.q_idx = (meta.qo_indptr[:-1].long()[:, None] + rows).masked_fill(
            ~q_valid, 0
        )  # [B, Lq]
        kv_valid = cols < seq[:, None]
        rows_of = meta.req_to_token[:, :ls].index_select(0, meta.req_slots.long()).long()
        self.kv_idx = rows_of.masked_fill(~kv_valid, 0)  # [B, Ls] pool slots (0 = pad)
        # query row i of request b sees keys 0 .. prefix + i (and only valid ones)
        self.mask = (
            (cols[:, None, :] <= (rows[:, :, None] + pre[:, None, None])) & kv_valid[:, None, :]
        )[:, None]
        self.flat_valid = q_valid.reshape(-1).nonzero().squeeze(1)  # rows of [B*Lq] that are real
        self.b, self.lq, self.ls = b, lq, ls

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        b, lq, ls = self.b, self.lq, self.ls
        qh = q.index_select(0, self.q_idx.view(-1)).view(b, lq, self.h, self.d).transpose(1, 2)
        kh = (
            k_pool.index_select(0, self.kv_idx.view(-1))
            .view(b, ls, self.kvh, self.d)
            .transpose(1, 2)
        )
        vh = (
            v_pool.index_select(0, self.kv_idx.view(-1))
            .view(b, ls, self.kvh, self.d)
            .transpose(1, 2)
        )
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=self.mask, scale=self.scale, enable_gqa=self.kvh != self.h
        )
        return o.transpose(1, 2).reshape(b * lq, self.h, self.d).index_select(0, self.flat_valid)


def batched_view(q, k, v, b: int, h: int, kvh: int, d: int, scale: float) -> torch.Tensor:
    """Equal lengths, no prefix: [T, H, D] is [B, L, H, D]."""
    t = q.shape[0]
    lq = t // b
    o = F.scaled_dot_product_attention(
        q.view(b, lq, h, d).transpose(1, 2),
        k.view(b, lq, kvh, d).transpose(1, 2),
        v.view(b, lq, kvh, d).transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=kvh != h,
    )
    return o.transpose(1, 2).reshape(t, h, d)


def nested(q, k, v, offsets: torch.Tensor, h: int, kvh: int, scale: float) -> torch.Tensor:
    nq = torch.nested.nested_tensor_from_jagged(q, offsets).transpose(1, 2)
    nk = torch.nested.nested_tensor_from_jagged(k, offsets).transpose(1, 2)
    nv = torch.nested.nested_tensor_from_jagged(v, offsets).transpose(1, 2)
    o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True, scale=scale, enable_gqa=kvh != h)
    return o.transpose(1, 2).values()


def varlen(
    q, k, v, offsets: torch.Tensor, lmax: int, h: int, kvh: int, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = offsets.to(torch.int32)
    return varlen_attn(
        q, k, v, cu, cu, lmax, lmax, scale=scale, window_size=(-1, 0), enable_gqa=kvh != h
    )


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            out[n].append(time.perf_counter() - t0)
    return out


def run_case(
    model: str, extend: list[int], prefix: list[int], threads: list[int], rounds: int
) -> None:
    h, kvh, d = HEADS[model]
    scale = d**-0.5
    meta, slots = make_meta(extend, prefix)
    t = int(meta.qo_indptr[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(t, kvh, d, generator=gen)
    v = torch.randn(t, kvh, d, generator=gen)
    k_pool = torch.zeros(slots, kvh, d)
    v_pool = torch.zeros(slots, kvh, d)
    k_pool[1:] = torch.randn(slots - 1, kvh, d, generator=gen)
    v_pool[1:] = torch.randn(slots - 1, kvh, d, generator=gen)
    k_pool.index_copy_(0, meta.out_slots, k)  # what the backend's forward does first
    v_pool.index_copy_(0, meta.out_slots, v)
    backend = TorchBackend(h, kvh, d, scale)

    def store() -> None:
        # Every variant stores the new K/V first, as the backend's forward does.
        k_pool.index_copy_(0, meta.out_slots, k)
        v_pool.index_copy_(0, meta.out_slots, v)

    def loop() -> torch.Tensor:
        # The backend through its public interface: prepare once per batch, then forward
        # (store + one SDPA per request).
        backend.prepare(meta)
        return backend.forward(q, k, v, k_pool, v_pool, meta)

    def padded() -> torch.Tensor:
        store()
        return Padded(meta, h, kvh, d, scale)(q, k_pool, v_pool)

    def view() -> torch.Tensor:
        store()
        return batched_view(q, k, v, len(extend), h, kvh, d, scale)

    def nested_call() -> torch.Tensor:
        store()
        return nested(q, k, v, meta.qo_indptr.long(), h, kvh, scale)

    def varlen_call() -> torch.Tensor:
        store()
        return varlen(q, k, v, meta.qo_indptr.long(), max(extend), h, kvh, scale)

    fns: dict[str, Callable[[], torch.Tensor]] = {"loop (today)": loop, "padded+mask": padded}
    no_prefix = not any(prefix)
    if no_prefix and len(set(extend)) == 1:
        fns["batched view"] = view
    notes = []
    if no_prefix:
        for name, fn in (("nested", nested_call), ("varlen", varlen_call)):
            try:
                fn()
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 - report whatever this build says
                notes.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    ref = loop()
    errs = {}
    for name, fn in fns.items():
        errs[name] = (fn() - ref).abs().max().item()
    desc = (
        f"{model} ({h}q/{kvh}kv x {d}), {len(extend)} req, new {min(extend)}..{max(extend)}"
        f"{f', prefix {min(prefix)}..{max(prefix)}' if any(prefix) else ''}, T={t}"
    )
    print(f"\n### {desc}")
    for n in notes:
        print(f"- not run: {n}")
    print("\n| threads | variant | ms (median) | speed-up vs loop | max abs diff vs loop |")
    print("|---|---|---|---|---|")
    for nt in threads:
        torch.set_num_threads(nt)
        secs = interleaved(fns, rounds)
        base = secs["loop (today)"]
        for name, s in secs.items():
            sp = statistics.median(bb / aa for aa, bb in zip(s, base, strict=True))
            print(
                f"| {nt} | {name} | {statistics.median(s) * 1e3:.1f} | {sp:.2f}x "
                f"| {errs[name]:.1e} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--models", nargs="+", default=["qwen2", "llama"], choices=list(HEADS))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    gen = torch.Generator().manual_seed(1)
    mixed = [int(x) for x in torch.randint(64, 1000, (16,), generator=gen)]
    cases = [
        ([512] * 8, [0] * 8),
        ([1000] * 50, [0] * 50),
        (mixed, [0] * 16),
        ([256] * 8, [512] * 8),
    ]
    if args.quick:
        cases = [([512] * 8, [0] * 8), ([1000] * 8, [0] * 8), ([256] * 4, [256] * 4)]
        args.rounds = 3
    with torch.inference_mode():
        for model in args.models:
            for extend, prefix in cases:
                run_case(model, extend, prefix, args.threads, args.rounds)


if __name__ == "__main__":
    main()
