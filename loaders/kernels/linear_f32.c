/*
 * y = x @ W^T (+ bias) for float32 x, W, bias and y, for a few rows of x (decode steps, small batches).
 *
 * Why: torch's float32 CPU matmul goes to MKL, which on this project's machines reaches ~22 GB/s for one row
 * and ~5-12 GB/s for 2-32 rows (its small-M path); reading W's rows in place with fused multiply-adds reaches
 * 2-4x that. The same loop shape as linear_bf16.c: ROWS rows of W per step, MAXM rows of x per pass, rows of W
 * split among OpenMP threads. Each output element is summed in the same order whatever the number of rows, so a
 * sequence's result does not depend on its batch neighbours.
 *
 * Compiled once per instruction set by loaders/cpu_kernels.py: AVX-512 (16 floats per FMA) or AVX2 + FMA (8).
 */
#include "common.h"

#define ROWS 4

#if defined(__AVX512F__)
#define MAXM 4

static inline void block(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                         int n0, int nrows, int nm, int K) {
    __m512 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    const float *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const int kfull = K & ~15;
    for (int k = 0; k < kfull; k += 16) {
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_loadu_ps(wr[r] + k);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512 xv = _mm512_loadu_ps(x + (long)m * ldx + k);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    if (kfull < K) {
        const __mmask16 tail = (__mmask16)((1u << (K - kfull)) - 1u);
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_maskz_loadu_ps(tail, wr[r] + kfull);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512 xv = _mm512_maskz_loadu_ps(tail, x + (long)m * ldx + kfull);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) s += bias[n0 + r];
            y[(long)m * ldy + n0 + r] = s;
        }
}

#else /* AVX2 + FMA */
#define MAXM 2

static inline void block(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                         int n0, int nrows, int nm, int K) {
    __m256 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm256_setzero_ps();
    const float *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const int kfull = K & ~7;
    for (int k = 0; k < kfull; k += 8) {
        __m256 xv[MAXM];
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            xv[m] = _mm256_loadu_ps(x + (long)m * ldx + k);
        }
        for (int r = 0; r < ROWS; r++) {
            __m256 wv = _mm256_loadu_ps(wr[r] + k);
            for (int m = 0; m < MAXM; m++) {
                if (m >= nm) break;
                acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) {
            float s = lm_hsum256(acc[m][r]);
            for (int k = kfull; k < K; k++) s += x[(long)m * ldx + k] * wr[r][k];
            if (bias) s += bias[n0 + r];
            y[(long)m * ldy + n0 + r] = s;
        }
}
#endif

/* Returns 0 on success. x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N]. */
int lm_linear_f32(const float *x, long ldx, const float *w, long ldw, const float *bias, float *y, long ldy,
                  int M, int N, int K, int threads) {
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
