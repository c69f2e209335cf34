/* Built and loaded by kernels/cpu_gemm.py (kernels/_cc.py compiles it on first use). */
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
