/* Built and loaded by kernels/cpu_decode_attention.py (kernels/_cc.py compiles it on first use). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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
static void scores16(const float* q, int64_t q_h, const float* k_pool, int64_t slot_stride,
                     const int32_t* slots, int L, int kh0, int kh1, int G, int D, float scale,
                     float* buf) {
    const int DV = D / 16;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < L; j0 += 16) {
        const int n = L - j0 < 16 ? L - j0 : 16;
        const float* rows[16];
        for (int j = 0; j < 16; ++j)  /* a short tail repeats its last row (never stored) */
            rows[j] = k_pool + (int64_t)slots[j0 + (j < n ? j : n - 1)] * slot_stride;
        for (int j = j0 + 16; j < j0 + 32 && j < L; ++j) {
            const char* nxt = (const char*)(k_pool + (int64_t)slots[j] * slot_stride);
            for (int c = kh0 * D * 4; c < kh1 * D * 4; c += 64) __builtin_prefetch(nxt + c);
        }
        const __mmask16 keep = (__mmask16)((1u << n) - 1u);
        for (int kh = kh0; kh < kh1; ++kh)
            for (int g = 0; g < G; ++g) {
                const int h = (kh - kh0) * G + g;
                const float* qh = q + h * q_h;
                __m512 acc[16];
                for (int j = 0; j < 16; ++j) {
                    const float* kr = rows[j] + kh * D;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
                    for (int c = 1; c < DV; ++c)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c),
                                            _mm512_loadu_ps(kr + 16 * c), a);
                    acc[j] = a;
                }
                _mm512_mask_storeu_ps(buf + h * L + j0, keep, _mm512_mul_ps(hsum16(acc), sc));
            }
    }
}

/* out[g] = sum_j p[g, j] v_j for HC query heads of one kv head, head dim 16 * DV, the HC x DV
   accumulators in registers across all L slots (each V row loaded once for the HC heads). */
#define DEFINE_PV(HC, DV)                                                                     \
static void pv_##HC##_##DV(const float* v_pool, int64_t slot_stride, const int32_t* slots,    \
                           int L, int off, const float* p, float* o) {                         \
    __m512 acc[HC][DV];                                                                       \
    for (int g = 0; g < HC; ++g)                                                              \
        for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();                          \
    for (int j = 0; j < L; ++j) {                                                             \
        if (j + 4 < L) { /* one line in four of the V row 4 slots ahead (the first at D 64) */ \
            const char* nxt = (const char*)(v_pool + (int64_t)slots[j + 4] * slot_stride + off); \
            for (int c = 0; c < DV; c += 4) __builtin_prefetch(nxt + 64 * c);                 \
        }                                                                                     \
        const float* vr = v_pool + (int64_t)slots[j] * slot_stride + off;                     \
        __m512 v[DV];                                                                         \
        for (int c = 0; c < DV; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);                     \
        for (int g = 0; g < HC; ++g) {                                                        \
            const __m512 pg = _mm512_set1_ps(p[g * L + j]);                                   \
            for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);     \
        }                                                                                     \
    }                                                                                         \
    for (int g = 0; g < HC; ++g)                                                              \
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + g * 16 * DV + 16 * c, acc[g][c]);    \
}
DEFINE_PV(1, 4) DEFINE_PV(2, 4) DEFINE_PV(3, 4) DEFINE_PV(4, 4) DEFINE_PV(5, 4) DEFINE_PV(6, 4)
DEFINE_PV(1, 8) DEFINE_PV(2, 8) DEFINE_PV(3, 8)

typedef void (*pv_fn)(const float*, int64_t, const int32_t*, int, int, const float*, float*);
static const pv_fn PV4[7] = {0, pv_1_4, pv_2_4, pv_3_4, pv_4_4, pv_5_4, pv_6_4};
static const pv_fn PV8[4] = {0, pv_1_8, pv_2_8, pv_3_8};

/* Head dims 64 and 128: the same three passes with register tiles (scores16, softmax_row,
   the P.V accumulators); a kv head's G query heads are cut into near-equal chunks that fit
   the registers (G = 7 at D = 64: 4 + 3). */
static int heads16(const float* q, int64_t q_h, const float* k_pool, const float* v_pool,
                   int64_t slot_stride, const int32_t* slots, int L, int kh0, int kh1, int G,
                   int D, float scale, float* buf, float* out) {
    if (D != 64 && D != 128) return 0;
    const int cap = D == 64 ? 6 : 3, nh = (kh1 - kh0) * G;
    scores16(q, q_h, k_pool, slot_stride, slots, L, kh0, kh1, G, D, scale, buf);
    for (int h = 0; h < nh; ++h) softmax_row(buf + h * L, L);
    const int chunks = (G + cap - 1) / cap;
    for (int kh = kh0; kh < kh1; ++kh)
        for (int i = 0, g0 = 0; i < chunks; ++i) {
            const int hc = (G - g0) / (chunks - i), h0 = (kh - kh0) * G + g0;
            (D == 64 ? PV4 : PV8)[hc](v_pool, slot_stride, slots, L, kh * D, buf + h0 * L,
                                      out + h0 * D);
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

/* Kv heads kh0..kh1 of one request: scores [nh, L] in buf (nh = query heads in the range),
   softmax, then out[h] = sum_j p[h, j] v_j. Each slot's K (V) row is read once, whole and
   in order, with the rows a few slots ahead prefetched: the slots are scattered over the
   pool and the VM's memory latency, not arithmetic, bounds this loop. */
static void heads(const float* q, int64_t q_h, const float* k_pool, const float* v_pool,
                  int64_t slot_stride, const int32_t* slots, int L, int kh0, int kh1, int G,
                  int D, float scale, float* buf, float* out) {
    const int nh = (kh1 - kh0) * G, ahead = 4;
    for (int j = 0; j < L; ++j) {
        if (j + ahead < L) {
            const char* nxt = (const char*)(k_pool + (int64_t)slots[j + ahead] * slot_stride);
            for (int c = kh0 * D * 4; c < kh1 * D * 4; c += 64) __builtin_prefetch(nxt + c);
        }
        const float* kr = k_pool + (int64_t)slots[j] * slot_stride;
        for (int h = 0; h < nh; ++h)
            buf[h * L + j] = dot(q + h * q_h, kr + (kh0 + h / G) * D, D) * scale;
    }
    for (int h = 0; h < nh; ++h) {
        softmax_row(buf + h * L, L);
        float* o = out + h * D;
        for (int d = 0; d < D; ++d) o[d] = 0.0f;
    }
    for (int j = 0; j < L; ++j) {
        if (j + ahead < L) {
            const char* nxt = (const char*)(v_pool + (int64_t)slots[j + ahead] * slot_stride);
            for (int c = kh0 * D * 4; c < kh1 * D * 4; c += 64) __builtin_prefetch(nxt + c);
        }
        const float* vr = v_pool + (int64_t)slots[j] * slot_stride;
        for (int h = 0; h < nh; ++h) {
            const float p = buf[h * L + j], *v = vr + (kh0 + h / G) * D;
            float* o = out + h * D;
            for (int d = 0; d < D; ++d) o[d] += p * v[d];
        }
    }
}

/* q [B, H, D] (strides q_b, q_h; D contiguous); pools [S, KVH, D] rows of slot_stride;
   req_to_token [R, table_stride] int32; out [B, H, D] contiguous. Work items: whole
   requests when there are enough of them for the threads, else (request, kv head). */
int rs_decode_attention_f32(const float* q, int64_t q_b, int64_t q_h, const float* k_pool,
                            const float* v_pool, int64_t slot_stride,
                            const int32_t* req_to_token, int64_t table_stride,
                            const int32_t* req_slots, const int32_t* seq_lens, float* out,
                            int B, int H, int KVH, int D, float scale, int nthreads) {
    const int G = H / KVH;
    const int split = B < 2 * nthreads ? KVH : 1; /* items per request */
    const int per = KVH / split;                  /* kv heads per item */
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float* buf = NULL;
        int64_t cap = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)B * split; ++w) {
            const int b = (int)(w / split), kh0 = (int)(w % split) * per, L = seq_lens[b];
            if ((int64_t)per * G * L > cap) {
                free(buf);
                cap = (int64_t)per * G * L;
                buf = (float*)malloc(sizeof(float) * cap);
            }
            if (buf == NULL) { cap = 0; failed = 1; continue; }
            const float* qi = q + b * q_b + (int64_t)kh0 * G * q_h;
            const int32_t* slots = req_to_token + (int64_t)req_slots[b] * table_stride;
            float* oi = out + ((int64_t)b * H + (int64_t)kh0 * G) * D;
#ifdef HAVE_HEADS16
            if (heads16(qi, q_h, k_pool, v_pool, slot_stride, slots, L, kh0, kh0 + per, G, D,
                        scale, buf, oi))
                continue;
#endif
            heads(qi, q_h, k_pool, v_pool, slot_stride, slots, L, kh0, kh0 + per, G, D, scale,
                  buf, oi);
        }
        free(buf);
    }
    return failed;
}
