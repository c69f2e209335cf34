/* 16-bit floats (bfloat16, float16) <-> float32, scalar and vector, for the kernels that
   read and write them. kernels/_cc.read_source pastes it where a kernel includes it.

   Rounding is torch's: float32 -> bfloat16 to nearest even on the bits (a NaN becomes the
   quiet NaN 0x7FC0), float32 -> float16 by the IEEE conversion (F16C's vcvtps2ph, or
   _Float16 casts without it). So a kernel that rounds where a torch expression rounds
   gives torch's bits. bfloat16 -> float32 is exact: the 16 bits shifted up. */
#include <stdint.h>
#include <string.h>

/* The dtype codes the Python wrappers pass (kernels/_cc.py DTYPE_CODES). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t f32_to_f16(float f) {
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

/* Element i of a float32 / bfloat16 / float16 array as float32, and back. `dt` is a
   constant where these are inlined, so each use compiles to one conversion. */
static inline __attribute__((always_inline)) float ld_f(const void* p, int64_t i, const int dt) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t*)p)[i]);
    if (dt == DT_F16) return f16_to_f32(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}

static inline __attribute__((always_inline)) void st_f(void* p, int64_t i, float v, const int dt) {
    if (dt == DT_BF16) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else if (dt == DT_F16) ((uint16_t*)p)[i] = f32_to_f16(v);
    else ((float*)p)[i] = v;
}

/* v rounded to dt and back (the value a torch op of that dtype would hold). */
static inline __attribute__((always_inline)) float round_to(float v, const int dt) {
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dt == DT_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

static inline int dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 lanes. */
static inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
    r = _mm256_srli_epi32(r, 16); /* each lane <= 0xFFFF: the unsigned pack keeps it */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

/* float16 without F16C (no AVX2 CPU lacks it) goes element by element. */
static inline __attribute__((always_inline)) __m256 ld8(const void* p, int64_t i, const int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float*)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    if (dt == DT_BF16) return bf16x8_to_f32(h);
#if defined(__F16C__)
    return _mm256_cvtph_ps(h);
#else
    float b[8];
    for (int l = 0; l < 8; ++l) b[l] = f16_to_f32(((const uint16_t*)p)[i + l]);
    return _mm256_loadu_ps(b);
#endif
}

static inline __attribute__((always_inline)) void st8(void* p, int64_t i, __m256 v, const int dt) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float*)p + i, v);
        return;
    }
    uint16_t* q = (uint16_t*)p + i;
    if (dt == DT_BF16) {
        _mm_storeu_si128((__m128i*)q, f32x8_to_bf16(v));
        return;
    }
#if defined(__F16C__)
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)q, h);
#else
    float b[8];
    _mm256_storeu_ps(b, v);
    for (int l = 0; l < 8; ++l) q[l] = f32_to_f16(b[l]);
#endif
}
#endif

#if defined(__AVX512F__)
/* 16 lanes. */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m512 ld16(const void* p, int64_t i, const int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float*)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    if (dt == DT_F16) return _mm512_cvtph_ps(h);
    return bf16x16_to_f32(h);
}
#endif

#if defined(__AVX2__)
/* v rounded to dt and back, 8 lanes: round_to's bits. */
static inline __attribute__((always_inline)) __m256 rnd8(__m256 v, const int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) return bf16x8_to_f32(f32x8_to_bf16(v));
    uint16_t h[8];
    st8(h, 0, v, DT_F16);
    return ld8(h, 0, DT_F16);
}

/* The first n < 8 elements of p (the rest zero) and the way back: tails that round exactly
   as the vector body does. */
static inline __attribute__((always_inline)) __m256 ld8_tail(const void* p, int64_t i, int n,
                                                             const int dt) {
    float b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int l = 0; l < n; ++l) b[l] = ld_f(p, i + l, dt);
    return _mm256_loadu_ps(b);
}

static inline __attribute__((always_inline)) void st8_tail(void* p, int64_t i, int n, __m256 v,
                                                          const int dt) {
    float b[8];
    _mm256_storeu_ps(b, v);
    for (int l = 0; l < n; ++l) st_f(p, i + l, b[l], dt);
}
#endif
