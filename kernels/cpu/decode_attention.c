/* Built and loaded by kernels/cpu_decode_attention.py (kernels/_cc.py compiles it on first use). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "half.h"

/* The pools hold float32 or bfloat16 (dt, half.h's codes; the Python side takes float16 to
   torch's path). The query rows and the output are float32 inside: a 16-bit item's query
   rows are widened into a per-thread buffer first and its output rounded at the end, so
   the softmax and every sum stay float32; only the K and V row loads know the dtype. */

static inline void softmax_rows(float* buf, int n, int L, const int* vis);

/* Element `i` of a pool as a pointer (i counts elements of dtype dt). */
static inline __attribute__((always_inline)) const void* at(const void* p, int64_t i,
                                                            const int dt) {
    return (const char*)p + i * (dt == DT_F32 ? 4 : 2);
}

/* Eight independent partial sums: vectorizes without -ffast-math (lane-wise adds). */
static inline float dot_c(const float* a, const float* b, int d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; ++i) s += a[i] * b[i];
    return s;
}

/* One row of L scores in place: s = exp(s - max) / sum. Vector code where the CPU has it:
   libm's scalar expf was most of this kernel's time (one per query head and key). */
#if defined(__AVX512F__)
#include <immintrin.h>
#include "exp16_avx512.h"
static inline float dot(const float* a, const float* b, int d) {
    if (d & 15) return dot_c(a, b, d);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

static void softmax_row(float* s, int L) {
    const __m512 lo = _mm512_set1_ps(-87.3365478515625f);
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int j = 0; j < L; j += 16) {
        const __mmask16 k = L - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j)) - 1u);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int j = 0; j < L; j += 16) {
        const __mmask16 k = L - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j)) - 1u);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m);
        const __mmask16 keep = k & (__mmask16)~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16_core(_mm512_max_ps(x, lo)));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int j = 0; j < L; j += 16) {
        const __mmask16 k = L - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j)) - 1u);
        _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv));
    }
}

/* Lane j of the result = the sum of v[j]'s 16 lanes: a transposing tree of 30 shuffles and
   15 adds for 16 dot products, where 16 _mm512_reduce_add_ps are ~8 dependent steps each
   (they were most of the kernel's time with the K/V rows hot). The tree leaves lane p
   holding v[f(p)], f = (0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15); f is its own inverse, so
   one permute by f puts every sum in its lane. */
static inline __m512 hsum16(const __m512* v) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                              _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[i], s1[i + 4], 0x88),
                              _mm512_shuffle_f32x4(s1[i], s1[i + 4], 0xDD));
    for (int i = 0; i < 2; ++i)
        s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[i], s2[i + 2], 0x44),
                              _mm512_shuffle_ps(s2[i], s2[i + 2], 0xEE));
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88),
                                    _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
    const __m512i f = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(f, s4);
}

/* Scores of the query heads of kv heads kh0..kh1 against 16 slots at a time (head dims a
   multiple of 16): 16 independent dot products per query head, one tree for their sums. */
static inline __attribute__((always_inline)) void scores16(
    const float* q, int64_t q_h, const void* k_pool, int64_t slot_stride, const int32_t* slots,
    int L, int kh0, int kh1, int G, int D, float scale, float* buf, const int dt) {
    const int DV = D / 16, esz = dt == DT_F32 ? 4 : 2;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < L; j0 += 16) {
        const int n = L - j0 < 16 ? L - j0 : 16;
        const void* rows[16];
        for (int j = 0; j < 16; ++j)  /* a short tail repeats its last row (never stored) */
            rows[j] = at(k_pool, (int64_t)slots[j0 + (j < n ? j : n - 1)] * slot_stride, dt);
        for (int j = j0 + 16; j < j0 + 32 && j < L; ++j) {
            const char* nxt = (const char*)at(k_pool, (int64_t)slots[j] * slot_stride, dt);
            for (int c = kh0 * D * esz; c < kh1 * D * esz; c += 64) __builtin_prefetch(nxt + c);
        }
        const __mmask16 keep = (__mmask16)((1u << n) - 1u);
        for (int kh = kh0; kh < kh1; ++kh)
            for (int g = 0; g < G; ++g) {
                const int h = (kh - kh0) * G + g;
                const float* qh = q + h * q_h;
                __m512 acc[16];
                for (int j = 0; j < 16; ++j) {
                    const void* kr = at(rows[j], (int64_t)kh * D, dt);
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), ld16(kr, 0, dt));
                    for (int c = 1; c < DV; ++c)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), ld16(kr, 16 * c, dt), a);
                    acc[j] = a;
                }
                _mm512_mask_storeu_ps(buf + h * L + j0, keep, _mm512_mul_ps(hsum16(acc), sc));
            }
    }
}

/* out[g] = sum_j p[g, j] v_j for HC query heads of one kv head, head dim 16 * DV, the HC x DV
   accumulators in registers across all L slots (each V row loaded once for the HC heads);
   one function per (HC, DV, pool dtype). */
#define DEFINE_PV(HC, DV, DT, SUF)                                                            \
static void pv_##HC##_##DV##SUF(const void* v_pool, int64_t slot_stride, const int32_t* slots, \
                                int L, int off, const float* p, float* o) {                   \
    const int esz = (DT) == DT_F32 ? 4 : 2;                                                   \
    __m512 acc[HC][DV];                                                                       \
    for (int g = 0; g < HC; ++g)                                                              \
        for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();                          \
    for (int j = 0; j < L; ++j) {                                                             \
        if (j + 4 < L) { /* one line in four of the V row 4 slots ahead (the first at D 64) */ \
            const int64_t ahead = (int64_t)slots[j + 4] * slot_stride + off;                  \
            const char* nxt = (const char*)at(v_pool, ahead, DT);                             \
            for (int c = 0; c < DV * 16 * esz; c += 256) __builtin_prefetch(nxt + c);          \
        }                                                                                     \
        const void* vr = at(v_pool, (int64_t)slots[j] * slot_stride + off, DT);               \
        __m512 v[DV];                                                                         \
        for (int c = 0; c < DV; ++c) v[c] = ld16(vr, 16 * c, DT);                             \
        for (int g = 0; g < HC; ++g) {                                                        \
            const __m512 pg = _mm512_set1_ps(p[g * L + j]);                                   \
            for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);     \
        }                                                                                     \
    }                                                                                         \
    for (int g = 0; g < HC; ++g)                                                              \
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + g * 16 * DV + 16 * c, acc[g][c]);    \
}
#define DEFINE_PVS(DT, SUF)                                                                   \
    DEFINE_PV(1, 2, DT, SUF) DEFINE_PV(2, 2, DT, SUF) DEFINE_PV(3, 2, DT, SUF)                \
    DEFINE_PV(4, 2, DT, SUF) DEFINE_PV(5, 2, DT, SUF) DEFINE_PV(6, 2, DT, SUF)                \
    DEFINE_PV(7, 2, DT, SUF) DEFINE_PV(8, 2, DT, SUF)                                         \
    DEFINE_PV(1, 3, DT, SUF) DEFINE_PV(2, 3, DT, SUF) DEFINE_PV(3, 3, DT, SUF)                \
    DEFINE_PV(4, 3, DT, SUF) DEFINE_PV(5, 3, DT, SUF) DEFINE_PV(6, 3, DT, SUF)                \
    DEFINE_PV(7, 3, DT, SUF) DEFINE_PV(8, 3, DT, SUF)                                         \
    DEFINE_PV(1, 4, DT, SUF) DEFINE_PV(2, 4, DT, SUF) DEFINE_PV(3, 4, DT, SUF)                \
    DEFINE_PV(4, 4, DT, SUF) DEFINE_PV(5, 4, DT, SUF) DEFINE_PV(6, 4, DT, SUF)                \
    DEFINE_PV(1, 8, DT, SUF) DEFINE_PV(2, 8, DT, SUF) DEFINE_PV(3, 8, DT, SUF)
DEFINE_PVS(DT_F32, _f32)
DEFINE_PVS(DT_BF16, _bf16)

typedef void (*pv_fn)(const void*, int64_t, const int32_t*, int, int, const float*, float*);
/* PV[dtype][D / 16][heads]: up to 8 heads for D 32 and 48 (HC x DV + DV + 1 of the 32
   registers), 6 for 64, 3 for 128. */
#define PV_ROW(DV, SUF) {0, pv_1_##DV##SUF, pv_2_##DV##SUF, pv_3_##DV##SUF, pv_4_##DV##SUF,     \
                         pv_5_##DV##SUF, pv_6_##DV##SUF, pv_7_##DV##SUF, pv_8_##DV##SUF}
#define PV_DT(SUF) {{0}, {0}, PV_ROW(2, SUF), PV_ROW(3, SUF),                                  \
                    {0, pv_1_4##SUF, pv_2_4##SUF, pv_3_4##SUF, pv_4_4##SUF, pv_5_4##SUF,      \
                     pv_6_4##SUF}, {0}, {0}, {0},                                             \
                    {0, pv_1_8##SUF, pv_2_8##SUF, pv_3_8##SUF}}
static const pv_fn PV[2][9][9] = {PV_DT(_f32), PV_DT(_bf16)};
static const int PV_CAP[9] = {0, 0, 8, 8, 6, 0, 0, 0, 3};

/* Head dims 32, 48, 64 and 128: the same three passes with register tiles (scores16,
   softmax_row, the P.V accumulators); a kv head's G query heads are cut into near-equal
   chunks that fit the registers (G = 7 at D = 64: 4 + 3). vis: see heads_dt. */
static int heads16(const float* q, int64_t q_h, const void* k_pool, const void* v_pool,
                   int64_t slot_stride, const int32_t* slots, int L, int kh0, int kh1, int G,
                   int D, float scale, float* buf, float* out, const int* vis, int dt) {
    if (D != 32 && D != 48 && D != 64 && D != 128) return 0;
    const int cap = PV_CAP[D / 16], nh = (kh1 - kh0) * G, bf = dt == DT_BF16;
    /* one copy of scores16 per head dim and dtype: a constant D unrolls its inner loop
       (a variable one cost the head dim 64 path 10 %) */
#define SCORES16(DC)                                                                          \
    (bf ? scores16(q, q_h, k_pool, slot_stride, slots, L, kh0, kh1, G, DC, scale, buf, DT_BF16) \
        : scores16(q, q_h, k_pool, slot_stride, slots, L, kh0, kh1, G, DC, scale, buf, DT_F32))
    switch (D) {
        case 32: SCORES16(32); break;
        case 48: SCORES16(48); break;
        case 64: SCORES16(64); break;
        default: SCORES16(128); break;
    }
#undef SCORES16
    softmax_rows(buf, nh, L, vis);
    const int chunks = (G + cap - 1) / cap;
    for (int kh = kh0; kh < kh1; ++kh)
        for (int i = 0, g0 = 0; i < chunks; ++i) {
            const int hc = (G - g0) / (chunks - i), h0 = (kh - kh0) * G + g0;
            PV[bf][D / 16][hc](v_pool, slot_stride, slots, L, kh * D, buf + h0 * L, out + h0 * D);
            g0 += hc;
        }
    return 1;
}
#define HAVE_HEADS16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "exp8_avx2.h"
#define dot dot_c

static void softmax_row(float* s, int L) {
    const __m256 lo = _mm256_set1_ps(-87.3365478515625f);
    float m = -INFINITY, total = 0.0f;
    int j = 0;
    for (; j < L; ++j) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= L; j += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), mv);
        const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
        const __m256 e = _mm256_andnot_ps(under, exp8_core(_mm256_max_ps(x, lo)));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int l = 0; l < 8; ++l) total += lanes[l];
    for (; j < L; ++j) { s[j] = expf(s[j] - m); total += s[j]; }
    const float inv = 1.0f / total;
    for (j = 0; j < L; ++j) s[j] *= inv;
}
#else
#define dot dot_c

static void softmax_row(float* s, int L) {
    float m = -INFINITY, sum = 0.0f;
    for (int j = 0; j < L; ++j) m = s[j] > m ? s[j] : m;
    for (int j = 0; j < L; ++j) { s[j] = expf(s[j] - m); sum += s[j]; }
    const float inv = 1.0f / sum;
    for (int j = 0; j < L; ++j) s[j] *= inv;
}
#endif

/* Each of n score rows of L: softmax over its first vis[h] keys (all L without vis), the
   rest 0 (a query row of a several-row request sees keys up to its own position only). */
static inline void softmax_rows(float* buf, int n, int L, const int* vis) {
    if (vis == NULL) {
        for (int h = 0; h < n; ++h) softmax_row(buf + (int64_t)h * L, L);
        return;
    }
    for (int h = 0; h < n; ++h) {
        const int seen = vis ? vis[h] : L;
        softmax_row(buf + (int64_t)h * L, seen);
        for (int j = seen; j < L; ++j) buf[(int64_t)h * L + j] = 0.0f;
    }
}

/* dot over a K row of dtype dt (q float): float32 rows take this build's dot, 16-bit ones
   dot_c's eight partial sums, widened by AVX2 vectors where the build has them. */
static inline __attribute__((always_inline)) float dot_dt(const float* a, const void* b, int d,
                                                          const int dt) {
    if (dt == DT_F32) return dot(a, (const float*)b, d);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), ld8(b, i, dt), v);
    _mm256_storeu_ps(acc, v);
#endif
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * ld_f(b, i + l, dt);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; ++i) s += a[i] * ld_f(b, i, dt);
    return s;
}

/* o[0..d) += p * v[0..d), v of dtype dt. */
static inline __attribute__((always_inline)) void axpy_dt(float* o, float p, const void* v, int d,
                                                          const int dt) {
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (dt != DT_F32) {
        const __m256 pv = _mm256_set1_ps(p);
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, ld8(v, i, dt), _mm256_loadu_ps(o + i)));
    }
#endif
    for (; i < d; ++i) o[i] += p * ld_f(v, i, dt);
}

/* Kv heads kh0..kh1 of one request: scores [nh, L] in buf (nh = query heads in the range),
   softmax (head h over its first vis[h] keys where vis is given), then out[h] = sum_j
   p[h, j] v_j. Each slot's K (V) row is read once, whole and
   in order, with the rows a few slots ahead prefetched: the slots are scattered over the
   pool and the VM's memory latency, not arithmetic, bounds this loop. */
static inline __attribute__((always_inline)) void heads_dt(
    const float* q, int64_t q_h, const void* k_pool, const void* v_pool, int64_t slot_stride,
    const int32_t* slots, int L, int kh0, int kh1, int G, int D, float scale, float* buf,
    float* out, const int* vis, const int dt) {
    const int nh = (kh1 - kh0) * G, ahead = 4, esz = dt == DT_F32 ? 4 : 2;
    for (int j = 0; j < L; ++j) {
        if (j + ahead < L) {
            const char* nxt = (const char*)at(k_pool, (int64_t)slots[j + ahead] * slot_stride, dt);
            for (int c = kh0 * D * esz; c < kh1 * D * esz; c += 64) __builtin_prefetch(nxt + c);
        }
        const void* kr = at(k_pool, (int64_t)slots[j] * slot_stride, dt);
        for (int h = 0; h < nh; ++h) {
            const void* k = at(kr, (int64_t)(kh0 + h / G) * D, dt);
            buf[h * L + j] = dot_dt(q + h * q_h, k, D, dt) * scale;
        }
    }
    softmax_rows(buf, nh, L, vis);
    for (int64_t i = 0; i < (int64_t)nh * D; ++i) out[i] = 0.0f;
    for (int j = 0; j < L; ++j) {
        if (j + ahead < L) {
            const char* nxt = (const char*)at(v_pool, (int64_t)slots[j + ahead] * slot_stride, dt);
            for (int c = kh0 * D * esz; c < kh1 * D * esz; c += 64) __builtin_prefetch(nxt + c);
        }
        const void* vr = at(v_pool, (int64_t)slots[j] * slot_stride, dt);
        for (int h = 0; h < nh; ++h)
            axpy_dt(out + h * D, buf[h * L + j], at(vr, (int64_t)(kh0 + h / G) * D, dt), D, dt);
    }
}

static void heads(const float* q, int64_t q_h, const void* k_pool, const void* v_pool,
                  int64_t slot_stride, const int32_t* slots, int L, int kh0, int kh1, int G,
                  int D, float scale, float* buf, float* out, const int* vis, int dt) {
#ifdef HAVE_HEADS16
    if (heads16(q, q_h, k_pool, v_pool, slot_stride, slots, L, kh0, kh1, G, D, scale, buf, out,
                vis, dt))
        return;
#endif
    if (dt == DT_BF16)
        heads_dt(q, q_h, k_pool, v_pool, slot_stride, slots, L, kh0, kh1, G, D, scale, buf, out,
                 vis, DT_BF16);
    else
        heads_dt(q, q_h, k_pool, v_pool, slot_stride, slots, L, kh0, kh1, G, D, scale, buf, out,
                 vis, DT_F32);
}

/* q [B, H, D] (strides q_b, q_h; D contiguous); pools [S, KVH, D] rows of slot_stride;
   req_to_token [R, table_stride] int32; out [B, H, D] contiguous; q, the pools and out of
   dtype dt (float32 or bfloat16). Work items: whole requests when there are enough of them
   for the threads, else (request, kv head). Returns nonzero when out of memory. */
int rs_decode_attention(int dt, const void* q, int64_t q_b, int64_t q_h, const void* k_pool,
                        const void* v_pool, int64_t slot_stride, const int32_t* req_to_token,
                        int64_t table_stride, const int32_t* req_slots, const int32_t* seq_lens,
                        void* out, int B, int H, int KVH, int D, float scale, int nthreads) {
    const int G = H / KVH;
    const int split = B < 2 * nthreads ? KVH : 1; /* items per request */
    const int per = KVH / split;                  /* kv heads per item */
    const int wide = dt != DT_F32;                /* query and output through float buffers */
    if (dt != DT_F32 && dt != DT_BF16) return 2;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float* buf = NULL;
        int64_t cap = 0;
        float* qo = wide ? (float*)malloc(sizeof(float) * 2 * (size_t)per * G * D) : NULL;
        if (wide && qo == NULL) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)B * split; ++w) {
            const int b = (int)(w / split), kh0 = (int)(w % split) * per, L = seq_lens[b];
            if ((int64_t)per * G * L > cap) {
                free(buf);
                cap = (int64_t)per * G * L;
                buf = (float*)malloc(sizeof(float) * cap);
            }
            if (buf == NULL || (wide && qo == NULL)) { cap = 0; failed = 1; continue; }
            const int nh = per * G;
            const int64_t q0 = b * q_b + (int64_t)kh0 * G * q_h;
            const int64_t o0 = ((int64_t)b * H + (int64_t)kh0 * G) * D;
            const float* qi = wide ? qo : (const float*)q + q0;
            float* oi = wide ? qo + (size_t)nh * D : (float*)out + o0;
            const int64_t qh = wide ? D : q_h;
            if (wide) { /* the item's query rows widened, its output summed in float32 */
                for (int h = 0; h < nh; ++h)
                    for (int d = 0; d < D; ++d) qo[h * D + d] = ld_f(q, q0 + h * q_h + d, DT_BF16);
            }
            const int32_t* slots = req_to_token + (int64_t)req_slots[b] * table_stride;
            heads(qi, qh, k_pool, v_pool, slot_stride, slots, L, kh0, kh0 + per, G, D, scale,
                  buf, oi, NULL, dt);
            if (wide)
                for (int64_t i = 0; i < (int64_t)nh * D; ++i) st_f(out, o0 + i, oi[i], DT_BF16);
        }
        free(buf);
        free(qo);
    }
    return failed;
}

/* A few query rows per request (a verify step's 1 + k, a short extend): each request's
   rows of one kv head are lanes of one item, as the query heads of a group are in decode,
   so its context's K/V rows are read once for all its rows. q [T, H, D] (strides q_t, q_h;
   D contiguous), request b's rows qo_indptr[b] .. qo_indptr[b + 1] (their K/V already in
   the pool), row r seeing keys 0 .. prefix_lens[b] + r; out [T, H, D] contiguous, only the
   requests' rows written. Returns nonzero when out of memory. */
int rs_rows_attention(int dt, const void* q, int64_t q_t, int64_t q_h, const void* k_pool,
                      const void* v_pool, int64_t slot_stride, const int32_t* req_to_token,
                      int64_t table_stride, const int32_t* req_slots, const int32_t* qo_indptr,
                      const int32_t* prefix_lens, void* out, int B, int H, int KVH, int D,
                      float scale, int nthreads) {
    const int G = H / KVH;
    if (dt != DT_F32 && dt != DT_BF16) return 2;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float *buf = NULL, *qo = NULL;
        int* vis = NULL;
        int64_t cap = 0, lanes_cap = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)B * KVH; ++w) {
            const int b = (int)(w / KVH), kh = (int)(w % KVH);
            const int t0 = qo_indptr[b], n = qo_indptr[b + 1] - t0, P = prefix_lens[b];
            const int L = P + n, lanes = n * G;
            if (n <= 0) continue;
            if ((int64_t)lanes * L > cap) {
                free(buf);
                cap = (int64_t)lanes * L;
                buf = (float*)malloc(sizeof(float) * cap);
            }
            if (lanes > lanes_cap) {
                free(qo);
                free(vis);
                lanes_cap = lanes;
                qo = (float*)malloc(sizeof(float) * 2 * (size_t)lanes * D);
                vis = (int*)malloc(sizeof(int) * (size_t)lanes);
            }
            if (buf == NULL || qo == NULL || vis == NULL) { cap = lanes_cap = 0; failed = 1; continue; }
            /* lane r * G + g: row r's query head kh * G + g, float32 */
            for (int r = 0; r < n; ++r)
                for (int g = 0; g < G; ++g) {
                    const int64_t src = (int64_t)(t0 + r) * q_t + (int64_t)(kh * G + g) * q_h;
                    float* dst = qo + (int64_t)(r * G + g) * D;
                    for (int d = 0; d < D; ++d) dst[d] = ld_f(q, src + d, dt);
                    vis[r * G + g] = P + r + 1;
                }
            float* o = qo + (size_t)lanes * D;
            const int32_t* slots = req_to_token + (int64_t)req_slots[b] * table_stride;
            heads(qo, D, k_pool, v_pool, slot_stride, slots, L, kh, kh + 1, lanes, D, scale, buf,
                  o, vis, dt);
            for (int r = 0; r < n; ++r)
                for (int g = 0; g < G; ++g) {
                    const int64_t dst = ((int64_t)(t0 + r) * H + kh * G + g) * D;
                    const float* src = o + (int64_t)(r * G + g) * D;
                    for (int d = 0; d < D; ++d) st_f(out, dst + d, src[d], dt);
                }
        }
        free(buf);
        free(qo);
        free(vis);
    }
    return failed;
}

/* The float32 entry of before (rs_decode_attention with dt = DT_F32). */
int rs_decode_attention_f32(const float* q, int64_t q_b, int64_t q_h, const float* k_pool,
                            const float* v_pool, int64_t slot_stride,
                            const int32_t* req_to_token, int64_t table_stride,
                            const int32_t* req_slots, const int32_t* seq_lens, float* out,
                            int B, int H, int KVH, int D, float scale, int nthreads) {
    return rs_decode_attention(DT_F32, q, q_b, q_h, k_pool, v_pool, slot_stride, req_to_token,
                               table_stride, req_slots, seq_lens, out, B, H, KVH, D, scale,
                               nthreads);
}
