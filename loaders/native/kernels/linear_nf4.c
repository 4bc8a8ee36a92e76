/*
 * y = x @ W^T (+ bias) for bitsandbytes 4-bit weights (nf4, fp4) as Linear4bit saves them: W [N, K] row-major,
 * two codes a byte with the first input in the high nibble, one float32 absmax per block of `bs` inputs (bs a
 * multiple of 16 dividing K, so no block straddles two rows), W[n, j] = table[code] * absmax[n, j / bs]. float32 or
 * bfloat16 x, bias and y.
 *
 * Why floats: nf4's 16 values are not integers times a power of two (unlike MXFP4's e2m1, see linear_mxfp4.c), so
 * no byte table turns them into exact integer products; a float table does, and x stays float32 (no activation
 * rounding: the result is the float32 product of the decoded weight, summed in another order). 16 table entries
 * are two 8-float registers: vpermps picks from each by a code's low 3 bits, and a blend on bit 3 (the code
 * shifted so that bit 3 is the sign) picks the register. One 8-byte load holds 16 codes: its high nibbles are the
 * 8 even inputs, its low nibbles the 8 odd ones, so x is laid out once per call as, per 16 inputs, the 8 even ones
 * then the 8 odd. Each block's sum is one register, scaled by its absmax once. AVX2 + FMA only: the AVX-512
 * builds compile the same code (their flags include AVX2), so every path runs what the AVX2 machine tests.
 * Each thread reads whole weight rows front to back, up to MAXM rows of x per pass over them.
 */
#include "common.h"

#define ROWS 8   /* weight rows per tile */
#define MAXM 4   /* rows of x per pass over a weight row */
#define CHUNK 16 /* inputs per weight load (8 bytes) */

/* 16 codes (8 bytes at wp) as floats: the high nibbles (even inputs) in *even, the low ones (odd inputs) in *odd. */
static LM_ALWAYS_INLINE void decode16(const uint8_t *wp, __m256 t0, __m256 t1, __m256 *even, __m256 *odd) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)wp));
    const __m256i hi = _mm256_srli_epi32(b, 4);
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15));
    *even = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                             _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
    *odd = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                            _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
}

/* One weight row (codes wr, absmax ar) against NM laid-out x rows (xp, K floats apart). */
static LM_ALWAYS_INLINE void row_dot(const float *xp, int K, int bs, const uint8_t *wr, const float *ar, __m256 t0,
                                     __m256 t1, float *acc_out, const int NM) {
    __m256 acc[MAXM];
    for (int m = 0; m < NM; m++) acc[m] = _mm256_setzero_ps();
    for (int b0 = 0; b0 < K; b0 += bs) {
        __m256 blk[MAXM];
        for (int m = 0; m < NM; m++) blk[m] = _mm256_setzero_ps();
        lm_prefetch(wr + b0 / 2 + LM_PREFETCH_AHEAD);
        for (int c = b0; c < b0 + bs; c += CHUNK) {
            __m256 we, wo;
            decode16(wr + c / 2, t0, t1, &we, &wo);
            for (int m = 0; m < NM; m++) {
                const float *xc = xp + (long)m * K + c;
                blk[m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xc), blk[m]);
                blk[m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + 8), blk[m]);
            }
        }
        const __m256 s = _mm256_set1_ps(ar[b0 / bs]);
        for (int m = 0; m < NM; m++) acc[m] = _mm256_fmadd_ps(blk[m], s, acc[m]);
    }
    for (int m = 0; m < NM; m++) acc_out[m] = lm_hsum256(acc[m]);
}

static LM_ALWAYS_INLINE void row_out(const float *xp, int K, int bs, const uint8_t *wr, const float *ar, __m256 t0,
                                     __m256 t1, float bias, void *y, long ldy, int x_bf16, long n, int m0,
                                     const int NM) {
    float acc[MAXM];
    row_dot(xp + (long)m0 * K, K, bs, wr, ar, t0, t1, acc, NM);
    for (int m = 0; m < NM; m++) lm_store(y, x_bf16, (long)(m0 + m) * ldy + n, acc[m] + bias);
}

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] code bytes
 * (ldw >= K / 2), absmax: [N, lda] float32 (lda >= K / bs), table: 16 float32 values, bias: [N] in x's dtype or
 * NULL, y: [M, N] (row stride ldy) in x's dtype. bs must be a multiple of 16 that divides K. */
int lm_linear_nf4(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const float *absmax, long lda,
                  int bs, const float *table, const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    if (bs < CHUNK || bs % CHUNK || K % bs || ldw < K / 2 || lda < K / bs) return 2;
    float *xp = aligned_alloc(64, sizeof(float) * (size_t)M * K);
    if (!xp) return 3;
    for (int m = 0; m < M; m++) /* per 16 inputs: the 8 even, then the 8 odd */
        for (int c = 0; c < K; c += CHUNK)
            for (int i = 0; i < 8; i++) {
                xp[(long)m * K + c + i] = lm_act(x, x_bf16, (long)m * ldx + c + 2 * i);
                xp[(long)m * K + c + 8 + i] = lm_act(x, x_bf16, (long)m * ldx + c + 2 * i + 1);
            }
    const __m256 t0 = _mm256_loadu_ps(table), t1 = _mm256_loadu_ps(table + 8);
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * ldw;
                const float *ar = absmax + n * lda;
                const float b = bias ? lm_act(bias, x_bf16, n) : 0.0f;
                switch (nm) { /* one instance per row count: NM must be a constant (see row_dot) */
                case 1: row_out(xp, K, bs, wr, ar, t0, t1, b, y, ldy, x_bf16, n, m0, 1); break;
                case 2: row_out(xp, K, bs, wr, ar, t0, t1, b, y, ldy, x_bf16, n, m0, 2); break;
                case 3: row_out(xp, K, bs, wr, ar, t0, t1, b, y, ldy, x_bf16, n, m0, 3); break;
                default: row_out(xp, K, bs, wr, ar, t0, t1, b, y, ldy, x_bf16, n, m0, 4); break;
                }
            }
        }
    }
    free(xp);
    return 0;
}
