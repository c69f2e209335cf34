"""Compile rehearsal: every Triton kernel specialisation that bench/gpu_check.sh launches,
compiled for sm_90 by the device's Triton (3.6) on a machine without a GPU.

The host wrappers of kernels/ run on meta tensors (shapes and strides, no memory) with the
tile choices they make on an H200 (sm_90, 132 SMs); each launch is caught before it runs
and turned into the signature, constexprs and divisibility attributes that Triton's own
launcher would derive, so the compiled set is the one the GPU would compile. Per
specialisation it reports registers, spill bytes (ptxas -v) and shared memory (what the
launch asks for), and fails on spills or on shared memory above the per-block limit.

    make gpu-rehearsal      # builds .gpu-rehearsal/ (triton==3.6.*) and runs this script
    PYTHONPATH=.gpu-rehearsal/site:. .venv/bin/python bench/gpu_compile.py [--jobs 2]

Exit status: 0 all compiled within limits, 1 a spill / shared-memory / compile failure,
2 the wrong Triton (not the device's version).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # decorate the kernels for compilation
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

DEVICE_TRITON = "3.6"
TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132
SMEM_LIMIT = 227 * 1024  # H200 per-block shared memory, opt-in maximum (232,448 bytes)
# Spill bytes knowingly accepted, by kernel and tile (see extend_attention.tile_config).
ALLOWED_SPILLS = {("_extend_kernel", "bf16", 128, 128, 64): 256}

META = torch.device("meta")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Spec:
    """One compiled kernel: what triton.compile receives, hashable for de-duplication."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]
    num_warps: int
    num_stages: int

    def label(self) -> str:
        consts = {k: v for k, v in self.constexprs if k.isupper() or k.startswith("BLOCK")}
        floats = [t[1:] for _, t in self.signature if t.startswith("*") and t != "*i32"]
        dtypes = "/".join(dict.fromkeys(floats))  # store_kv: source/pool; awq: x/scales
        short = " ".join(f"{k}={v}" for k, v in consts.items() if k != "DOT_PRECISION")
        aligned = f"div16 x{len(self.attrs)}"  # arguments Triton knows are 16-aligned
        return f"{self.kernel} {dtypes} {short} w{self.num_warps}s{self.num_stages} {aligned}"

    def allowed_spill(self) -> int:
        c = dict(self.constexprs)
        dtype = dict(self.signature).get("Q", "")[1:]
        key = (self.kernel, dtype, c.get("HEAD_DIM"), c.get("BLOCK_M"), c.get("BLOCK_N"))
        return ALLOWED_SPILLS.get(key, 0)  # type: ignore[arg-type]


# ---- catching launches -------------------------------------------------------------------


class Recorder:
    """Replaces JITFunction.run: each launch becomes a Spec, nothing runs."""

    def __init__(self) -> None:
        self.specs: dict[Spec, JITFunction] = {}
        self.launches = 0
        self._backend = make_backend(TARGET)
        self._binders: dict[int, Callable] = {}

    def run(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = create_function_from_signature(fn.signature, fn.params, self._backend)
            self._binders[id(fn)] = binder
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self._backend, kwargs, bound, specialization, options
        )
        names = list(signature)
        spec = Spec(
            fn.__name__,
            tuple(signature.items()),
            tuple((names[path[0]], v) for path, v in sorted(constexprs.items())),
            tuple((path[0], tuple(map(tuple, a))) for path, a in sorted(attrs.items()) if a),
            options.num_warps,
            options.num_stages,
        )
        self.specs.setdefault(spec, fn)
        self.launches += 1


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Launches recorded, tiles chosen as on an H200."""
    from kernels.triton import awq_gemm, decode_attention, extend_attention
    from services.worker.attention import triton_backend

    rec = Recorder()
    saved = [
        (JITFunction, "run", JITFunction.run),
        (decode_attention, "_launch_config", decode_attention._launch_config),
        (extend_attention, "_launch_config", extend_attention._launch_config),
        (awq_gemm, "_num_sms", awq_gemm._num_sms),
        (awq_gemm, "choose_config", awq_gemm.choose_config),
    ]
    choose = awq_gemm.choose_config
    cuda0 = torch.device("cuda", 0)

    def run(self, *args, grid, warmup, **kwargs):
        rec.run(self, args, kwargs)

    JITFunction.run = run  # type: ignore[method-assign]
    decode_attention._launch_config = lambda d, dt, dev: decode_attention.tile_config(d, dt, 9)
    extend_attention._launch_config = lambda d, dt, dev: extend_attention.tile_config(d, dt, 9)
    awq_gemm._num_sms = lambda index: H200_SMS  # type: ignore[assignment]
    awq_gemm.choose_config = lambda m, n, k, g, dev, dt: choose(m, n, k, g, cuda0, dt)
    assert triton_backend  # imported so that splits() below sees the real module
    try:
        yield rec
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def num_kv_splits(batch: int, kv_heads: int) -> int:
    """choose_num_kv_splits on an H200 (it reads the SM count from the device)."""
    return max(4, min(16, -(-4 * H200_SMS // (batch * kv_heads))))


# ---- the launches of the GPU check, on meta tensors ----------------------------------------


def _i32(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int32, device=META)


def attention(
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    tokens: int,
    batch: int,
    table_width: int,
    fused_qkv: bool = False,
    extend_tiles: tuple = (None,),
    decode: tuple[tuple[int, int | None], ...] = (),
) -> None:
    """extend (each tile), decode ((splits, block_n) each) and store_kv at one shape.
    fused_qkv: q, k, v are views of one projection output, as the model hands them."""
    from kernels.triton.decode_attention import decode_attention
    from kernels.triton.extend_attention import extend_attention
    from kernels.triton.kv_store import store_kv

    pool = torch.empty(tokens + 16, hkv, d, dtype=dtype, device=META)
    if fused_qkv:
        qkv = torch.empty(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=META)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    else:
        q = torch.empty(tokens, hq, d, dtype=dtype, device=META)
        kv = torch.empty(tokens, 2, hkv, d, dtype=FP32, device=META)  # test_kernels' store
        k, v = kv[:, 0], kv[:, 1]
    table, rows = _i32(batch + 3, table_width), _i32(batch)
    store_kv(pool, pool, torch.empty(tokens, dtype=torch.int64, device=META), k, v)
    for tile in extend_tiles:
        bm, bn = tile or (None, None)
        args = (q, pool, pool, _i32(batch + 1), table, rows, _i32(batch), 0.1, tokens)
        extend_attention(*args, block_m=bm, block_n=bn)
    qd = q[:batch]
    for splits, block_n in decode:
        decode_attention(qd, pool, pool, table, rows, _i32(batch), 0.1, splits, block_n=block_n)


def awq(m: int, k: int, n: int, group: int, dtype: torch.dtype, configs=(None,)) -> None:
    from kernels.triton.awq_gemm import awq_gemm

    x = torch.empty(m, k, dtype=dtype, device=META)
    qw, qz = _i32(k, n // 8), _i32(k // group, n // 8)
    scales = torch.empty(k // group, n, dtype=FP16, device=META)
    for cfg in configs:
        for bias in (None, torch.empty(n, dtype=dtype, device=META)):
            awq_gemm(x, qw, qz, scales, bias, config=cfg)


def kernel_tests() -> None:
    """tests/unit/test_kernels.py as it runs on a GPU (its DTYPES and HEAD_DIMS there)."""
    for dtype in (FP32, BF16):
        for d in (24, 64, 128):
            for hq, hkv in ((2, 2), (4, 2), (7, 1)):
                for tokens, batch, width in ((31, 3, 51), (41, 2, 95)):  # the RAGGED cases
                    attention(
                        hq, hkv, d, dtype, tokens, batch, width, extend_tiles=((16, 16), None)
                    )
                attention(hq, hkv, d, dtype, 3, 3, 76, decode=((1, 16), (4, 16)))
        attention(3, 3, 24, dtype, 5, 1, 8)  # store_kv's own test (3 heads of 24)
    attention(4, 2, 16, FP32, 2, 2, 45, decode=((3, None), (7, None), (64, None)))
    attention(4, 2, 32, FP32, 65, 2, 50, extend_tiles=(None, (32, 16), (16, 16)))
    attention(2, 1, 16, FP32, 6, 1, 15)  # the strided query view
    attention(8, 2, 64, FP16, 3, 3, 300, decode=((8, None),))  # the CUDA-graph replay


def awq_tests() -> None:
    """tests/unit/test_awq_kernel.py on a GPU: every case and dtype, splits, serving sizes."""
    from kernels.triton.awq_gemm import GemmConfig

    for dtype in (FP32, FP16, BF16):
        for m, k, n, group in (
            (1, 128, 96, 32),
            (7, 128, 40, 64),
            (33, 64, 64, 64),
            (3, 96, 32, 96),
        ):
            awq(m, k, n, group, dtype)
    awq(5, 192, 64, 32, FP32, [GemmConfig(16, 32, 32, s, 4, 1) for s in (2, 3)])
    for dtype in (FP16, BF16):
        for m in (1, 16, 64, 300):
            awq(m, 4096, 1024, 128, dtype)
    awq(4, 1024, 512, 128, FP16)  # the CUDA-graph replay
    # The tiny AWQ Llama served through the kernel (hidden 64, 4/2 heads of 16, fp16).
    for m in (2, 7, 9):
        for k, n in ((64, 64), (64, 32), (64, 256), (128, 64)):
            awq(m, k, n, 32, FP16)
    for tokens, batch in ((7, 2), (2, 2)):
        attention(4, 2, 16, FP16, tokens, batch, 32, fused_qkv=True, decode=((16, None),))


def bench_rows() -> None:
    """bench/gpu_bench.py: decode with its sweep, extend, the AWQ rows and sweep."""
    from kernels.triton.awq_gemm import GemmConfig

    splits = num_kv_splits(64, 8)
    sweep = tuple((s, bn) for s in sorted({4, 8, 16, splits}) for bn in (32, 64, 128))
    attention(32, 8, 128, BF16, 64, 64, 4096, decode=((splits, None), *sweep))
    attention(32, 8, 128, BF16, 8 * 2048, 8, 2048)
    awq(16, 4096, 11008, 128, FP16)
    for m in (1, 16, 64, 2048):
        awq(m, 4096, 11008, 128, FP16)
    cfgs = [
        GemmConfig(16, bn, bk, s, 4, 4)
        for bn in (64, 128)
        for bk in (64, 128)
        for s in (1, 2, 4, 8)
    ]
    awq(1, 4096, 11008, 128, FP16, cfgs)


def model_rows() -> None:
    """bench/gpu_model_check.py and the model rows of gpu_bench.py: the served shapes."""
    # Qwen2-style tiny (14/2 heads of 128), graphs up to 8, sampling up to 4.
    for tokens, batch in ((55, 3), (13, 1), (7, 7)):
        attention(14, 2, 128, BF16, tokens, batch, 256, fused_qkv=True)
    for bs in (1, 2, 3, 4, 5, 7, 8):
        attention(
            14, 2, 128, BF16, bs, bs, 256, fused_qkv=True, decode=((num_kv_splits(bs, 2), None),)
        )
    # The 7B-shaped profile (28/4 heads of 128), graphs up to 64.
    for bs in (1, 2, 4, 8, 16, 32, 64):
        attention(
            28, 4, 128, BF16, bs, bs, 4160, fused_qkv=True, decode=((num_kv_splits(bs, 4), None),)
        )
    # Decode tokens/s: Llama 1024 hidden, 16/8 heads of 64, batch 1 and 32.
    for bs in (1, 32):
        attention(16, 8, 64, BF16, 128 * bs, bs, 200, fused_qkv=True)
        attention(
            16, 8, 64, BF16, bs, bs, 200, fused_qkv=True, decode=((num_kv_splits(bs, 8), None),)
        )


PLAN = [kernel_tests, awq_tests, bench_rows, model_rows]


def collect() -> dict[Spec, JITFunction]:
    with recording() as rec:
        for part in PLAN:
            part()
    print(f"gpu_compile: {rec.launches} launches, {len(rec.specs)} specialisations", flush=True)
    return rec.specs


# ---- compiling -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    label: str
    registers: int
    spill_bytes: int
    shared: int
    seconds: float
    allowed_spill: int
    error: str = ""

    def problems(self) -> list[str]:
        out = [self.error] if self.error else []
        if self.spill_bytes > self.allowed_spill:
            out.append(f"spills {self.spill_bytes} bytes")
        if self.shared > SMEM_LIMIT:
            out.append(f"shared memory {self.shared} > {SMEM_LIMIT}")
        return out


_ITEMS: list[tuple[Spec, JITFunction]] = []  # set before the pool forks: workers index it


def compile_one(index: int) -> Result:
    spec, fn = _ITEMS[index]
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v when it compiles
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
            os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: ptxas always runs
            src = ASTSource(
                fn,
                dict(spec.signature),
                dict(spec.constexprs),
                {(i,): [list(x) for x in a] for i, a in spec.attrs},
            )
            kernel = triton.compile(
                src,
                target=TARGET,
                options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages),
            )
    except Exception as e:  # a compile error is a finding, not a crash of the rehearsal
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
        return Result(spec.label(), 0, 0, 0, time.perf_counter() - start, 0, msg)
    text = log.getvalue()
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", text)), default=-1)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", text))
    return Result(
        spec.label(),
        regs,
        spills,
        int(kernel.metadata.shared),
        time.perf_counter() - start,
        spec.allowed_spill(),
    )


def report(results: list[Result]) -> int:
    print("| specialisation (sm_90) | registers | spill bytes | shared bytes | result |")
    print("|---|---|---|---|---|")
    failed = 0
    for r in sorted(results, key=lambda r: r.label):
        problems = r.problems()
        failed += bool(problems)
        verdict = "FAIL: " + "; ".join(problems) if problems else "PASS"
        print(f"| {r.label} | {r.registers} | {r.spill_bytes} | {r.shared} | {verdict} |")
    ok = [r for r in results if not r.error]
    print(
        f"gpu_compile: {len(results)} specialisations, max {max(r.registers for r in ok)} "
        f"registers, max {max(r.shared for r in ok)} bytes of shared memory "
        f"(limit {SMEM_LIMIT}), {sum(r.spill_bytes > 0 for r in ok)} spilling, "
        f"{sum(r.seconds for r in results):.0f} s of compiling; {failed} failed",
        flush=True,
    )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--list", action="store_true", help="list the specialisations only")
    args = parser.parse_args()
    if not triton.__version__.startswith(DEVICE_TRITON + "."):
        print(
            f"gpu_compile: triton {triton.__version__} from {triton.__file__}, not the "
            f"device's {DEVICE_TRITON}: run it through `make gpu-rehearsal`",
            file=sys.stderr,
        )
        return 2
    specs = collect()
    if args.list:
        for spec in sorted(specs, key=Spec.label):
            print(spec.label())
        return 0
    _ITEMS[:] = specs.items()
    ctx = multiprocessing.get_context("fork")  # the workers inherit the recorded kernels
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        results = list(pool.map(compile_one, range(len(_ITEMS)), chunksize=2))
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
