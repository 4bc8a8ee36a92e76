/*
 * y = x @ W^T (+ bias) for bfloat16 x, W, bias and y, with float32 accumulation, for a few rows of x.
 *
 * Why: at decode time a linear layer multiplies one (or a handful of) activation rows by a weight matrix that is
 * read once per token, so its speed is the memory bandwidth it reaches. torch's bf16 path on CPU reaches about
 * half of it on this project's machines (measured, not diagnosed); reading W's rows in place reaches close to the
 * streaming rate. W is read where it lies, so a weight that is a view of a safetensors file mapping stays
 * zero-copy.
 *
 * Two instruction-set paths, one per build (loaders/cpu_kernels.py compiles this file once per path):
 * - AVX-512 (with AVX512-BF16): 32 bf16 pairs per pairwise dot-product instruction;
 * - AVX2 + FMA: a bf16 is the top half of a float32, so a 32-bit lane holding two bf16 values yields the odd one
 *   by masking the low half and the even one by shifting it up: two fused multiply-adds per 16 values, no
 *   conversion instruction.
 * The rows of W are split among OpenMP threads (torch's runtime, torch's thread count).
 */
#include "common.h"

#define ROWS 4   /* rows of W per step: independent accumulator chains hide the FMA latency */

#if defined(__AVX512F__)
#define MAXM 4   /* rows of x per pass: 4 x ROWS accumulators + 4 weight vectors fit the 32 zmm registers */

static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512bh load_bh_tail(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* One block of `nrows` (1..ROWS) rows of W against `nm` (1..MAXM) rows of x. */
static inline void block(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                         uint16_t *y, long ldy, int n0, int nrows, int nm, int K) {
    __m512 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    const uint16_t *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const int kfull = K & ~31;
    for (int k = 0; k < kfull; k += 32) {
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = load_bh(wr[r] + k);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512bh xv = load_bh(x + (long)m * ldx + k);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    if (kfull < K) {
        const __mmask32 tail = (__mmask32)((1ull << (K - kfull)) - 1ull);
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = load_bh_tail(wr[r] + kfull, tail);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512bh xv = load_bh_tail(x + (long)m * ldx + kfull, tail);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) s += lm_bf16_to_f32(bias[n0 + r]);
            y[(long)m * ldy + n0 + r] = lm_f32_to_bf16(s);
        }
}

#else /* AVX2 + FMA */
#define MAXM 2   /* 2 x ROWS accumulators + even/odd halves of x and W fit the 16 ymm registers */

static inline void block(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                         uint16_t *y, long ldy, int n0, int nrows, int nm, int K) {
    __m256 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm256_setzero_ps();
    const uint16_t *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    const int kfull = K & ~15;
    for (int k = 0; k < kfull; k += 16) {
        __m256 xe[MAXM], xo[MAXM];
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + (long)m * ldx + k));
            xe[m] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            xo[m] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
        }
        for (int r = 0; r < ROWS; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + k));
            __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
            for (int m = 0; m < MAXM; m++) {
                if (m >= nm) break;
                acc[m][r] = _mm256_fmadd_ps(we, xe[m], acc[m][r]);
                acc[m][r] = _mm256_fmadd_ps(wo, xo[m], acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) {
            float s = lm_hsum256(acc[m][r]);
            for (int k = kfull; k < K; k++) s += lm_bf16_to_f32(x[(long)m * ldx + k]) * lm_bf16_to_f32(wr[r][k]);
            if (bias) s += lm_bf16_to_f32(bias[n0 + r]);
            y[(long)m * ldy + n0 + r] = lm_f32_to_bf16(s);
        }
}
#endif

/* Returns 0 on success. x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N]. */
int lm_linear_bf16(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                   uint16_t *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int nblocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * ROWS;
        const int nrows = N - n0 < ROWS ? N - n0 : ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            block(x + (long)m0 * ldx, ldx, w, ldw, bias, y + (long)m0 * ldy, ldy, n0, nrows, nm, K);
        }
    }
    return 0;
}
