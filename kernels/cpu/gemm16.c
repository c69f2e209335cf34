/* Built and loaded by kernels/cpu_gemm.py (kernels/_cc.py compiles it on first use). */
#include <stdint.h>
#include <stdlib.h>
#include "half.h"

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w in bfloat16 or float16: x (float32,
   bfloat16 or float16) rounded to w's dtype, every product exact, the sums in float32, the
   bias (float32) added, y in x's dtype (wdt / xdt / ydt: half.h's codes).

   gemm.c's blocking on 16-bit weights: blocks of NR = 4 weight rows split over the
   threads, K in chunks of KC elements (the 4 x KC chunk, 8 KiB, stays in L1 while every
   tile of up to MR = 3 x rows runs over it), the next block's rows prefetched across the
   tiles, MR x NR accumulators in registers, lanes summed once at the end: per y[m, n] the
   same operations whatever M, the tile and the thread count (batch-invariant).

   Vocabularies, the widest the build has:
   - AVX512_BF16, bfloat16 weights: vdpbf16ps on 32 elements (pairs of exact products
     added into 16 float lanes); x rows prepared as bfloat16.
   - AVX-512 (F + BW): weights widened to float (bfloat16: a 16-bit shift; float16:
     vcvtph2ps) and FMA on 16 lanes; x rows prepared as float.
   - AVX2 + FMA (+ F16C for float16): the same on 8 lanes.
   - portable C: 8 partial sums per output, no blocking. */

#define NR 4
#define MR 3
#define KC 1024 /* elements per chunk */
#define LINE 32 /* 16-bit weights per 64-byte line: the prefetch stride */
#define XPAD 32 /* x rows are prepared zero-padded to a multiple of this */

#define REG(v) __asm__("" : "+x"(v))

static inline void* y_at(void* y, int64_t i, int ydt) {
    return (char*)y + i * dt_size(ydt);
}

static inline void store_y(void* y, int64_t i, float v, int ydt) {
    if (ydt == DT_BF16) st_f(y, i, v, DT_BF16);
    else if (ydt == DT_F16) st_f(y, i, v, DT_F16);
    else st_f(y, i, v, DT_F32);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#undef REG
#define REG(v) __asm__("" : "+v"(v))
#define HAVE_AVX512 1

static inline float hsum16(__m512 v) { /* the two halves first, then the 8-lane tree */
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

static inline __m256i tail16(const uint16_t* p, int n) {
    return _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
}

/* Common to the AVX-512 vocabularies: float accumulators of 16 lanes. */
#define VEC __m512
#define ACC_LANES 16
#define VZERO() _mm512_setzero_ps()
#define VLOADA(p) _mm512_loadu_ps(p)
#define VSTOREA(p, v) _mm512_storeu_ps(p, v)
#define HSUM(v) hsum16(v)

#if defined(__AVX512BF16__)
#define HAVE_DP 1
static inline __m512bh tail32(const uint16_t* p, int n) {
    const __mmask32 m = n >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << n) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
#define TILE tile_dp
#define BLOCK block_dp
#define XT uint16_t
#define XV __m512bh
#define STEP 32
#define LOADX(p) ((__m512bh)_mm512_loadu_si512((const void*)(p)))
#define LOADW(p) ((__m512bh)_mm512_loadu_si512((const void*)(p)))
#define LOADW_TAIL(p, n) tail32(p, n)
#define DOT(acc, xv, wv) _mm512_dpbf16_ps(acc, xv, wv)
#include "gemm16_tile.h"
#undef TILE
#undef BLOCK
#undef XT
#undef XV
#undef STEP
#undef LOADX
#undef LOADW
#undef LOADW_TAIL
#undef DOT
#endif

#define XT float
#define XV __m512
#define STEP 16
#define LOADX(p) _mm512_loadu_ps(p)
#define DOT(acc, xv, wv) _mm512_fmadd_ps(xv, wv, acc)
#define TILE tile_bf16
#define BLOCK block_bf16
#define LOADW(p) bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(p)))
#define LOADW_TAIL(p, n) bf16x16_to_f32(tail16(p, n))
#include "gemm16_tile.h"
#undef TILE
#undef BLOCK
#undef LOADW
#undef LOADW_TAIL
#define TILE tile_f16
#define BLOCK block_f16
#define LOADW(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define LOADW_TAIL(p, n) _mm512_cvtph_ps(tail16(p, n))
#include "gemm16_tile.h"
#define HAVE_F16 1

#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1

/* The first n < 8 weights, the rest zero (no masked 16-bit loads in AVX2). */
static inline __m128i tail8(const uint16_t* p, int n) {
    uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; ++i) b[i] = p[i];
    return _mm_loadu_si128((const __m128i*)b);
}

#define VEC __m256
#define ACC_LANES 8
#define VZERO() _mm256_setzero_ps()
#define VLOADA(p) _mm256_loadu_ps(p)
#define VSTOREA(p, v) _mm256_storeu_ps(p, v)
#define HSUM(v) hsum8(v)
#define XT float
#define XV __m256
#define STEP 8
#define LOADX(p) _mm256_loadu_ps(p)
#define DOT(acc, xv, wv) _mm256_fmadd_ps(xv, wv, acc)
#define TILE tile_bf16
#define BLOCK block_bf16
#define LOADW(p) bf16x8_to_f32(_mm_loadu_si128((const __m128i*)(p)))
#define LOADW_TAIL(p, n) bf16x8_to_f32(tail8(p, n))
#include "gemm16_tile.h"
#undef TILE
#undef BLOCK
#undef LOADW
#undef LOADW_TAIL
#if defined(__F16C__)
#define TILE tile_f16
#define BLOCK block_f16
#define LOADW(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define LOADW_TAIL(p, n) _mm256_cvtph_ps(tail8(p, n))
#include "gemm16_tile.h"
#define HAVE_F16 1
#endif
#endif

/* 3: AVX512_BF16, 2: AVX-512, 1: AVX2/FMA, 0: portable C: which vocabulary serves
   bfloat16 weights (kernels/cpu_gemm.py's isa16()). */
int rs_gemm16_isa(void) {
#if defined(HAVE_DP)
    return 3;
#elif defined(HAVE_AVX512)
    return 2;
#elif defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Whether weights of dtype wdt have a vector path here (float16 needs F16C). */
int rs_gemm16_vector(int wdt) {
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
#if defined(HAVE_F16)
    return wdt == DT_BF16 || wdt == DT_F16;
#else
    return wdt == DT_BF16;
#endif
#else
    (void)wdt;
    return 0;
#endif
}

/* Portable C: y[m, n] as 8 partial sums over k, then a fixed tree; the same order on any
   machine, no blocking (this path only keeps the kernel correct where no vector one
   builds). */
static void gemm_c(const void* x, int xdt, int64_t ldx, const uint16_t* w, int wdt,
                   int64_t ldw, const float* bias, void* y, int ydt, int64_t M, int64_t N,
                   int64_t K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < K; ++k) {
                const uint16_t wk = w[n * ldw + k];
                const float xv = round_to(ld_f(x, m * ldx + k, xdt), wdt);
                a[k & 7] += xv * (wdt == DT_F16 ? f16_to_f32(wk) : bf16_to_f32(wk));
            }
            const float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
            store_y(y, m * N + n, bias ? s + bias[n] : s, ydt);
        }
}

/* x rows as the tile reads them: [M, kp] of `out` elements (bfloat16 bits when `bits`,
   else float), each x rounded to the weights' dtype, zero from K to kp. */
static void prepare_x(const void* x, int xdt, int64_t ldx, int wdt, int64_t M, int64_t K,
                      int64_t kp, int bits, void* out) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < kp; ++k) {
            float v = 0.0f;
            if (k < K) {
                const int64_t i = m * ldx + k;
                v = xdt == DT_BF16 ? ld_f(x, i, DT_BF16)
                    : xdt == DT_F16 ? ld_f(x, i, DT_F16) : ld_f(x, i, DT_F32);
                v = wdt == DT_F16 ? round_to(v, DT_F16) : round_to(v, DT_BF16);
            }
            if (bits) ((uint16_t*)out)[m * kp + k] = f32_to_bf16(v);
            else ((float*)out)[m * kp + k] = v;
        }
}

/* Returns 0, 1 when out of memory, 2 for a weight dtype this build cannot serve. */
int rs_gemm16(const void* x, int xdt, int64_t ldx, const uint16_t* w, int wdt, int64_t ldw,
              const float* bias, void* y, int ydt, int64_t M, int64_t N, int64_t K,
              int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (wdt != DT_BF16 && wdt != DT_F16) return 2;
    if (K <= 0) { /* an empty sum: y = bias or 0 */
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) store_y(y, m * N + n, bias ? bias[n] : 0.0f, ydt);
        return 0;
    }
    if (!rs_gemm16_vector(wdt)) {
        gemm_c(x, xdt, ldx, w, wdt, ldw, bias, y, ydt, M, N, K, nthreads);
        return 0;
    }
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
    const int64_t kp = (K + XPAD - 1) / XPAD * XPAD;
#if defined(HAVE_DP)
    const int dp = wdt == DT_BF16;
#else
    const int dp = 0;
#endif
    /* bfloat16 x rows already padded (K a multiple of 32: the models' sizes) are read in
       place by the dot-product tiles; all else is prepared once per call. */
    const int in_place = dp && xdt == DT_BF16 && K == kp;
    void* xb = NULL;
    if (!in_place) {
        xb = malloc((size_t)M * kp * (dp ? 2 : 4));
        if (xb == NULL) return 1;
        prepare_x(x, xdt, ldx, wdt, M, K, kp, dp, xb);
    }
    const void* xo = in_place ? x : xb;
    const int64_t ldo = in_place ? ldx : kp;
    const int64_t blocks = (N + NR - 1) / NR;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float* part =
            K > KC ? (float*)malloc(sizeof(float) * (size_t)(M + MR) * NR * ACC_LANES) : NULL;
        if (K > KC && part == NULL) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (failed) continue;
            const int64_t n = b * NR;
            const int nr = N - n < NR ? (int)(N - n) : NR;
            const int pf = n + 2 * NR <= N;
            const uint16_t* wn = w + n * ldw;
            const float* bn = bias ? bias + n : NULL;
            void* yn = y_at(y, n, ydt);
#if defined(HAVE_DP)
            if (dp) {
                block_dp((const uint16_t*)xo, ldo, wn, ldw, bn, yn, M, N, K, ydt, nr, pf, part);
                continue;
            }
#endif
#if defined(HAVE_F16)
            if (wdt == DT_F16) {
                block_f16((const float*)xo, ldo, wn, ldw, bn, yn, M, N, K, ydt, nr, pf, part);
                continue;
            }
#endif
            block_bf16((const float*)xo, ldo, wn, ldw, bn, yn, M, N, K, ydt, nr, pf, part);
        }
        free(part);
    }
    free(xb);
    return failed;
#else
    return 2; /* unreachable: rs_gemm16_vector is 0 without vector paths */
#endif
}
