/*
 * y = x @ W^T (+ bias) for bfloat16 x, W, bias and y, with float32 accumulation, for a few rows of x.
 *
 * Why: at decode time a linear layer multiplies one (or a handful of) activation rows by a weight matrix that is
 * read once per token, so its speed is the memory bandwidth it reaches. torch's bf16 path on CPU reaches about
 * half of it on this project's machines (measured, not diagnosed); reading W's rows in place, 64 bytes at a
 * time, with AVX512-BF16 pairwise dot products, reaches close to the streaming rate. W is
 * read where it lies, so a weight that is a view of a safetensors file mapping stays zero-copy.
 *
 * The rows of W are split among OpenMP threads. Built at run time by loaders/cpu_kernels.py with
 * -mavx512f -mavx512bw -mavx512bf16 -fopenmp; used only when the CPU reports avx512_bf16.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4   /* rows of W per step: four independent accumulator chains hide the FMA latency */
#define MAXM 4   /* rows of x per pass: 4 x ROWS accumulators + 4 weight vectors fit the 32 zmm registers */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does when it stores a float32 result as bfloat16. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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
            if (bias) s += bf16_to_f32(bias[n0 + r]);
            y[(long)m * ldy + n0 + r] = f32_to_bf16(s);
        }
}

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
