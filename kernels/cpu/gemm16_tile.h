/* One tile and one weight-row block of gemm16.c for one vector vocabulary: included once
   per vocabulary with these defined (a template in C; kernels/_cc.read_source pastes it at
   each include):
     TILE, BLOCK         the names of the two functions
     XT                  the element of the prepared x rows (uint16_t bfloat16 or float)
     VEC, XV             the accumulator and the operand vector types
     STEP                elements of K per operand vector (32, 16 or 8)
     ACC_LANES           floats per accumulator
     VZERO(), VLOADA(p), VSTOREA(p, v), HSUM(v)     accumulators: zero, spill, lane sum
     LOADX(p), LOADW(p), LOADW_TAIL(p, n), DOT(acc, x, w)
   x rows are zero-padded to a multiple of 32 (gemm16.c prepares them), so only the
   weights' last partial step needs a tail load. */

static inline __attribute__((always_inline)) void TILE(
    const XT* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k0, int64_t k1,
    const int mr, const int nr, float* part, int first, int last, void* y, int64_t ldy,
    int ydt, const float* bias, int pf0, int pfs) {
    VEC acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
            acc[i][j] = first ? VZERO() : VLOADA(part + (i * NR + j) * ACC_LANES);
    int64_t k = k0;
#define GEMM16_STEP(KK)                                                       \
    {                                                                         \
        XV xv[MR];                                                            \
        for (int i = 0; i < mr; ++i) xv[i] = LOADX(x + i * ldx + (KK));       \
        for (int j = 0; j < nr; ++j) {                                        \
            XV wv = LOADW(w + j * ldw + (KK));                                \
            REG(wv);                                                          \
            for (int i = 0; i < mr; ++i) acc[i][j] = DOT(acc[i][j], xv[i], wv); \
        }                                                                     \
    }
    if (pf0 >= 0) /* fetch rows pf0, pf0 + pfs, ... of the next block meanwhile: gemm.c */
        for (; k + LINE <= k1; k += LINE) {
            for (int j = pf0; j < nr; j += pfs)
                _mm_prefetch((const char*)(w + (NR + j) * ldw + k), _MM_HINT_T1);
            for (int h = 0; h < LINE; h += STEP) GEMM16_STEP(k + h)
        }
    for (; k + STEP <= k1; k += STEP) GEMM16_STEP(k)
#undef GEMM16_STEP
    if (k < k1) { /* the weights' tail loads zeros past K; x is zero there already */
        XV wv[NR];
        for (int j = 0; j < nr; ++j) wv[j] = LOADW_TAIL(w + j * ldw + k, (int)(k1 - k));
        for (int i = 0; i < mr; ++i) {
            const XV xv = LOADX(x + i * ldx + k);
            for (int j = 0; j < nr; ++j) acc[i][j] = DOT(acc[i][j], xv, wv[j]);
        }
    }
    if (!last) {
        for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j) VSTOREA(part + (i * NR + j) * ACC_LANES, acc[i][j]);
        return;
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            const float s = HSUM(acc[i][j]);
            store_y(y, i * ldy + j, bias ? s + bias[j] : s, ydt);
        }
}

/* Every tile of one block of nr weight rows, K in chunks of KC, the M rows split as evenly
   as MR allows (gemm.c's block()). */
static void BLOCK(const XT* x, int64_t ldx, const uint16_t* wn, int64_t ldw, const float* bn,
                  void* yn, int64_t M, int64_t N, int64_t K, int ydt, int nr, int pf,
                  float* part) {
    const int64_t T = (M + MR - 1) / MR;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K;
        const int first = k0 == 0, last = k1 == K;
        int mr = 0;
        for (int64_t t = 0, m = 0; t < T; ++t, m += mr) {
            mr = (int)((M - m + (T - t) - 1) / (T - t));
            const XT* xm = x + m * ldx;
            const int64_t ym = m * N;
            float* pm = part + m * NR * ACC_LANES;
            const int pf0 = pf && t < NR ? (int)t : -1;
#define GEMM16_TILE(MRC, NRC) \
    TILE(xm, ldx, wn, ldw, k0, k1, MRC, NRC, pm, first, last, y_at(yn, ym, ydt), N, ydt, bn, \
         pf0, (int)T)
#define GEMM16_ROWS(NRC)                           \
    switch (mr) {                                  \
        case 1: GEMM16_TILE(1, NRC); break;        \
        case 2: GEMM16_TILE(2, NRC); break;        \
        default: GEMM16_TILE(3, NRC); break;       \
    }
            if (nr == 4) GEMM16_ROWS(4) else if (nr == 3) GEMM16_ROWS(3)
            else if (nr == 2) GEMM16_ROWS(2) else GEMM16_ROWS(1)
#undef GEMM16_ROWS
#undef GEMM16_TILE
        }
    }
}
