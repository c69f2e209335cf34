"""The worker's model path on the GPU, as sections of bench/gpu_bench.py.

Correctness (tiny Qwen2-style models shaped like the real ones where it matters: head_dim
128, GQA 7, q/k/v bias, tied embeddings, saved in bf16 and loaded with dtype "auto"):
  * logits of the triton and the torch attention backends against transformers' own model;
  * a prefix-cached extend gives the logits of the uncached prompt;
  * CUDA-graph replay gives the eager logits for padded batches (n = 3, 5, 7 of max 8), a
    served decode step reports ``cuda_graph``, and no graph captured at all is a FAIL;
  * seeded top-k / top-p sampling repeats on a fresh runner, with no NaN anywhere.
Profile (a Qwen2.5-7B-shaped model cut to 4 layers, the default memory sizing, graphs up to
batch 64): KV slots, free memory after capture, and one decode step at 64 x 4,096 split
into host / graph replay / sampling, with the host syncs counted.

It drives ``ModelRunner`` with batch.py's dataclasses directly: no protobuf, no ZeroMQ, so
it runs on a GPU image that has neither. ``--smoke`` (through gpu_bench.py) runs the same
code on CPU at tiny sizes; graph rows then say why they are skipped.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ModelSizes:
    device: str
    heads: tuple[int, int, int]  # q heads, kv heads, head_dim (GQA 7: 14 / 2)
    layers: int
    intermediate: int
    vocab: int
    tol: float  # max |logit error| / max |logit|
    profile: dict[str, int]  # the 7B-shaped model, cut
    profile_batch: int
    profile_context: int


GPU_SIZES = ModelSizes(
    device="cuda",
    heads=(14, 2, 128),
    layers=2,
    intermediate=1024,
    vocab=4096,
    tol=3e-2,  # bf16 weights and activations, different summation orders
    profile=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=152064,
    ),
    profile_batch=64,
    profile_context=4096,
)
SMOKE_SIZES = ModelSizes(
    device="cpu",
    heads=(7, 1, 16),
    layers=2,
    intermediate=64,
    vocab=300,
    tol=3e-2,  # "auto" is the checkpoint's bfloat16 on CPU too, as on the GPU
    profile=dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
    ),
    profile_batch=4,
    profile_context=64,
)
PROMPT_LENS = (5, 17, 33)


# ---- models and a protobuf-free driver ------------------------------------------------------


def build_qwen2(folder: Path, sizes: ModelSizes, dense: dict[str, int] | None = None) -> None:
    """A random Qwen2 (q/k/v bias; tied embeddings unless ``dense`` is the 7B shape), bf16."""
    import transformers

    if dense is None:
        hq, hkv, d = sizes.heads
        shape = dict(
            hidden_size=hq * d,
            intermediate_size=sizes.intermediate,
            num_attention_heads=hq,
            num_key_value_heads=hkv,
            num_hidden_layers=sizes.layers,
            vocab_size=sizes.vocab,
        )
        tied = True
    else:
        shape, tied = dense, False
    config = transformers.Qwen2Config(
        **shape,
        max_position_embeddings=8192,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(sizes.device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model


def make_runner(folder: Path, sizes: ModelSizes, **overrides: Any):
    from services.common.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    fields: dict[str, Any] = dict(
        model_path=str(folder),
        device=sizes.device,
        dtype="auto",
        max_running_requests=8,
        context_length=256,
        max_total_tokens=4096,
    )
    fields.update(overrides)
    return ModelRunner(WorkerConfig(**fields))


def prompts(vocab: int, lens: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _i32(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int32)


def prefill_batch(
    reqs: list[tuple[int, list[int], int]],
    sampling=None,
    prefix: dict[int, tuple[int, np.ndarray]] | None = None,
):
    """reqs: (req_slot, tokens, first KV slot). prefix: req_slot -> (cached length, slots);
    such a request computes only tokens[cached:]."""
    from services.worker.batch import Batch, ReqInput, SlotStart
    from services.worker.sampling import SamplingSpec

    spec = sampling or SamplingSpec(temperature=0.0)
    prefix = prefix or {}
    out = []
    for slot, tokens, base in reqs:
        cached, slots = prefix.get(slot, (0, np.zeros(0, np.int32)))
        out.append(
            ReqInput(
                req_slot=slot,
                input_ids=_i32(tokens[cached:]),
                out_slots=_i32(range(base + cached, base + len(tokens))),
                prefix_len=cached,
                sample=True,
                use_last_sampled=False,
                start=SlotStart(slots, spec, np.zeros(0, np.int32), False),
                rid=f"check-{slot}",
            )
        )
    return Batch(is_decode=False, reqs=out)


def decode_batch(rows: list[tuple[int, int, int, int]], start=None):
    """rows: (req_slot, input token, its position, its KV slot); ``start`` maps a req_slot
    to the SlotStart of a request whose first step this is."""
    from services.worker.batch import Batch, ReqInput

    start = start or {}
    return Batch(
        is_decode=True,
        reqs=[
            ReqInput(
                req_slot=slot,
                input_ids=_i32([tok]),
                out_slots=_i32([kv]),
                prefix_len=pos,
                sample=True,
                use_last_sampled=False,
                start=start.get(slot),
                rid=f"check-{slot}",
            )
            for slot, tok, pos, kv in rows
        ],
    )


def generate(
    runner, token_lists: list[list[int]], new_tokens: int, sampling=None
) -> list[list[int]]:
    """Greedy (or ``sampling``) generation of every prompt at once, slots laid out in a row."""
    span = max(len(p) for p in token_lists) + new_tokens
    bases = [1 + i * span for i in range(len(token_lists))]
    reqs = [(i, p, bases[i]) for i, p in enumerate(token_lists)]
    outs = [[t] for t in runner.forward(prefill_batch(reqs, sampling)).token_ids]
    for _ in range(new_tokens - 1):
        rows = []
        for i, p in enumerate(token_lists):
            pos = len(p) + len(outs[i]) - 1
            rows.append((i, outs[i][-1], pos, bases[i] + pos))
        for i, tok in enumerate(runner.forward(decode_batch(rows)).token_ids):
            outs[i].append(tok)
    return outs


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- correctness -------------------------------------------------------------------------------


def check_logits(table, sizes: ModelSizes, verdict) -> None:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_qwen2(folder, sizes)
        toks = prompts(sizes.vocab, PROMPT_LENS)
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
        ref_model = ref_model.to(sizes.device).eval()
        for backend in ("triton", "torch"):
            runner = make_runner(folder, sizes, attention_backend=backend, disable_cuda_graph=True)
            dtype = runner.dtype
            ref_model = ref_model.to(dtype)
            with torch.no_grad():
                want = [ref_model(torch.tensor([p], device=sizes.device)).logits[0] for p in toks]
            base, reqs = 1, []
            for i, p in enumerate(toks):
                reqs.append((i, p, base))
                base += len(p)
            got = runner.logits(prefill_batch(reqs)).split(list(PROMPT_LENS))
            err = max(_rel_err(g, w) for g, w in zip(got, want, strict=True))
            bad = any(not torch.isfinite(g).all() for g in got)
            hq, hkv, d = sizes.heads
            table.add(
                f"model logits vs transformers, {backend} backend (Qwen2-style: D={d}, "
                f"{hq}q/{hkv}kv, q/k/v bias, tied embeddings, dtype auto = {dtype})",
                f"max error {err:.1e} of the logits' range" + (", NON-FINITE" if bad else ""),
                f"< {sizes.tol:g}",
                verdict(err < sizes.tol and not bad),
            )
            if backend == "triton":
                check_prefix_extend(table, runner, toks[2], got[2], sizes, verdict)
            del runner


def check_prefix_extend(table, runner, prompt, full_logits, sizes: ModelSizes, verdict) -> None:
    """The same prompt again on a cached prefix of 20 tokens (slots of the first run's)."""
    cached = 20
    first_base = 1 + PROMPT_LENS[0] + PROMPT_LENS[1]  # where check_logits put prompt 2
    slots = _i32(range(first_base, first_base + cached))
    base = 1 + sum(PROMPT_LENS)  # fresh slots for the new part
    batch = prefill_batch([(3, prompt, base)], prefix={3: (cached, slots)})
    got = runner.logits(batch)  # rows for positions cached .. len-1
    err = _rel_err(got, full_logits[cached:])
    table.add(
        f"prefix-cached extend ({cached} of {len(prompt)} tokens cached, triton)",
        f"max error {err:.1e} vs the uncached logits",
        f"< {sizes.tol:g}",
        verdict(err < sizes.tol),
    )


def check_graphs(table, sizes: ModelSizes, verdict) -> None:
    if sizes.device != "cuda":
        table.add(
            "CUDA-graph replay vs eager (n = 3, 5, 7 of 8)", "skipped: needs a GPU", "", ""
        )  # not SKIP: that verdict means "not reached in the time budget" (gpu_check.sh)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_qwen2(folder, sizes)
        runner = make_runner(folder, sizes, attention_backend="triton", cuda_graph_max_bs=8)
        captured = 0 if runner.graphs is None else len(runner.graphs.graphs)
        table.add(
            "CUDA graphs captured (max batch 8)",
            f"{captured} graphs" + ("" if captured else ": NONE"),
            "> 0",
            verdict(captured > 0),
        )
        if not captured:
            return
        toks = prompts(sizes.vocab, (9, 4, 12, 7, 5, 11, 6))
        span = 64
        bases = [1 + i * span for i in range(len(toks))]
        firsts = runner.forward(prefill_batch([(i, p, bases[i]) for i, p in enumerate(toks)]))
        worst = 0.0
        for n in (3, 5, 7):
            rows = [
                (i, firsts.token_ids[i], len(toks[i]), bases[i] + len(toks[i])) for i in range(n)
            ]
            ids, positions, meta = runner._begin(decode_batch(rows))
            with torch.no_grad():
                eager = runner.model.compute_logits(runner.model.forward(ids, positions, meta))
                graph = runner.graphs.replay(ids, positions, meta)
            worst = max(worst, _rel_err(graph, eager))
        table.add(
            "CUDA-graph replay vs eager logits, padded batches n = 3, 5, 7 (graphs of 4, 8)",
            f"max error {worst:.1e}",
            f"< {sizes.tol:g}",
            verdict(worst < sizes.tol),
        )
        rows = [(i, firsts.token_ids[i], len(toks[i]), bases[i] + len(toks[i])) for i in range(5)]
        out = runner.forward(decode_batch(rows))
        table.add(
            "served decode step (n = 5) ran a graph",
            f"cuda_graph = {out.cuda_graph}",
            "true",
            verdict(out.cuda_graph),
        )


def check_sampling(table, sizes: ModelSizes, verdict) -> None:
    from services.worker.sampling import SamplingSpec

    spec = SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_qwen2(folder, sizes)
        toks = prompts(sizes.vocab, (6, 9, 13))
        runs, finite = [], True
        for _ in range(2):
            runner = make_runner(folder, sizes, cuda_graph_max_bs=4)
            runs.append(generate(runner, toks, 12, spec))
            logits = runner.logits(prefill_batch([(5, toks[0], 2000)]))
            finite &= bool(torch.isfinite(logits).all())
            del runner
        in_vocab = all(0 <= t < sizes.vocab for r in runs[0] for t in r)
        same = runs[0] == runs[1]
        table.add(
            f"seeded top-k/top-p sampling on {sizes.device}: fresh runner, same tokens",
            f"{'same' if same else 'DIFFERENT'}; in vocab {in_vocab}; finite logits {finite}",
            "same, no NaN",
            verdict(same and in_vocab and finite),
        )


# ---- profile -----------------------------------------------------------------------------------


@dataclass
class StepSplit:
    total_ms: float
    replay_ms: float
    sample_ms: float
    syncs: int

    @property
    def host_ms(self) -> float:
        return max(self.total_ms - self.replay_ms - self.sample_ms, 0.0)


def profile_default(table, sizes: ModelSizes, verdict) -> None:
    from services.worker.batch import SlotStart
    from services.worker.sampling import SamplingSpec

    b, ctx = sizes.profile_batch, sizes.profile_context
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        build_qwen2(folder, sizes, dense=sizes.profile)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        runner = make_runner(
            folder,
            sizes,
            max_total_tokens=0,  # sized from --mem-fraction-static, as served
            max_running_requests=b,
            context_length=ctx + 64,
            cuda_graph_max_bs=b,
        )
        ready = time.perf_counter() - t0
        free = torch.cuda.mem_get_info()[0] if sizes.device == "cuda" else 0
        graphs = 0 if runner.graphs is None else len(runner.graphs.graphs)
        gpu = sizes.device == "cuda"
        table.add(
            f"default config (Qwen2.5-7B shape, {sizes.profile['num_hidden_layers']} layers, "
            f"graphs to {b}): KV slots, free memory after capture",
            f"{runner.num_slots:,} slots; {free / 2**30:.1f} GiB free; {graphs} graphs; "
            f"built {built:.0f} s, loaded+captured {ready:.0f} s",
            ">= 2 GiB free" if gpu else "info (CPU)",
            verdict(free >= 2 * 2**30 and graphs > 0) if gpu else "",
        )
        spec = SamplingSpec(temperature=0.7, top_p=0.9)
        span = ctx + 64
        starts = {
            i: SlotStart(
                _i32(range(1 + i * span, i * span + ctx)), spec, np.zeros(0, np.int32), False
            )
            for i in range(b)
        }
        split = _time_decode(runner, b, ctx, span, starts)
        share = split.host_ms / max(split.total_ms, 1e-9)
        table.add(
            f"decode step {b} x {ctx:,} ctx: host / replay / sampling",
            f"{split.total_ms:.2f} ms = host {split.host_ms:.2f} + replay {split.replay_ms:.2f} "
            f"+ sampling {split.sample_ms:.2f} (host {100 * share:.0f}%); "
            f"{split.syncs} host syncs per step",
            "host <= 25%" if gpu else "info (CPU)",
            verdict(share <= 0.25) if gpu else "",
        )


def _time_decode(runner, b: int, ctx: int, span: int, starts: dict) -> StepSplit:
    """Median over steps of: the served step, the graph replay alone, sampling alone."""
    pos = ctx - 1
    steps, replays, samples = [], [], []

    def rows(p: int) -> list[tuple[int, int, int, int]]:
        return [(i, 7 + i, p, 1 + i * span + p) for i in range(b)]

    runner.forward(decode_batch(rows(pos), starts))  # the starts: table rows written once
    for _ in range(12):
        pos += 1
        _sync()
        t0 = time.perf_counter()
        runner.forward(decode_batch(rows(pos)))  # ends in .tolist(): synced
        steps.append((time.perf_counter() - t0) * 1e3)
    syncs = _count_syncs(lambda: runner.forward(decode_batch(rows(pos + 1))))
    logits = torch.randn(b, runner.vocab_size, device=runner.device)
    slots = list(range(b))
    for _ in range(12):
        samples.append(_timed_ms(lambda: runner.sampler.sample(logits, slots)))
        if runner.graphs is not None and runner.graphs.can_run(b):
            size = runner.graphs._graph_size(b)
            replays.append(_timed_ms(lambda size=size: runner.graphs._launch(size)))
    return StepSplit(
        statistics.median(steps),
        statistics.median(replays) if replays else 0.0,
        statistics.median(samples),
        syncs,
    )


def _timed_ms(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _count_syncs(fn) -> int:
    """Host-device syncs torch reports in one call (its sync debug mode); -1 on CPU."""
    if not torch.cuda.is_available():
        fn()
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


SECTIONS = [
    ("model logits and prefix extend", check_logits, 60),
    ("CUDA-graph replay", check_graphs, 40),
    ("seeded sampling", check_sampling, 30),
    ("default-config profile", profile_default, 90),
]
