/*
 * y = x @ W^T (+ bias) for float32 x, W, bias and y, for a few rows of x (decode steps, small batches).
 *
 * Why: torch's float32 CPU matmul goes to MKL, whose small-M path reaches well under the memory bandwidth for one
 * row and under half the FMA peak for 2-32 rows. This kernel reads W's rows in place, in blocks of NR rows, and:
 *
 * - tiles the product as MR rows of x by NR rows of W, so each loaded vector of W serves MR rows and each vector of
 *   x serves NR rows, with the MR x NR partial sums in registers (4 x 6 with AVX-512; 2 x 4 with AVX2's 16
 *   registers; one row of x takes 1 x 8, where bandwidth, not arithmetic, is the limit);
 * - walks K in chunks of KC, so that a block's chunk of W and the matching chunk of every row of x stay in L1 while
 *   the m-tiles pass over them; the partial sums wait in a small buffer between chunks;
 * - prefetches the next chunk of W (the next block's first chunk at the end of a block) while the first m-tile
 *   computes on this one, so the memory stream does not stall on each new block.
 *
 * Every output element is the same sum whatever the tile: lane-wise fused multiply-adds over k in order, then one
 * horizontal sum. So a row's result does not depend on how many rows came with it (batched greedy decoding equals
 * sequential). Rows of W are split among OpenMP threads in contiguous runs of blocks.
 *
 * Compiled once per instruction set by loaders/native/kernel_build.py: AVX-512 (16 floats per vector) or AVX2 + FMA (8).
 */
#include "common.h"

#define KC 256      /* floats of K per chunk (a multiple of both vector widths) */
#define NR_ONE 8    /* rows of W per block when x has one row */
#define MAX_GROUP 32 /* rows of x handled per pass over W (the partial-sum buffer's size) */

#if defined(__AVX512F__)
typedef __m512 vec;
#define VW 16
#define MR_WIDE 4
#define NR_WIDE 6
static LM_ALWAYS_INLINE vec vzero(void) { return _mm512_setzero_ps(); }
static LM_ALWAYS_INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
static LM_ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static LM_ALWAYS_INLINE float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static LM_ALWAYS_INLINE vec vload_part(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
#else /* AVX2 + FMA */
typedef __m256 vec;
#define VW 8
#define MR_WIDE 2
#define NR_WIDE 4
static LM_ALWAYS_INLINE vec vzero(void) { return _mm256_setzero_ps(); }
static LM_ALWAYS_INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
static LM_ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static LM_ALWAYS_INLINE float vsum(vec v) { return lm_hsum256(v); }
static LM_ALWAYS_INLINE vec vload_part(const float *p, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
#endif

#define NR_MAX (NR_ONE > NR_WIDE ? NR_ONE : NR_WIDE)

/* One tile over k in [k0, k1): mr rows of x (row stride ldx) against the nr rows wr[], adding into buf[mr][nr]
 * (zeroed first when `first`). `kfull` is where K's last partial vector starts (K rounded down to VW). With `pf`,
 * the row pointers pf[] are prefetched as far ahead as this chunk is long. mr and nr are constants at every call,
 * so the loops unroll and the partial sums live in registers. */
static LM_ALWAYS_INLINE void tile(const int mr, const int nr, const float *x, long ldx, const float *const *wr,
                                  int k0, int k1, int kfull, int K, vec *buf, int first, const float *const *pf) {
    vec acc[MR_WIDE][NR_MAX];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) acc[m][r] = first ? vzero() : buf[m * nr + r];
    const int kend = k1 < kfull ? k1 : kfull;
    int k = k0;
    for (; k < kend; k += VW) {
        vec wv[NR_MAX];
        for (int r = 0; r < nr; r++) wv[r] = vload(wr[r] + k);
        if (pf)
            for (int r = 0; r < nr; r++) _mm_prefetch((const char *)(pf[r] + (k - k0)), _MM_HINT_T0);
        for (int m = 0; m < mr; m++) {
            const vec xv = vload(x + (long)m * ldx + k);
            for (int r = 0; r < nr; r++) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
        }
    }
    if (k < k1) { /* K's last partial vector (only in the last chunk) */
        const int n = K - k;
        vec wv[NR_MAX];
        for (int r = 0; r < nr; r++) wv[r] = vload_part(wr[r] + k, n);
        for (int m = 0; m < mr; m++) {
            const vec xv = vload_part(x + (long)m * ldx + k, n);
            for (int r = 0; r < nr; r++) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) buf[m * nr + r] = acc[m][r];
}

/* An m-tile of wide blocks with mr rows; the switch makes mr a constant in each call of tile(). */
static inline void tile_wide(int mr, const float *x, long ldx, const float *const *wr, int k0, int k1, int kfull,
                             int K, vec *buf, int first, const float *const *pf) {
    switch (mr) {
#if MR_WIDE >= 4
    case 4: tile(4, NR_WIDE, x, ldx, wr, k0, k1, kfull, K, buf, first, pf); break;
    case 3: tile(3, NR_WIDE, x, ldx, wr, k0, k1, kfull, K, buf, first, pf); break;
#endif
    case 2: tile(2, NR_WIDE, x, ldx, wr, k0, k1, kfull, K, buf, first, pf); break;
    default: tile(1, NR_WIDE, x, ldx, wr, k0, k1, kfull, K, buf, first, pf); break;
    }
}

/* Rows n0 .. n0+nrows of y for the rows of x in [0, gm) (gm <= MAX_GROUP), with blocks of nr rows of W. */
static inline void block(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                         int n0, int nrows, int nr, int gm, int N, int K) {
    vec buf[MAX_GROUP * NR_MAX];
    const float *wr[NR_MAX], *pf[NR_MAX];
    for (int r = 0; r < nr; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const int kfull = K & ~(VW - 1);
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int k1 = K - k0 <= KC ? K : k0 + KC;
        for (int r = 0; r < nr; r++) { /* what to fetch while this chunk computes */
            if (k1 < K)
                pf[r] = wr[r] + k1;
            else
                pf[r] = n0 + nr + r < N ? w + (long)(n0 + nr + r) * ldw : wr[r];
        }
        if (nr == NR_ONE) {
            tile(1, NR_ONE, x, ldx, wr, k0, k1, kfull, K, buf, k0 == 0, pf);
            continue;
        }
        for (int m0 = 0; m0 < gm; m0 += MR_WIDE) {
            const int mr = gm - m0 < MR_WIDE ? gm - m0 : MR_WIDE;
            tile_wide(mr, x + (long)m0 * ldx, ldx, wr, k0, k1, kfull, K, buf + m0 * nr, k0 == 0, m0 == 0 ? pf : 0);
        }
    }
    for (int m0 = 0; m0 < gm; m0 += MR_WIDE) {
        const int mr = nr == NR_ONE ? 1 : (gm - m0 < MR_WIDE ? gm - m0 : MR_WIDE);
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nrows; r++) {
                float s = vsum(buf[m0 * nr + m * nr + r]);
                if (bias) s += bias[n0 + r];
                y[(long)(m0 + m) * ldy + n0 + r] = s;
            }
    }
}

/* Returns 0 on success. x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N]. */
/* Block `b` of y (nr rows of W against every row of x). */
static inline void f32_block(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                             int M, int N, int K, int nr, int b) {
    const int n0 = b * nr;
    const int nrows = N - n0 < nr ? N - n0 : nr;
    for (int g0 = 0; g0 < M; g0 += MAX_GROUP) {
        const int gm = M - g0 < MAX_GROUP ? M - g0 : MAX_GROUP;
        block(x + (long)g0 * ldx, ldx, w, ldw, bias, y + (long)g0 * ldy, ldy, n0, nrows, nr, gm, N, K);
    }
}

int lm_linear_f32(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                  int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int nr = M == 1 ? NR_ONE : NR_WIDE;
    const int nblocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nblocks; b++) f32_block(x, ldx, w, ldw, bias, y, ldy, M, N, K, nr, b);
    return 0;
}

/* Several products that read the same x, in one parallel loop over all their blocks (see lm_linear_bf16_multi);
 * each y_i is bit for bit what lm_linear_f32 gives for W_i alone. */
int lm_linear_f32_multi(const float *x, long ldx, int count, const float *const *ws, const long *ldws,
                        const float *const *biases, float *const *ys, const long *ldys, const int *ns, int M, int K,
                        int threads) {
    if (count < 1 || count > LM_MULTI_MAX || M < 1 || K < 1 || threads < 1) return 1;
    for (int i = 0; i < count; i++)
        if (ns[i] < 1) return 1;
    const int nr = M == 1 ? NR_ONE : NR_WIDE;
    int first[LM_MULTI_MAX + 1];
    first[0] = 0;
    for (int i = 0; i < count; i++) first[i + 1] = first[i] + (ns[i] + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < first[count]; g++) {
        int i = 0;
        while (g >= first[i + 1]) i++;
        f32_block(x, ldx, ws[i], ldws[i], biases[i], ys[i], ldys[i], M, ns[i], K, nr, g - first[i]);
    }
    return 0;
}
