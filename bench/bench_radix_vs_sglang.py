"""radixserve's radix cache beside SGLang's own ``RadixCache``, same trace, one process.

Not a test. The trace is bench_radix_cache.py's generated shared prefix (64 groups x 16
requests, 2,048-token system prompt + 128-token question, 256 output tokens, shuffled, a
200,000-slot pool so eviction runs, page size 1). Each request is one bookkeeping
lifecycle, the same sequence of operations on both sides:

    match the prompt (all but its last token) -> lock the matched node
    -> evict if the pool is short -> allocate the uncached prompt + every output token
    -> insert prompt + output[:-1] -> free duplicates and the last token's slot -> unlock

Passes over the whole trace alternate between the two caches (A B, B A, A B, ...), each
with a fresh cache and allocator and a ``gc.collect()`` first, after one untimed warm-up
pass each; per-request CPU time (``thread_time``) and wall time are pooled over the
passes. Whole passes rather than request-by-request lockstep: the garbage collector is
shared by the process, and in lockstep one side's collections (walking the other side's
objects) land on random requests of either side. Collections a side triggers itself are
part of its cost (its time in them is printed). On a shared, loaded machine the CPU-time
ratio is the figure to read; wall time includes waiting for a core.

Getting SGLang (never a project dependency: the wheel is only unpacked into a temp dir)::

    pip download --no-deps sglang -d /tmp/sglang-wheel      # ~40 MB, any recent version
    .venv/bin/python bench/bench_radix_vs_sglang.py --sglang-wheel /tmp/sglang-wheel

How faithful the SGLang side is:

- SGLang's tree code runs untouched, loaded from the wheel's own files:
  ``mem_cache/radix_cache.py`` (RadixKey, TreeNode, RadixCache), ``base_prefix_cache.py``
  (params/results dataclasses, lock/unlock), ``cache_init_params.py``,
  ``evict_policy.py`` (LRU) and ``utils.py`` (``get_eviction_strategy``,
  ``split_node_hash_value``), ``events.py`` (its recorder, disabled as by default).
- The allocator is SGLang's own ``TokenToKVPoolAllocator`` (``allocator/token.py``,
  page size 1, a CPU int64 tensor free list, ``need_sort=False``) with no KV tensors
  behind it (``kvcache=None``): the bookkeeping never touches KV data.
- Stubbed: every other ``sglang`` module those files import, and the package
  ``__init__`` files (they import the whole server). With 0.5.23 that is
  ``sglang.srt.utils.common`` (``ceil_align``, used by ``checkpoint`` only),
  ``environ``, ``runtime_context``, ``observability.metrics_collector``,
  ``disaggregation.kv_events``, ``memory_pool``, ``unified_cache.component_type``,
  ``cpp_utils.native_hash`` and ``kernels.ops.kvcache.mla_buffer``. Each stub is an empty
  module whose attributes are placeholder classes; none is called on this path (metrics
  off, KV events off, no hierarchical cache, no mamba/SWA); no third-party package is
  stubbed (torch is the real one).
- Token ids: each side gets its own container per request, built untimed at the
  request's arrival as its scheduler builds it: SGLang ``array('q')`` (as
  ``Req.origin_input_ids`` holds them), radixserve an ``array('i')`` unpacked from the
  packed int32 bytes of the wire (``tokens_from_wire``; services/scheduler/tokens.py).
- Not included on either side: the request-to-token table writes and GPU copies. By
  default neither side does the re-match after the insert either (bench_radix_cache's
  ``serve_one``, the issue's definition); ``--rematch`` adds it to both, as
  radixserve's ``KVManager.commit`` and SGLang's ``RadixCache.checkpoint`` do it
  (radixserve reads the slots off the node its insert returned, ``path_slots``, where
  SGLang matches the key again).
- radixserve's insert resumes at the request's locked match (``start=``, as
  ``KVManager.commit`` does), so it does not compare the cached prefix a second time;
  SGLang's insert walks from the root (comparing ``array('q')`` slices, memcmp speed).
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import random
import statistics
import sys
import tempfile
import time
import types
import zipfile
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_radix_cache import admit, build_trace, serve_one  # noqa: E402
from services.scheduler.allocator import KVSlotAllocator  # noqa: E402
from services.scheduler.radix_cache import RadixCache, check_slot_integrity  # noqa: E402
from services.scheduler.tokens import Tokens, tokens_from_wire  # noqa: E402

_MEM = "sglang/srt/mem_cache/"
# The SGLang files that run for real; every other sglang module is a stub.
_REAL = {
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.allocator.base",
    "sglang.srt.mem_cache.allocator.token",
}
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator")

HOW_TO_GET = (
    "SGLang is not installed and is never a radixserve dependency. Download its wheel "
    "(no dependencies) and point this script at it:\n"
    "    pip download --no-deps sglang -d /tmp/sglang-wheel\n"
    "    .venv/bin/python bench/bench_radix_vs_sglang.py --sglang-wheel /tmp/sglang-wheel"
)


# -- loading SGLang's tree from its wheel ------------------------------------------------
class _StubModule(types.ModuleType):
    """A module whose every attribute is a placeholder class (never called here)."""

    __path__: list[str] = []  # a package too, so submodule imports resolve to stubs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, stub)
        return stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the sglang modules outside _REAL as stubs; the package skeletons point at
    the unpacked files so that _REAL loads from them."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in _PACKAGES:
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = [str(self.root / name.replace(".", "/"))]
            return spec
        if name in _REAL:
            return None  # the normal path finder loads the real file
        if name.split(".")[0] == "sglang":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in _PACKAGES:
            mod = types.ModuleType(spec.name)
            mod.__path__ = list(spec.submodule_search_locations or [])
            return mod
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None  # skip package __init__ files: they import the whole server


def _wheel_root(path: Path) -> Path:
    """The unpacked wheel's root (holding sglang/): a wheel, a dir with one, or a tree."""
    if path.is_dir() and (path / _MEM / "radix_cache.py").exists():
        return path
    wheels = sorted(path.glob("sglang-*.whl")) if path.is_dir() else [path]
    if not wheels or not wheels[-1].is_file():
        sys.exit(f"no sglang wheel at {path}\n{HOW_TO_GET}")
    # Only mem_cache/ is unpacked, once per wheel, beside the temp files (not the venv).
    out = Path(tempfile.gettempdir()) / f"{wheels[-1].stem}-mem_cache"
    if not (out / _MEM / "radix_cache.py").exists():
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(out, [n for n in z.namelist() if n.startswith(_MEM)])
    return out


def load_sglang(path: Path) -> tuple[types.ModuleType, type, str]:
    """SGLang's radix_cache module, its TokenToKVPoolAllocator class and its version."""
    import importlib

    import torch  # noqa: F401  (real; imported before any stub is in place)

    root = _wheel_root(path)
    sys.meta_path.insert(0, _StubFinder(root))
    sys.path.insert(0, str(root))
    rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    token = importlib.import_module("sglang.srt.mem_cache.allocator.token")
    name = path.name if path.suffix == ".whl" else next(iter(path.glob("*.whl")), path).name
    return rc, token.TokenToKVPoolAllocator, name


# -- the SGLang side of one request ------------------------------------------------------
class SGLangSide:
    """SGLang's RadixCache + TokenToKVPoolAllocator driven like serve_one drives ours."""

    def __init__(self, rc: types.ModuleType, alloc_cls: type, pool: int, rematch: bool):
        import torch

        self.rematch = rematch
        self.rc, self.torch, self.pool = rc, torch, pool
        self.alloc = alloc_cls(pool, torch.int64, "cpu", None, False)
        self.cache = rc.RadixCache.create_simulated(mock_allocator=self.alloc)
        base = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
        self.match_params, self.insert_params = base.MatchPrefixParams, base.InsertParams
        self.evict_params = base.EvictParams

    def serve(self, prompt: array, output: array) -> int:
        rc, cache, alloc, torch = self.rc, self.cache, self.alloc, self.torch
        # Arrival: match all but the last prompt token (SGLang's max_prefix_len cap).
        key = rc.RadixKey(prompt, limit=len(prompt) - 1)
        m = cache.match_prefix(self.match_params(key=key))
        lock = cache.lock(m.last_device_node)
        cached = m.device_prefix_len
        prefix = cache.path_device_indices(m.last_device_node)[:cached]
        n_new = len(prompt) - cached + len(output)
        short = n_new - alloc.available_size()
        if short > 0:
            cache.evict(self.evict_params(num_tokens=short))
        new = alloc.alloc(n_new)
        if new is None:
            raise RuntimeError("pool too small for one request")
        slots = torch.cat((prefix, new))
        # Finish: insert prompt + output[:-1] (the last output token has no KV).
        seq = prompt + output[:-1]
        seq_key = rc.RadixKey(seq)
        res = cache.insert(self.insert_params(key=seq_key, value=slots[: len(seq)]))
        alloc.free_segment(slots[cached : res.prefix_len], start_pos=cached)
        if self.rematch:  # RadixCache.checkpoint: re-read the tree's slots, move the lock
            m = cache.match_prefix(self.match_params(key=seq_key))
            slots[: len(seq)] = cache.path_device_indices(m.last_device_node)
            cache.unlock(lock)
            lock = cache.lock(m.last_device_node)
        alloc.free(slots[len(seq) :])
        cache.unlock(lock)
        return cached

    def check(self) -> None:
        c = self.cache
        seen = self.alloc.available_size() + c.evictable_size() + c.protected_size()
        if seen != self.pool or c.protected_size():
            raise RuntimeError(f"SGLang side leaked slots: {seen} of {self.pool}")


# -- timing ------------------------------------------------------------------------------
Trace = list[tuple[Tokens, Tokens]]
Times = dict[str, list[int]]  # clock ("cpu", "wall") -> ns per request


class OursSide:
    """radixserve's RadixCache + KVSlotAllocator, driven by bench_radix_cache.serve_one
    (or, with rematch, by serve_rematch)."""

    def __init__(self, pool: int, rematch: bool):
        self.alloc = KVSlotAllocator(pool, 1)
        self.cache = RadixCache(self.alloc, 1, "lru")
        self.rematch = rematch

    def serve(self, prompt: Tokens, output: Tokens) -> int:
        if self.rematch:
            return serve_rematch(self.cache, self.alloc, prompt, output)
        return serve_one(self.cache, self.alloc, prompt, output)

    def check(self) -> None:
        check_slot_integrity(self.alloc, self.cache, 0)
        self.cache.check_integrity()


class _GCClock:
    """CPU time spent in the garbage collector (gc.callbacks), to say how much of a
    side's mean is collections its own allocations triggered."""

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.thread_time_ns()
        else:
            self.ns += time.thread_time_ns() - self._t0


def serve_rematch(cache: RadixCache, alloc: KVSlotAllocator, prompt: Tokens, output: Tokens) -> int:
    """serve_one with the release path of KVManager.commit/release: insert (resuming at the
    locked node), re-read the inserted tokens' slots from the node the insert returned (the
    re-match), lock that node, unlock the arrival's."""
    node, cached, slots, seq = admit(cache, alloc, prompt, output)
    last = slots.pop()  # as in serve_one: the last output token has no KV
    res = cache.insert_prefix(seq, slots, start=node)
    slots.append(last)
    alloc.free(slots[cached : res.prefix_len])
    tree_slots = cache.path_slots(res.node)
    cache.lock(res.node)
    cache.unlock(node)
    slots[: len(tree_slots)] = tree_slots
    alloc.free(slots[len(seq) :])
    cache.unlock(res.node)
    return cached


def run_side(side: Any, trace: Trace, to_request: Callable[..., Any], gcc: _GCClock) -> Times:
    """One pass of one side over the trace, with a fresh cache; returns ns per request.

    Each request's container is built untimed at its arrival, as deserialisation would
    build it, so that only in-flight containers are alive for the garbage collector."""
    gc.collect()  # the previous pass's garbage is not this pass's cost
    times: Times = {"cpu": [], "wall": [], "gc": []}
    for p, o in trace:
        prompt, output = to_request(p, o)
        g0, c0, t0 = gcc.ns, time.thread_time_ns(), time.perf_counter_ns()
        side.serve(prompt, output)
        times["wall"].append(time.perf_counter_ns() - t0)
        times["cpu"].append(time.thread_time_ns() - c0)
        times["gc"].append(gcc.ns - g0)
        del prompt, output
    side.check()
    return times


def ours_request(p: Tokens, o: Tokens) -> tuple[Tokens, Tokens]:
    # As the scheduler builds a request: its ids unpacked from the wire's packed int32
    # (a copy per request), its output an array it appends sampled tokens to.
    return tokens_from_wire(p.tobytes()), array(o.typecode, o)


def sglang_request(p: Tokens, o: Tokens) -> tuple[array, array]:
    return array("q", p), array("q", o)  # as SGLang's Req.origin_input_ids holds them


def _fmt(ns: Sequence[int]) -> tuple[float, float]:
    return statistics.fmean(ns) / 1000, statistics.median(ns) / 1000


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sglang-wheel",
        type=Path,
        default=Path("/tmp/sglang-wheel"),
        help="an sglang-*.whl, a directory holding one, or an unpacked wheel (see above)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the trace")
    p.add_argument(
        "--rematch",
        action="store_true",
        help="both sides also re-match after the insert and move the lock, as their "
        "schedulers do at release (KVManager.commit, RadixCache.checkpoint)",
    )
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--pool", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not args.sglang_wheel.exists():
        sys.exit(f"--sglang-wheel {args.sglang_wheel} does not exist.\n{HOW_TO_GET}")
    rc, alloc_cls, wheel = load_sglang(args.sglang_wheel)
    import torch

    torch.set_num_threads(1)  # the scheduler's tensors are tiny; one thread, as in SGLang

    def side() -> SGLangSide:
        return SGLangSide(rc, alloc_cls, args.pool, args.rematch)

    rng = random.Random(args.seed)
    gcc = _GCClock()
    sides: dict[str, tuple[Callable[[], Any], Callable[..., Any]]] = {
        "ours": (lambda: OursSide(args.pool, args.rematch), ours_request),
        "sglang": (side, sglang_request),
    }
    warm = build_trace(args, rng)
    for make, to_request in sides.values():  # warm-up, untimed
        run_side(make(), warm, to_request, gcc)
    trace = build_trace(args, rng)
    pooled: dict[str, Times] = {k: {"cpu": [], "wall": [], "gc": []} for k in sides}
    per_run: list[tuple[float, float]] = []
    for r in range(args.repeats):
        means = {}
        for who in ("ours", "sglang") if r % 2 == 0 else ("sglang", "ours"):
            make, to_request = sides[who]
            t = run_side(make(), trace, to_request, gcc)
            for clock, ns in t.items():
                pooled[who][clock] += ns
            means[who] = statistics.fmean(t["cpu"]) / 1000
        per_run.append((means["ours"], means["sglang"]))
    ours, theirs = pooled["ours"], pooled["sglang"]
    report(args, wheel, ours, theirs, per_run)


def report(
    args: argparse.Namespace,
    wheel: str,
    ours: Times,
    theirs: Times,
    per_run: list[tuple[float, float]],
) -> None:
    print(
        f"trace: {args.groups} groups x {args.per_group}, system {args.system_len}, question "
        f"{args.question_len}, output {args.output_len}, pool {args.pool}, page 1, lru, "
        f"{'with' if args.rematch else 'no'} re-match at release; "
        f"{args.repeats} passes per side, alternating; SGLang from {wheel}"
    )
    print("| clock | radixserve mean | median | SGLang mean | median | mean ratio | median ratio |")
    print("|---|---|---|---|---|---|---|")
    for clock in ("cpu", "wall"):
        om, od = _fmt(ours[clock])
        sm, sd = _fmt(theirs[clock])
        print(
            f"| {clock} | {om:.1f} us | {od:.1f} us | {sm:.1f} us | {sd:.1f} us "
            f"| {om / sm:.2f}x | {od / sd:.2f}x |"
        )
    og, sg = (statistics.fmean(t["gc"]) / 1000 for t in (ours, theirs))
    print(f"of the cpu means, garbage collection: radixserve {og:.1f} us, SGLang {sg:.1f} us")
    runs = ", ".join(f"{o:.0f}/{s:.0f} ({o / s:.2f}x)" for o, s in per_run)
    print(f"per-pass cpu means, radixserve/SGLang us: {runs}")


if __name__ == "__main__":
    main()
