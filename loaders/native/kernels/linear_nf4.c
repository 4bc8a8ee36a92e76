/*
 * y = x @ W^T (+ bias) for bitsandbytes 4-bit weights (nf4, fp4) as Linear4bit saves them: W [N, K] row-major,
 * two codes a byte with the first input in the high nibble, one float32 absmax per block of `bs` inputs (bs a
 * multiple of 16 dividing K, so no block straddles two rows), W[n, j] = table[code] * absmax[n, j / bs]. float32 or
 * bfloat16 x, bias and y.
 *
 * Why floats: nf4's 16 values are not integers times a power of two (unlike MXFP4's e2m1, see linear_mxfp4.c), so
 * no byte table turns them into exact integer products; a float table does, and x stays float32 (no activation
 * rounding: the result is the float32 product of the decoded weight, summed in another order). The table's
 * floats are split into four byte planes: one vpshufb per plane looks up byte j of 32 values at once, and two
 * rounds of unpacking reassemble them, bit for bit. (vpermps over two 8-float registers and a blend, the first
 * form, took twice the time: the permutes were the bottleneck.) One 16-byte load holds 32 codes; the high
 * nibbles are the even inputs, the low ones the odd, so x is laid out once per call as, per 8 inputs, the 4 even
 * ones then the 4 odd (decode32's order). Each block's sum is scaled by its absmax once. AVX2 + FMA only: the
 * AVX-512 builds compile the same code (their flags include AVX2), so every path runs what the AVX2 machine tests.
 * Each thread reads whole weight rows front to back, up to MAXM rows of x per pass over them.
 */
#include "common.h"

#define ROWS 8   /* weight rows per tile */
#define MAXM 2   /* rows of x per pass over a weight row (four accumulators each) */
#define CHUNK 16 /* inputs per 8 code bytes; decode32 takes two */

/* The 16 table floats as four byte planes (byte j of every value), each in both 128-bit lanes, for vpshufb. */
typedef struct {
    __m256i plane[4];
} byte_planes;

static byte_planes make_planes(const float *table) {
    uint8_t bytes[4][16];
    for (int v = 0; v < 16; v++) {
        uint32_t u;
        memcpy(&u, table + v, sizeof u);
        for (int j = 0; j < 4; j++) bytes[j][v] = (uint8_t)(u >> (8 * j));
    }
    byte_planes t;
    for (int j = 0; j < 4; j++) t.plane[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[j]));
    return t;
}

/* 32 codes (16 code bytes; 8 when `half`, the rest zero) as floats, bit for bit the table's: the high nibbles
 * (even inputs) in the low lane, the low nibbles (odd inputs) in the high lane; one vpshufb per byte plane gives
 * byte j of all 32 values, and two rounds of unpacking put the four bytes of each value together. f[k] then holds
 * inputs 8k .. 8k+7 as 8k, 8k+2, 8k+4, 8k+6, 8k+1, 8k+3, 8k+5, 8k+7: the order x is laid out in. */
static LM_ALWAYS_INLINE void decode32(__m128i b, const byte_planes *t, __m256 f[4]) {
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib), lo = _mm_and_si128(b, nib);
    const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(hi), lo, 1);
    const __m256i q0 = _mm256_shuffle_epi8(t->plane[0], c), q1 = _mm256_shuffle_epi8(t->plane[1], c);
    const __m256i q2 = _mm256_shuffle_epi8(t->plane[2], c), q3 = _mm256_shuffle_epi8(t->plane[3], c);
    const __m256i l01 = _mm256_unpacklo_epi8(q0, q1), l23 = _mm256_unpacklo_epi8(q2, q3);
    const __m256i h01 = _mm256_unpackhi_epi8(q0, q1), h23 = _mm256_unpackhi_epi8(q2, q3);
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l01, l23));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l01, l23));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(h01, h23));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(h01, h23));
}

/* One weight row (codes wr, absmax ar) against NM laid-out x rows (xp, K floats apart): two accumulator chains per
 * x row within a block, the same order whatever NM is (a row's result does not depend on its batch). */
static LM_ALWAYS_INLINE void row_dot(const float *xp, int K, int bs, const uint8_t *wr, const float *ar,
                                     const byte_planes *t, float *acc_out, const int NM) {
    __m256 acc[MAXM];
    for (int m = 0; m < NM; m++) acc[m] = _mm256_setzero_ps();
    for (int b0 = 0; b0 < K; b0 += bs) {
        __m256 a[MAXM], b[MAXM], a2[MAXM], b2[MAXM], f[4];
        for (int m = 0; m < NM; m++) a[m] = b[m] = a2[m] = b2[m] = _mm256_setzero_ps();
        lm_prefetch(wr + b0 / 2 + LM_PREFETCH_AHEAD);
        int c = b0;
        for (; c + 2 * CHUNK <= b0 + bs; c += 2 * CHUNK) {
            decode32(_mm_loadu_si128((const __m128i *)(wr + c / 2)), t, f);
            for (int m = 0; m < NM; m++) {
                const float *xc = xp + (long)m * K + c;
                a[m] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xc), a[m]);
                b[m] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xc + 8), b[m]);
                a2[m] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xc + 16), a2[m]);
                b2[m] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xc + 24), b2[m]);
            }
        }
        if (c < b0 + bs) { /* a block of an odd number of 16-input chunks: its last one */
            decode32(_mm_loadl_epi64((const __m128i *)(wr + c / 2)), t, f);
            for (int m = 0; m < NM; m++) {
                const float *xc = xp + (long)m * K + c;
                a[m] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xc), a[m]);
                b[m] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xc + 8), b[m]);
            }
        }
        const __m256 s = _mm256_set1_ps(ar[b0 / bs]);
        for (int m = 0; m < NM; m++) {
            const __m256 blk = _mm256_add_ps(_mm256_add_ps(a[m], b[m]), _mm256_add_ps(a2[m], b2[m]));
            acc[m] = _mm256_fmadd_ps(blk, s, acc[m]);
        }
    }
    for (int m = 0; m < NM; m++) acc_out[m] = lm_hsum256(acc[m]);
}

static LM_ALWAYS_INLINE void row_out(const float *xp, int K, int bs, const uint8_t *wr, const float *ar,
                                     const byte_planes *t, float bias, void *y, long ldy, int x_bf16, long n, int m0,
                                     const int NM) {
    float acc[MAXM];
    row_dot(xp + (long)m0 * K, K, bs, wr, ar, t, acc, NM);
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
    for (int m = 0; m < M; m++) /* per 8 inputs: the 4 even, then the 4 odd (decode32's order) */
        for (int c = 0; c < K; c += 8)
            for (int i = 0; i < 4; i++) {
                xp[(long)m * K + c + i] = lm_act(x, x_bf16, (long)m * ldx + c + 2 * i);
                xp[(long)m * K + c + 4 + i] = lm_act(x, x_bf16, (long)m * ldx + c + 2 * i + 1);
            }
    const byte_planes planes = make_planes(table);
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
                /* one instance per row count and, for bitsandbytes' default block of 64, per block size: both
                 * constants, so the block's two steps unroll and NM's loops vanish (see row_dot) */
                if (nm == 1 && bs == 64)
                    row_out(xp, K, 64, wr, ar, &planes, b, y, ldy, x_bf16, n, m0, 1);
                else if (nm == 1)
                    row_out(xp, K, bs, wr, ar, &planes, b, y, ldy, x_bf16, n, m0, 1);
                else if (bs == 64)
                    row_out(xp, K, 64, wr, ar, &planes, b, y, ldy, x_bf16, n, m0, 2);
                else
                    row_out(xp, K, bs, wr, ar, &planes, b, y, ldy, x_bf16, n, m0, 2);
            }
        }
    }
    free(xp);
    return 0;
}
