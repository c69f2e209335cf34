/* Built and loaded by kernels/cpu_elementwise.py (kernels/_cc.py compiles it on first use). */
#include <math.h>
#include <stdint.h>
#include "half.h"

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

/* out = round(round(silu(g)) * u) on 16-bit rows (silu_mul8's float32 silu). */
static inline __attribute__((always_inline)) void silu_mul_row16(
    const void* g, const void* u, void* o, int64_t I, const int dt) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8)
        st8(o, i, _mm256_mul_ps(rnd8(silu_mul8(ld8(g, i, dt), _mm256_set1_ps(1.0f)), dt),
                                ld8(u, i, dt)), dt);
    if (i < I) {
        const int n = (int)(I - i);
        const __m256 sg = rnd8(silu_mul8(ld8_tail(g, i, n, dt), _mm256_set1_ps(1.0f)), dt);
        st8_tail(o, i, n, _mm256_mul_ps(sg, ld8_tail(u, i, n, dt)), dt);
    }
}

static inline __attribute__((always_inline)) void silu_mul16(
    const void* gu, void* out, int64_t T, int64_t I, int nth, const int dt) {
    const uint16_t* g = (const uint16_t*)gu;
    uint16_t* o = (uint16_t*)out;
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t)
        silu_mul_row16(g + t * 2 * I, g + t * 2 * I + I, o + t * I, I, dt);
}

/* rs_silu_mul_f32 on rows of dtype dt. */
void rs_silu_mul16(int dt, const void* gu, void* out, int64_t T, int64_t I, int nth) {
    if (dt == DT_F16) silu_mul16(gu, out, T, I, nth, DT_F16);
    else silu_mul16(gu, out, T, I, nth, DT_BF16);
}
#endif /* without AVX2/FMA no rs_silu_mul_f32: libm's scalar expf made it 2-3x slower than
          torch's vectorized silu + mul; the caller keeps those */


/* ---- 16-bit tensors (dt: DT_BF16 or DT_F16) ---------------------------------------------
   The same passes over bfloat16 / float16 rows, rounding where torch's expressions in that
   dtype round (each op computes in float32 and rounds its result), so the outputs are
   torch's bits: the rotary's four products and two sums, RMSNorm's residual sum, the
   normalised row and its product with the weight, silu's output and its product with up. */

static inline __attribute__((always_inline)) void rotary_row16(
    const void* x1, const void* x2, const void* c, const void* s, void* o1, void* o2,
    int64_t half, const int dt) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= half; i += 8) {
        const __m256 a = ld8(x1, i, dt), b = ld8(x2, i, dt);
        const __m256 cv = ld8(c, i, dt), sv = ld8(s, i, dt);
        const __m256 ac = rnd8(_mm256_mul_ps(a, cv), dt), bs = rnd8(_mm256_mul_ps(b, sv), dt);
        const __m256 bc = rnd8(_mm256_mul_ps(b, cv), dt), as = rnd8(_mm256_mul_ps(a, sv), dt);
        st8(o1, i, _mm256_sub_ps(ac, bs), dt);
        st8(o2, i, _mm256_add_ps(bc, as), dt);
    }
#endif
    for (; i < half; ++i) {
        const float a = ld_f(x1, i, dt), b = ld_f(x2, i, dt);
        const float cv = ld_f(c, i, dt), sv = ld_f(s, i, dt);
        st_f(o1, i, round_to(a * cv, dt) - round_to(b * sv, dt), dt);
        st_f(o2, i, round_to(b * cv, dt) + round_to(a * sv, dt), dt);
    }
}

static inline __attribute__((always_inline)) void rotary16(
    const void* x, int64_t sx_t, int64_t sx_h, const void* cs, const void* sn, void* out,
    int64_t T, int64_t H, int64_t D, int nth, const int dt) {
    const int64_t half = D / 2;
    const uint16_t *xb = (const uint16_t*)x, *cb = (const uint16_t*)cs, *sb = (const uint16_t*)sn;
    uint16_t* ob = (uint16_t*)out;
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * H * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            const uint16_t* x1 = xb + t * sx_t + h * sx_h;
            uint16_t* o1 = ob + (t * H + h) * D;
            rotary_row16(x1, x1 + half, cb + t * half, sb + t * half, o1, o1 + half, half, dt);
        }
}

/* x [T, H, D] (strides in elements, D contiguous), cos / sin [T, D/2], out [T, H, D]
   contiguous, all of dtype dt. */
void rs_rotary16(int dt, const void* x, int64_t sx_t, int64_t sx_h, const void* cs,
                 const void* sn, void* out, int64_t T, int64_t H, int64_t D, int nth) {
    if (dt == DT_F16) rotary16(x, sx_t, sx_h, cs, sn, out, T, H, D, nth, DT_F16);
    else rotary16(x, sx_t, sx_h, cs, sn, out, T, H, D, nth, DT_BF16);
}

/* One row: s = x (+ res, rounded: torch's add), sum of squares in rs_rms_norm_f32's 16
   partial sums and tree, out = round(round(s * inv) * w). */
static inline __attribute__((always_inline)) void rms_row16(
    const void* xr, const void* rr, const void* w, float eps, void* sr, void* o, int64_t N,
    const int dt) {
    float acc[16] = {0};
    int64_t i = 0;
    const void* s = rr != 0 ? sr : xr;
#if defined(__AVX2__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + 16 <= N; i += 16) {
        __m256 a = ld8(xr, i, dt), b = ld8(xr, i + 8, dt);
        if (rr != 0) {
            a = rnd8(_mm256_add_ps(a, ld8(rr, i, dt)), dt);
            b = rnd8(_mm256_add_ps(b, ld8(rr, i + 8, dt)), dt);
            st8(sr, i, a, dt);
            st8(sr, i + 8, b, dt);
        }
        lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
    }
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
#endif
    for (int l = 0; i < N; ++i, l = (l + 1) & 15) {
        float v = ld_f(xr, i, dt);
        if (rr != 0) {
            v = round_to(v + ld_f(rr, i, dt), dt);
            st_f(sr, i, v, dt);
        }
        acc[l] += v * v;
    }
    for (int h = 8; h > 0; h /= 2)
        for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
    const float inv = 1.0f / sqrtf(acc[0] / (float)N + eps);
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 iv = _mm256_set1_ps(inv);
    for (; j + 8 <= N; j += 8)
        st8(o, j, _mm256_mul_ps(rnd8(_mm256_mul_ps(ld8(s, j, dt), iv), dt), ld8(w, j, dt)), dt);
#endif
    for (; j < N; ++j) st_f(o, j, round_to(ld_f(s, j, dt) * inv, dt) * ld_f(w, j, dt), dt);
}

static inline __attribute__((always_inline)) void rms_norm16(
    const void* x, const void* res, const void* w, float eps, void* sum, void* out, int64_t T,
    int64_t N, int nth, const int dt) {
    const uint16_t *xb = (const uint16_t*)x, *rb = (const uint16_t*)res;
    uint16_t *sb = (uint16_t*)sum, *ob = (uint16_t*)out;
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * N >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t)
        rms_row16(xb + t * N, rb ? rb + t * N : 0, w, eps, sb ? sb + t * N : 0, ob + t * N, N,
                  dt);
}

/* rs_rms_norm_f32 on rows of dtype dt (the weight too). */
void rs_rms_norm16(int dt, const void* x, const void* res, const void* w, float eps, void* sum,
                   void* out, int64_t T, int64_t N, int nth) {
    if (dt == DT_F16) rms_norm16(x, res, w, eps, sum, out, T, N, nth, DT_F16);
    else rms_norm16(x, res, w, eps, sum, out, T, N, nth, DT_BF16);
}
