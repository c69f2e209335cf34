/* Built and loaded by kernels/cpu_elementwise.py (kernels/_cc.py compiles it on first use). */
#include <math.h>
#include <stdint.h>

#ifndef PARALLEL_MIN  /* the Python module's PARALLEL_MIN, defined by kernels/_cc.read_source */
#error "build through kernels/cpu_elementwise.py, or with -DPARALLEL_MIN=..."
#endif

/* out[t, h, :] = cat(x1*c - x2*s, x2*c + x1*s) with x1/x2 the halves of x[t, h, :] and
   c/s = cos[t, :], sin[t, :]. x rows and heads strided (a view of the fused qkv output),
   the head dim contiguous; out, cos, sin contiguous. Built with -ffp-contract=off: every
   product and sum rounds on its own, as in torch. */
void rs_rotary_f32(const float* x, int64_t sx_t, int64_t sx_h, const float* cs,
                   const float* sn, float* out, int64_t T, int64_t H, int64_t D, int nth) {
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * H * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const float* restrict c = cs + t * half;
        const float* restrict s = sn + t * half;
        for (int64_t h = 0; h < H; ++h) {
            const float* restrict x1 = x + t * sx_t + h * sx_h;
            const float* restrict x2 = x1 + half;
            float* restrict o1 = out + (t * H + h) * D;
            float* restrict o2 = o1 + half;
            for (int64_t i = 0; i < half; ++i) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}

/* RMSNorm of rows of N floats, optionally after the residual add: s = x (+ res), written
   to sum when res is given; out = s * (1 / sqrt(mean(s^2) + eps)) * w. The sum of squares
   in 16 partial sums (vectorizes without reassociating: a fixed order), then a fixed tree.
   x, res, sum, out contiguous [T, N]. */
void rs_rms_norm_f32(const float* x, const float* res, const float* w, float eps, float* sum,
                     float* out, int64_t T, int64_t N, int nth) {
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * N >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const float* restrict xr = x + t * N;
        const float* s = xr;
        if (res != 0) {
            const float* restrict rr = res + t * N;
            float* restrict sr = sum + t * N;
            for (int64_t i = 0; i < N; ++i) sr[i] = xr[i] + rr[i];
            s = sr;
        }
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= N; i += 16)
            for (int l = 0; l < 16; ++l) acc[l] += s[i + l] * s[i + l];
        for (int l = 0; i < N; ++i, ++l) acc[l] += s[i] * s[i];
        for (int h = 8; h > 0; h /= 2)
            for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
        const float inv = 1.0f / sqrtf(acc[0] / (float)N + eps);
        float* restrict o = out + t * N;
        for (int64_t j = 0; j < N; ++j) o[j] = s[j] * inv * w[j];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static const int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* exp of 8 lanes: n = round(x log2 e), r = x - n ln2 (ln2 in two parts), Cephes' expf
   polynomial, times 2^n built in the exponent bits. ~1 ulp. Inf from ~88.03 (expf: from
   88.72; in silu, g / (1 + e) is then -0 instead of ~-1e-37); below -87.34 it stays at
   2^-126 (1 + that is 1: silu needs no more). A NaN lane gives a finite value, but silu's
   g / (1 + e) is NaN then anyway. */
#include "exp8_avx2.h"
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    const __m256 y = exp8_core(_mm256_max_ps(_mm256_min_ps(x, hi), lo));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static inline void silu_mul_row(const float* g, const float* u, float* o, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) { /* the same lanes, masked: the tail rounds exactly as the body */
        const __m256i m = _mm256_loadu_si256((const __m256i*)(tail_mask + 8 - (I - i)));
        _mm256_maskstore_ps(
            o + i, m, silu_mul8(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
    }
}

/* out[t, :] = silu(gu[t, :I]) * gu[t, I:2I]; gu and out contiguous. */
void rs_silu_mul_f32(const float* gu, float* out, int64_t T, int64_t I, int nth) {
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t)
        silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
}
#endif /* without AVX2/FMA no rs_silu_mul_f32: libm's scalar expf made it 2-3x slower than
          torch's vectorized silu + mul; the caller keeps those */
