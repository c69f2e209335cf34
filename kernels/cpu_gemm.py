"""Small-M float32 GEMM on CPU: ``y = x @ W^T (+ b)`` over the plain [N, K] weight, a C kernel.

Why: a decode step's linears run at M = 1..64 rows, and every step the model's weights
stream from memory, cold; oneDNN's packed path reads them far below the memory bandwidth
there. This kernel streams each weight row from memory once and reuses it from L1 for all
M rows: blocks of 4 weight rows (a contiguous run of W per thread, OpenMP over the blocks),
K in chunks of 512 so that the 4 x 512 weight chunk (8 KiB) stays in L1 while tiles of
3 x rows run over it, 3 x 4 AVX2/FMA (or AVX-512) accumulators in registers, lanes summed
once at the end. Where it beats oneDNN: services/worker/cpu_linear.py.

The next block's rows are prefetched meanwhile, spread over the block's tiles (tile t
fetches rows t, t + T, ...: fetching all 128 lines in the first tile overflowed the line
fill buffers), into L2 (``_MM_HINT_T1``: into L1 they evicted the chunk in use on a core
with a 32 KiB L1d). The rows are split evenly over the tiles (M = 16: 3,3,3,3,2,2), since a
trailing 1-row tile has too few accumulators to hide the FMA latency. A prefetch changes no
arithmetic. Figures: docs/benchmarks.md ("Worker") and docs/benchmarks-history.md.

Numerics: float32 with FMA, a fixed order (per lane k ascending, then a fixed tree over
the lanes, then + bias), no -ffast-math. The order does not depend on M, on which tile a
row lands in or on the thread count, so a row's result is bit-identical whatever batch it
is in. Against float64: max|err| / max|ref| ~1e-6, as oneDNN's. Other CPUs: the AVX2
intrinsics sit behind ``__AVX2__`` / ``__FMA__``; elsewhere a portable C path with the same
blocking builds instead.

Built by kernels/_cc.py (system ``cc -O3
-march=native -fopenmp`` on first use, cached by source + flags + CPU flags, atomic write);
``RADIXSERVE_CPU_KERNELS=0``, no compiler or a failed build: ``load()`` returns None.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import _cc

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), float32, K contiguous in x and w, y contiguous.

   Blocks of NR = 4 weight rows, split across the threads (each thread streams a contiguous
   part of w from memory once). K is cut into chunks of KC floats: the NR x KC weight chunk
   (8 KiB) stays in L1 while every tile of up to MR = 3 x rows runs over it, so each weight
   byte comes from memory once for all M rows. A tile keeps MR x NR 8-lane accumulators in
   registers; between chunks they go to a small per-thread buffer, and only after the last
   chunk are they summed across lanes. So every y[m, n] is the same sequence of float
   operations whatever M, the tile it lands in and the thread count: per lane, k ascending;
   then the lanes in a fixed tree; then + bias. */

#define NR 4
#define MR 3
#define KC 512

/* Keeps a loaded vector in a register: GCC would otherwise fold the load into each of the
   MR FMAs that use it (MR loads instead of one; at MR x NR = 12 FMAs per step that makes
   the loop load-bound). An empty asm, no instruction. */
#define REG(v) __asm__("" : "+x"(v))

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* The vector vocabulary of the tile below, per width: 16 lanes in zmm registers with tails
   through a mask register, or 8 in ymm registers with tails through a lane mask. */
#if defined(__AVX512F__)
#undef REG
#define REG(v) __asm__("" : "+v"(v))
#define LANES 16
typedef __m512 vec;
typedef __mmask16 tail_t;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOAD_TAIL(p, m) _mm512_maskz_loadu_ps(m, p)
static inline tail_t tail_of(int64_t n) { return (__mmask16)((1u << n) - 1u); }
#else
#define LANES 8
typedef __m256 vec;
typedef __m256i tail_t;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOAD_TAIL(p, m) _mm256_maskload_ps(p, m)
static const int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline tail_t tail_of(int64_t n) {
    return _mm256_loadu_si256((const __m256i*)(tail_mask + 8 - n));
}
#endif

int rs_gemm_lanes(void) { return LANES; }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* A fixed tree over the lanes (16 lanes: the two halves first, then the 8-lane order). */
static inline float hsum(vec v) {
#if defined(__AVX512F__)
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
#else
    return hsum8(v);
#endif
}

/* One tile: mr x rows by nr weight rows over k in [k0, k1). always_inline with constant
   mr / nr: the accumulators become registers. */
static inline __attribute__((always_inline)) void tile(
    const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0, int64_t k1,
    const int mr, const int nr, float* part, int first, int last, float* y, int64_t ldy,
    const float* bias, int pf0, int pfs) {
    vec acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
            acc[i][j] = first ? VZERO() : VLOAD(part + (i * NR + j) * LANES);
    int64_t k = k0;
    if (pf0 >= 0) /* fetch rows pf0, pf0 + pfs, ... of the next block meanwhile (cold weights) */
        for (; k + 16 <= k1; k += 16) {
            for (int j = pf0; j < nr; j += pfs) /* into L2: see the module docstring */
                _mm_prefetch((const char*)(w + (NR + j) * ldw + k), _MM_HINT_T1);
            for (int h = 0; h < 16; h += LANES) {
                vec xv[MR];
                for (int i = 0; i < mr; ++i) xv[i] = VLOAD(x + i * ldx + k + h);
                for (int j = 0; j < nr; ++j) {
                    vec wv = VLOAD(w + j * ldw + k + h);
                    REG(wv);
                    for (int i = 0; i < mr; ++i) acc[i][j] = VFMA(xv[i], wv, acc[i][j]);
                }
            }
        }
    for (; k + LANES <= k1; k += LANES) {
        vec xv[MR];
        for (int i = 0; i < mr; ++i) xv[i] = VLOAD(x + i * ldx + k);
        for (int j = 0; j < nr; ++j) {
            vec wv = VLOAD(w + j * ldw + k);
            REG(wv);
            for (int i = 0; i < mr; ++i) acc[i][j] = VFMA(xv[i], wv, acc[i][j]);
        }
    }
    if (k < k1) { /* masked lanes load 0 for both: 0 * 0 adds nothing */
        const tail_t m = tail_of(k1 - k);
        vec wv[NR];
        for (int j = 0; j < nr; ++j) wv[j] = VLOAD_TAIL(w + j * ldw + k, m);
        for (int i = 0; i < mr; ++i) {
            const vec xv = VLOAD_TAIL(x + i * ldx + k, m);
            for (int j = 0; j < nr; ++j) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    if (!last) {
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j) VSTORE(part + (i * NR + j) * LANES, acc[i][j]);
        return;
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            const float s = hsum(acc[i][j]);
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

#else /* portable C: the same blocking and lane structure, scalar code */

#define LANES 8
int rs_gemm_lanes(void) { return 0; }

static inline float hsum(const float* v) {
    float a[4];
    for (int l = 0; l < 4; ++l) a[l] = v[l] + v[l + 4];
    a[0] += a[2];
    a[1] += a[3];
    return a[0] + a[1];
}

static inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0,
                        int64_t k1, const int mr, const int nr, float* part, int first, int last,
                        float* y, int64_t ldy, const float* bias, int pf0, int pfs) {
    (void)pf0;
    (void)pfs;
    float acc[MR][NR][8];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
            for (int l = 0; l < 8; ++l) acc[i][j][l] = first ? 0.0f : part[(i * NR + j) * 8 + l];
    for (int64_t k = k0; k < k1; k += 8) {
        const int n = k1 - k < 8 ? (int)(k1 - k) : 8;
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j)
                for (int l = 0; l < n; ++l) acc[i][j][l] += x[i * ldx + k + l] * w[j * ldw + k + l];
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            if (!last) {
                for (int l = 0; l < 8; ++l) part[(i * NR + j) * 8 + l] = acc[i][j][l];
            } else {
                const float s = hsum(acc[i][j]);
                y[i * ldy + j] = bias ? s + bias[j] : s;
            }
        }
}
#endif

/* Tiles with the row counts as constants: mr x rows (the rows split as evenly as MR allows,
   so that no 1-row tile, latency-bound on its 4 accumulators, trails a larger M) by 4
   weight rows (all but the last block), and every remainder. */
#define TILE(MRC, NRC) \
    tile(xm, ldx, wn, ldw, k0, k1, MRC, NRC, pm, first, last, ym, N, bn, pf0, (int)T)
#define ROWS(NRC) \
    switch (mr) { \
        case 1: TILE(1, NRC); break; \
        case 2: TILE(2, NRC); break; \
        default: TILE(3, NRC); break; \
    }
static void block(const float* x, int64_t ldx, const float* wn, int64_t ldw, const float* bn,
                  float* yn, int64_t M, int64_t N, int64_t K, int nr, int pf, float* part) {
    const int64_t T = (M + MR - 1) / MR; /* tiles per chunk */
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K;
        const int first = k0 == 0, last = k1 == K;
        int mr = 0;
        for (int64_t t = 0, m = 0; t < T; ++t, m += mr) {
            mr = (int)((M - m + (T - t) - 1) / (T - t));
            const float* xm = x + m * ldx;
            float* ym = yn + m * N;
            float* pm = part + m * NR * LANES;
            /* Tile t fetches rows t, t + T, ... of the next block: the fetches spread over
               the block's tiles instead of queueing behind the first one's. */
            const int pf0 = pf && t < NR ? (int)t : -1;
            if (nr == 4) ROWS(4) else if (nr == 3) ROWS(3) else if (nr == 2) ROWS(2) else ROWS(1)
        }
    }
}

/* Returns nonzero when a thread's partial-sum buffer could not be allocated. */
int rs_gemm_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                float* y, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) { /* an empty sum: y = bias or 0 */
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) y[m * N + n] = bias ? bias[n] : 0.0f;
        return 0;
    }
    const int64_t blocks = (N + NR - 1) / NR;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float* part = K > KC ? (float*)malloc(sizeof(float) * (size_t)(M + MR) * NR * LANES) : NULL;
        if (K > KC && part == NULL) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (failed) continue;
            const int64_t n = b * NR;
            const int nr = N - n < NR ? (int)(N - n) : NR;
            block(x, ldx, w + n * ldw, ldw, bias ? bias + n : NULL, y + n, M, N, K, nr,
                  n + 2 * NR <= N, part);
        }
        free(part);
    }
    return failed;
}
"""

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

Gemm = Callable[..., torch.Tensor]


def _library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    flags = [*_cc.FLAGS, *extra_flags]
    return _cc.load_library("gemm", _SOURCE, "CPU small-M GEMM", log, flags)


@functools.cache
def lanes(extra_flags: tuple[str, ...] = ()) -> int:
    """Float lanes of the built kernel's vectors: 16 (AVX-512), 8 (AVX2/FMA), 0 (portable
    C, or no kernel). Where oneDNN overtakes it depends on this (services/worker/cpu_linear.py)."""
    lib = _library(extra_flags)
    if lib is None:
        return 0
    lib.rs_gemm_lanes.restype = _I32
    return int(lib.rs_gemm_lanes())


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """The kernel as ``fn(x, weight, bias=None) -> y``, or None where it cannot be built
    here (the caller keeps its torch path). ``extra_flags`` go to the compiler after
    ``-march=native``: the tests build the AVX2 variant on an AVX-512 CPU with
    ``("-mno-avx512f",)``."""
    lib = _library(extra_flags)
    if lib is None:
        return None
    fn = lib.rs_gemm_f32
    fn.restype = _I32
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I32]
    return functools.partial(_call, fn)


def supports(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """A float32 CPU weight [N, K] with K contiguous (and a float32 contiguous bias)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.stride(1) == 1
        and (
            bias is None
            or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.is_contiguous())
        )
    )


def _call(
    fn,
    x: torch.Tensor,  # [..., K] float32
    weight: torch.Tensor,  # [N, K] float32, K contiguous (supports())
    bias: torch.Tensor | None = None,  # [N] float32 contiguous
) -> torch.Tensor:  # [..., N] float32
    n, k = weight.shape
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"x must be float32 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    # A view where it can be (any row stride is fine, K must be dense); -1 fails for K = 0.
    x2 = x.reshape(x.numel() // k if k else x.shape[:-1].numel(), k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    if m == 0:
        return y
    failed = fn(
        x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu gemm: out of memory for the partial sums")
    return y


def gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact answer (float64), in float64: the tests' reference."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b)
