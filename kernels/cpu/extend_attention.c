/* Built and loaded by kernels/cpu_extend_attention.py (kernels/_cc.py compiles it on first use). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "half.h"

#define BK 36   /* keys per block: a multiple of the 6- and 12-key tiles; with its K and V rows (18
                 KiB), a query tile, its scores and output stay in the 32 KiB L1 */
#define VT 16   /* query lanes per tile (two AVX2 vectors, one AVX-512 vector) */
#ifndef PARALLEL_MIN  /* the Python module's PARALLEL_MIN, defined by kernels/_cc.read_source */
#error "build through kernels/cpu_extend_attention.py, or with -DPARALLEL_MIN=..."
#endif


/* exp of 8 lanes, x <= 0 (a score minus its running max): Cephes' expf polynomial after a
   two-constant ln 2 reduction, times 2^n built in the exponent bits; 0 below -87.3 (a
   masked -inf score gives exactly 0, which the softmax needs). */
#if defined(__AVX512F__)
/* AVX-512: a tile's 16 query lanes are one zmm vector, so a Q.K tile takes 12 keys and a
   P.V tile 16 head-dim rows (12 / 16 accumulators of the 32 registers); the softmax, the
   layout and the work items are the AVX2 code's. */
#define KT 12 /* keys per Q.K tile */

#include "exp16_avx512.h"
static inline __m512 exp16(__m512 x) { /* x <= 0; 0 below -87.3, as exp8 */
    const __m512 lo = _mm512_set1_ps(-87.3365478515625f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, exp16_core(_mm512_max_ps(x, lo)));
}

/* s[n][0..16) = sum_d k[n][d] qt[d][0..16) for 12 keys, the block's rows ld floats apart
   from kb; qt is the tile's [D][16] queries. One variant per common row stride, so that
   the 12 broadcasts are constant offsets from one pointer: with 12 row pointers gcc ran
   out of registers and moved them in and out of vector registers on the FMA ports. */
#define QK_TILE(NAME, LD)                                                                   \
static void NAME(const float* kb, int64_t ld_any, const float* qt, int D, float* s) {     \
    const int64_t ld = (LD) ? (LD) : ld_any;                                               \
    __m512 a[KT];                                                                           \
    for (int i = 0; i < KT; ++i) a[i] = _mm512_setzero_ps();                                \
    for (int d = 0; d < D; ++d) {                                                           \
        const __m512 q = _mm512_load_ps(qt + d * VT);                                       \
        const float* kd = kb + d;                                                           \
        for (int i = 0; i < KT; ++i)                                                        \
            a[i] = _mm512_fmadd_ps(_mm512_set1_ps(kd[i * ld]), q, a[i]);                    \
    }                                                                                       \
    for (int i = 0; i < KT; ++i) _mm512_store_ps(s + i * VT, a[i]);                         \
}
QK_TILE(qk_tile64, 64) QK_TILE(qk_tile128, 128) QK_TILE(qk_tile_ld, 0)

static void qk_block(const float* kb, const float* const* kp, int n_use, const float* qt,
                     int D, float* s) {
    (void)kp;
    for (int n0 = 0; n0 < n_use; n0 += KT) {
        const float* k0 = kb + (int64_t)n0 * D;
        if (D == 64) qk_tile64(k0, D, qt, D, s + n0 * VT);
        else if (D == 128) qk_tile128(k0, D, qt, D, s + n0 * VT);
        else qk_tile_ld(k0, D, qt, D, s + n0 * VT);
    }
}

/* ot[d0 + i][0..16) = al * ot[..] + sum_{n < nk} v[n][d0 + i] p[n][0..16), i < R, the V rows
   D floats apart from vb: one function per R (16, and 1-15 for the last head-dim tile) so
   the accumulators stay in registers, and one running row pointer (constant offsets). */
#define PV_TILE(R)                                                                          \
static void pv_tile##R(const float* vb, int D, int d0, const float* p, int nk, float* ot,  \
                       __m512 al) {                                                        \
    __m512 a[R];                                                                            \
    for (int i = 0; i < R; ++i) a[i] = _mm512_mul_ps(al, _mm512_load_ps(ot + (d0 + i) * VT)); \
    const float* vr = vb + d0;                                                              \
    for (int n = 0; n < nk; ++n, vr += D) {                                                 \
        const __m512 pn = _mm512_load_ps(p + n * VT);                                       \
        for (int i = 0; i < R; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(vr[i]), pn, a[i]); \
    }                                                                                       \
    for (int i = 0; i < R; ++i) _mm512_store_ps(ot + (d0 + i) * VT, a[i]);                  \
}
PV_TILE(1) PV_TILE(2) PV_TILE(3) PV_TILE(4) PV_TILE(5) PV_TILE(6) PV_TILE(7) PV_TILE(8)
PV_TILE(9) PV_TILE(10) PV_TILE(11) PV_TILE(12) PV_TILE(13) PV_TILE(14) PV_TILE(15)
PV_TILE(16)

typedef void (*PvTile)(const float*, int, int, const float*, int, float*, __m512);
static const PvTile pv_rest[16] = {NULL, pv_tile1, pv_tile2, pv_tile3, pv_tile4, pv_tile5,
                                   pv_tile6, pv_tile7, pv_tile8, pv_tile9, pv_tile10,
                                   pv_tile11, pv_tile12, pv_tile13, pv_tile14, pv_tile15};

static void pv_all(const float* vb, const float* const* vp, int D, const float* p, int nk,
                   float* ot, const float* al) {
    (void)vp;
    const __m512 a = _mm512_load_ps(al);
    int d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) pv_tile16(vb, D, d0, p, nk, ot, a);
    if (D > d0) pv_rest[D - d0](vb, D, d0, p, nk, ot, a);
}

/* The AVX2 softmax_tile below on one 16-lane vector. */
static void softmax_tile(float* s, int nk, int kb, const float* qpos, int diag, float* m,
                         float* l, float* al) {
    const __m512 qp = _mm512_loadu_ps(qpos), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 m_old = _mm512_load_ps(m);
    __m512 mx = m_old;
    for (int n = 0; n < nk; ++n) {
        __m512 x = _mm512_load_ps(s + n * VT);
        if (diag) {
            const __m512 kp = _mm512_set1_ps((float)(kb + n));
            x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(kp, qp, _CMP_GT_OQ), ninf);
            _mm512_store_ps(s + n * VT, x);
        }
        mx = _mm512_max_ps(mx, x);
    }
    const __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ),
                                           _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (int n = 0; n < nk; ++n) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(s + n * VT), base));
        _mm512_store_ps(s + n * VT, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 a = exp16(_mm512_sub_ps(m_old, base));
    _mm512_store_ps(al, a);
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), a, sum));
    _mm512_store_ps(m, mx);
}

#else /* AVX2 */
#include "exp8_avx2.h"
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365478515625f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    return _mm256_andnot_ps(under, exp8_core(_mm256_max_ps(x, lo)));
}

#define KT 6 /* keys per Q.K tile */

/* s[n][0..16) = sum_d k[n][d] qt[d][0..16) for 6 keys; qt is the tile's [D][16] queries. */
static inline void qk_tile(const float* const* k, const float* qt, int D, float* s) {
    __m256 a[6][2];
    for (int i = 0; i < 6; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const __m256 q0 = _mm256_load_ps(qt + d * VT), q1 = _mm256_load_ps(qt + d * VT + 8);
        for (int i = 0; i < 6; ++i) {
            const __m256 b = _mm256_broadcast_ss(k[i] + d);
            a[i][0] = _mm256_fmadd_ps(b, q0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, q1, a[i][1]);
        }
    }
    for (int i = 0; i < 6; ++i) {
        _mm256_store_ps(s + i * VT, a[i][0]);
        _mm256_store_ps(s + i * VT + 8, a[i][1]);
    }
}

/* ot[d0 + i][0..16) = alpha * ot[..] + sum_{n < nk} v[n][d0 + i] p[n][0..16), i < R: one
   function per R (6, and 1-5 for the last head-dim tile), each with an accumulator array
   of exactly R rows, which gcc keeps in registers (a larger, partly used one it spills). */
#define PV_TILE(R)                                                                          \
static void pv_tile##R(const float* const* v, int d0, const float* p, int nk, float* ot,   \
                       __m256 al0, __m256 al1) {                                           \
    __m256 a[R][2];                                                                         \
    for (int i = 0; i < R; ++i) {                                                           \
        a[i][0] = _mm256_mul_ps(al0, _mm256_load_ps(ot + (d0 + i) * VT));                   \
        a[i][1] = _mm256_mul_ps(al1, _mm256_load_ps(ot + (d0 + i) * VT + 8));               \
    }                                                                                       \
    for (int n = 0; n < nk; ++n) {                                                          \
        const __m256 p0 = _mm256_load_ps(p + n * VT), p1 = _mm256_load_ps(p + n * VT + 8);  \
        const float* vr = v[n] + d0;                                                        \
        for (int i = 0; i < R; ++i) {                                                       \
            const __m256 b = _mm256_broadcast_ss(vr + i);                                   \
            a[i][0] = _mm256_fmadd_ps(b, p0, a[i][0]);                                      \
            a[i][1] = _mm256_fmadd_ps(b, p1, a[i][1]);                                      \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < R; ++i) {                                                           \
        _mm256_store_ps(ot + (d0 + i) * VT, a[i][0]);                                       \
        _mm256_store_ps(ot + (d0 + i) * VT + 8, a[i][1]);                                   \
    }                                                                                       \
}
PV_TILE(1) PV_TILE(2) PV_TILE(3) PV_TILE(4) PV_TILE(5) PV_TILE(6)

static void qk_block(const float* kb, const float* const* kp, int n_use, const float* qt,
                     int D, float* s) {
    (void)kb;
    for (int n0 = 0; n0 < n_use; n0 += KT) qk_tile(kp + n0, qt, D, s + n0 * VT);
}

static void pv_all(const float* vb, const float* const* v, int D, const float* p, int nk,
                   float* ot, const float* al) {
    (void)vb;
    const __m256 al0 = _mm256_load_ps(al), al1 = _mm256_load_ps(al + 8);
    int d0 = 0;
    for (; d0 + 6 <= D; d0 += 6) pv_tile6(v, d0, p, nk, ot, al0, al1);
    switch (D - d0) {
        case 1: pv_tile1(v, d0, p, nk, ot, al0, al1); break;
        case 2: pv_tile2(v, d0, p, nk, ot, al0, al1); break;
        case 3: pv_tile3(v, d0, p, nk, ot, al0, al1); break;
        case 4: pv_tile4(v, d0, p, nk, ot, al0, al1); break;
        case 5: pv_tile5(v, d0, p, nk, ot, al0, al1); break;
        default: break;
    }
}

/* Online softmax of one tile's scores s[n][16], n < nk, keys at positions kb + n; lanes at
   query positions qpos[0..16). Masks key > query when `diag`, turns s into p in place,
   updates the running max m and sum l, returns the factors (al) for the old output. A
   lane that has seen no key yet keeps m = -inf, l = 0 and p = 0 (exp's base 0, not -inf:
   -inf - -inf would be NaN); only rows at positions before the context's first key, an
   inconsistent batch, stay so, and give zeros as SDPA's fully masked rows. */
static void softmax_tile(float* s, int nk, int kb, const float* qpos, int diag, float* m,
                         float* l, float* al) {
    for (int j = 0; j < 2; ++j) {
        const __m256 qp = _mm256_loadu_ps(qpos + 8 * j), ninf = _mm256_set1_ps(-INFINITY);
        const __m256 m_old = _mm256_load_ps(m + 8 * j);
        __m256 mx = m_old;
        for (int n = 0; n < nk; ++n) {
            __m256 x = _mm256_load_ps(s + n * VT + 8 * j);
            if (diag) {
                const __m256 kp = _mm256_set1_ps((float)(kb + n));
                x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(kp, qp, _CMP_GT_OQ));
                _mm256_store_ps(s + n * VT + 8 * j, x);
            }
            mx = _mm256_max_ps(mx, x);
        }
        const __m256 base = _mm256_blendv_ps(mx, _mm256_setzero_ps(),
                                             _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ));
        __m256 sum = _mm256_setzero_ps();
        for (int n = 0; n < nk; ++n) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s + n * VT + 8 * j), base));
            _mm256_store_ps(s + n * VT + 8 * j, e);
            sum = _mm256_add_ps(sum, e);
        }
        const __m256 a = exp8(_mm256_sub_ps(m_old, base));
        _mm256_store_ps(al + 8 * j, a);
        _mm256_store_ps(l + 8 * j, _mm256_fmadd_ps(_mm256_load_ps(l + 8 * j), a, sum));
        _mm256_store_ps(m + 8 * j, mx);
    }
}

#endif

/* q, the pools and out hold dtype dt (float32 or bfloat16): a bfloat16 block's K and V rows
   are widened into the float32 block buffers as they are copied there, the queries as they
   are packed, and the float32 output is rounded once as it is written; every tile works on
   float32 as before. */
typedef struct {
    const void* q; int64_t q_t, q_h;
    const void *k_pool, *v_pool; int64_t slot_stride;
    const int32_t* req_to_token; int64_t table_stride;
    const int32_t *req_slots, *qo_indptr, *prefix_lens;
    void* out;
    int H, KVH, D, BQ, dt;
    float scale;
} Args;

/* dst[0..D) = the D elements at src + off (elements of dtype dt), widened to float. */
static inline void widen_row(float* dst, const void* src, int64_t off, int D, int dt) {
    if (dt == DT_F32) {
        memcpy(dst, (const float*)src + off, sizeof(float) * D);
        return;
    }
    int d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, ld8(src, off + d, DT_BF16));
    for (; d < D; ++d) dst[d] = ld_f(src, off + d, DT_BF16);
}

typedef struct { float *qt, *ot, *s, *m, *l, *qpos, *kblk, *vblk; const float **kp, **vp; } Work;

/* Rows r0 .. r0 + rows of request b, kv head kh: their G heads as G * rows query lanes,
   lane l = g * rows + r, in tiles of 16 lanes (the padding lanes past G * rows are zero
   queries whose results are dropped). A few rows (a verify step's 1 + k) of all G heads
   share one tile instead of padding each head to 16; a tile may hold rows of two heads,
   so its causal bounds come from its lanes' positions. */
static void item(const Args* a, const Work* w, int b, int kh, int r0, int rows) {
    const int G = a->H / a->KVH, D = a->D, nlanes = G * rows;
    const int ntiles = (nlanes + VT - 1) / VT;
    const int prefix = a->prefix_lens[b], row0 = a->qo_indptr[b] + r0;
    const int32_t* slots = a->req_to_token + (int64_t)a->req_slots[b] * a->table_stride;
    const int kend = prefix + r0 + rows; /* keys 0 .. kend - 1: the last row's context */
    for (int l = 0; l < ntiles * VT; ++l) {
        float* dst = w->qt + (int64_t)(l / VT) * D * VT + l % VT;
        const int g = l / rows, r = l < nlanes ? l % rows : rows - 1;
        w->qpos[l] = (float)(prefix + r0 + r);
        const int64_t src = (int64_t)(row0 + r) * a->q_t + (int64_t)(kh * G + g) * a->q_h;
        if (l >= nlanes)
            for (int d = 0; d < D; ++d) dst[d * VT] = 0.0f;
        else if (a->dt == DT_F32)
            for (int d = 0; d < D; ++d) dst[d * VT] = ld_f(a->q, src + d, DT_F32) * a->scale;
        else
            for (int d = 0; d < D; ++d) dst[d * VT] = ld_f(a->q, src + d, DT_BF16) * a->scale;
    }
    memset(w->ot, 0, sizeof(float) * (size_t)ntiles * D * VT);
    for (int i = 0; i < ntiles * VT; ++i) { w->m[i] = -INFINITY; w->l[i] = 0.0f; }
    int tfirst[ntiles], tlast[ntiles]; /* each tile's lowest and highest query position */
    for (int t = 0; t < ntiles; ++t) {
        tfirst[t] = tlast[t] = (int)w->qpos[t * VT];
        for (int i = 1; i < VT; ++i) {
            const int p = (int)w->qpos[t * VT + i];
            tfirst[t] = p < tfirst[t] ? p : tfirst[t];
            tlast[t] = p > tlast[t] ? p : tlast[t];
        }
    }
    for (int kb = 0; kb < kend; kb += BK) {
        const int nk = kend - kb < BK ? kend - kb : BK;
        /* The block's K and V rows copied side by side (rows past the context zero): the
           tiles then read one buffer with a fixed row stride. */
        for (int n = 0; n < BK; ++n) {
            float *kd = w->kblk + (int64_t)n * D, *vd = w->vblk + (int64_t)n * D;
            if (n < nk) {
                const int64_t off = (int64_t)slots[kb + n] * a->slot_stride + kh * D;
                widen_row(kd, a->k_pool, off, D, a->dt);
                widen_row(vd, a->v_pool, off, D, a->dt);
            } else {
                memset(kd, 0, sizeof(float) * D);
                memset(vd, 0, sizeof(float) * D);
            }
            w->kp[n] = kd;
            w->vp[n] = vd;
        }
        /* The next block's rows, scattered over the pool: fetched while this one runs. */
        const int esz = a->dt == DT_F32 ? 4 : 2;
        for (int n = kb + BK; n < kb + 2 * BK && n < kend; ++n) {
            const int64_t off = ((int64_t)slots[n] * a->slot_stride + kh * D) * esz;
            for (int c = 0; c < D * esz; c += 64) {
                __builtin_prefetch((const char*)a->k_pool + off + c);
                __builtin_prefetch((const char*)a->v_pool + off + c);
            }
        }
        for (int t = 0; t < ntiles; ++t) {
            if (kb > tlast[t]) continue; /* every key of the block is in the future */
            const int lim = tlast[t] + 1 - kb, n_use = nk < lim ? nk : lim;
            const float* qt = w->qt + (int64_t)t * D * VT;
            qk_block(w->kblk, w->kp, n_use, qt, D, w->s);
            float al[VT] __attribute__((aligned(64)));
            softmax_tile(w->s, n_use, kb, w->qpos + t * VT, kb + n_use - 1 > tfirst[t],
                         w->m + t * VT, w->l + t * VT, al);
            pv_all(w->vblk, w->vp, D, w->s, n_use, w->ot + (int64_t)t * D * VT, al);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < rows; ++r) {
            const int t = (g * rows + r) / VT, lane = (g * rows + r) % VT;
            const float l = w->l[t * VT + lane], inv = l > 0.0f ? 1.0f / l : 0.0f;
            const float* src = w->ot + (int64_t)t * D * VT + lane;
            const int64_t dst = ((int64_t)(row0 + r) * a->H + kh * G + g) * D;
            if (a->dt == DT_F32)
                for (int d = 0; d < D; ++d) st_f(a->out, dst + d, src[d * VT] * inv, DT_F32);
            else
                for (int d = 0; d < D; ++d) st_f(a->out, dst + d, src[d * VT] * inv, DT_BF16);
        }
}

typedef struct { int64_t cost; int b, qb; } Task;

static int by_cost(const void* x, const void* y) {
    const int64_t a = ((const Task*)x)->cost, b = ((const Task*)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* q [T, H, D] (strides q_t, q_h; D contiguous); pools [S, KVH, D], rows slot_stride
   apart; out [T, H, D] contiguous (only the rows of requests 0 .. B - 1 are written); all of
   dtype dt (float32 or bfloat16). Request b: rows qo_indptr[b] .. qo_indptr[b + 1],
   positions prefix_lens[b] + i, its context req_to_token[req_slots[b], 0 .. prefix + rows].
   Returns nonzero when out of memory (2: a dtype it does not take). */
int rs_extend_attention(int dt, const void* q, int64_t q_t, int64_t q_h, const void* k_pool,
                        const void* v_pool, int64_t slot_stride, const int32_t* req_to_token,
                        int64_t table_stride, const int32_t* req_slots,
                        const int32_t* qo_indptr, const int32_t* prefix_lens, void* out, int B,
                        int H, int KVH, int D, float scale, int BQ, int nthreads) {
    if (dt != DT_F32 && dt != DT_BF16) return 2;
    const Args a = {q, q_t, q_h, k_pool, v_pool, slot_stride, req_to_token, table_stride,
                    req_slots, qo_indptr, prefix_lens, out, H, KVH, D, BQ, dt, scale};
    int64_t ntask = 0;
    for (int b = 0; b < B; ++b) ntask += (qo_indptr[b + 1] - qo_indptr[b] + BQ - 1) / BQ;
    Task* tasks = (Task*)malloc(sizeof(Task) * (ntask ? ntask : 1));
    if (tasks == NULL) return 1;
    int64_t i = 0, work = 0; /* work: (query row, key) pairs, an upper bound */
    for (int b = 0; b < B; ++b) {
        const int n = qo_indptr[b + 1] - qo_indptr[b];
        for (int qb = 0; qb * BQ < n; ++qb) {
            const int rows = n - qb * BQ < BQ ? n - qb * BQ : BQ;
            tasks[i++] = (Task){(int64_t)(prefix_lens[b] + qb * BQ + rows) * rows, b, qb};
            work += tasks[i - 1].cost;
        }
    }
    qsort(tasks, ntask, sizeof(Task), by_cost); /* largest first: the threads end together */
    const int G = H / KVH, bq_max = (BQ + VT - 1) / VT * VT, lanes = G * bq_max;
    int failed = 0;
    /* A small call runs on one thread: a parallel region costs more than it saves there,
       and a whole scheduler time slice when another process holds the other core. */
    const int nth = work * H * D < PARALLEL_MIN ? 1 : nthreads;
    #pragma omp parallel num_threads(nth) reduction(|: failed)
    {
        Work w;
        float* buf = (float*)aligned_alloc(64, sizeof(float) * ((size_t)2 * lanes * D
                                           + BK * VT + 3 * lanes + 64 + 2 * BK * D + 16));
        const float** ptrs = (const float**)malloc(sizeof(float*) * 2 * BK);
        if (buf != NULL && ptrs != NULL) {
            w.qt = buf;
            w.ot = w.qt + (size_t)lanes * D;
            w.s = w.ot + (size_t)lanes * D;
            w.m = w.s + BK * VT;
            w.l = w.m + lanes;
            w.qpos = w.l + lanes;
            w.kblk = w.qpos + lanes + 16;
            w.vblk = w.kblk + (size_t)BK * D;
            w.kp = ptrs;
            w.vp = ptrs + BK;
        } else {
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < ntask * KVH; ++t) {
            if (buf == NULL || ptrs == NULL) continue;
            const Task* k = tasks + t / KVH;
            const int n = qo_indptr[k->b + 1] - qo_indptr[k->b], r0 = k->qb * BQ;
            item(&a, &w, k->b, (int)(t % KVH), r0, n - r0 < BQ ? n - r0 : BQ);
        }
        free(buf);
        free(ptrs);
    }
    free(tasks);
    return failed;
}

/* The float32 entry of before (rs_extend_attention with dt = DT_F32). */
int rs_extend_attention_f32(const float* q, int64_t q_t, int64_t q_h, const float* k_pool,
                            const float* v_pool, int64_t slot_stride,
                            const int32_t* req_to_token, int64_t table_stride,
                            const int32_t* req_slots, const int32_t* qo_indptr,
                            const int32_t* prefix_lens, float* out, int B, int H, int KVH,
                            int D, float scale, int BQ, int nthreads) {
    return rs_extend_attention(DT_F32, q, q_t, q_h, k_pool, v_pool, slot_stride, req_to_token,
                               table_stride, req_slots, qo_indptr, prefix_lens, out, B, H, KVH,
                               D, scale, BQ, nthreads);
}
#endif /* without AVX2/FMA no kernel (its tiles are AVX2 code): the caller keeps SDPA */
