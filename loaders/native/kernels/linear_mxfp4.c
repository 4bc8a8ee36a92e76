/*
 * y = x @ W^T (+ bias) for MXFP4 weights as checkpoints store them (gpt-oss, OCP microscaling): each output row
 * holds K/32 blocks of 32 e2m1 codes (16 bytes, two codes a byte, the even input in the low nibble) and one e8m0
 * byte per block, W[n, 32b + i] = e2m1(code) * 2^(e[n, b] - 127). float32 or bfloat16 x, bias and y; K a
 * multiple of 32.
 *
 * Why integers: every e2m1 value times 2 is an integer (0, 1, 2, 3, 4, 6, 8, 12, signed), so with x quantized to
 * int8 per group of 64 as linear_q4.c does (common.h), a block's dot product is exact integer arithmetic on the
 * same instructions as our int4 kernel (VNNI dpbusd / maddubs), and MXFP4 decodes at int4 speed: the bytes per
 * weight are the same (0.5 + 1/32). A byte table (pshufb) maps each nibble to 2 * value + 12, in 0..24, unsigned
 * as dpbusd and maddubs want it; the "+ 12" comes out of the sum as in linear_q4.c: row n's result is
 * sum_b s[n, b] * dx[b / 2] / 2 * (sum(u * x)_b - 12 * sum(x)_b), and the second part is one float dot product over
 * the blocks, 16 (8 on AVX2) blocks per instruction next to the scales. The e8m0 scale is (uint32)e << 23 read as a
 * float: exactly 2^(e - 127) for e = 1..254; e = 0 (2^-127, which no quantizer writes for a weight that matters)
 * reads as 0, and e = 255 (NaN in the OCP format) as infinity.
 *
 * x layout (built once per call): per run of P blocks (one weight load: 4 on AVX-512, 2 on AVX2), the P * 16 even
 * inputs, then the P * 16 odd ones, so the low nibbles of a load meet the first half and the high nibbles the
 * second. Blocks past K are zero in x (and in the masked weight loads).
 *  - AVX-512: one 64-byte load holds 4 blocks; two dpbusd leave block b's sum in lanes 4b..4b+3, one permute of
 *    the 16 blocks' combined scales and one multiply-add apply them.
 *  - AVX2: one 32-byte load holds 2 blocks; maddubs + madd (pair sums at most 2 * 24 * 127, two of them fit 16
 *    bits), lanes 0-3 block b, 4-7 block b + 1.
 * As in linear_q4.c, each thread reads its weight rows front to back: one sequential stream per thread.
 */
#include "common.h"

#define ROWS 8   /* weight rows per tile: their bytes stay in L1 while the tile meets every chunk of x's rows */
#define BLOCK 32 /* inputs per e8m0 scale */
#define BLOCK_BYTES 16

/* nibble -> 2 * e2m1 value + 12 (codes 8..15 are the negatives of 0..7; 8 is -0) */
static const uint8_t LM_MX_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

#if defined(__AVX512F__)
#define MAXM 4
#define P 4
#define CHUNK 16 /* blocks whose scales are converted at once: one zmm of floats */

/* One weight row against NM rows of x (NM constant). xp: x in run layout, NBp blocks per x row (NB rounded up to
 * CHUNK; dxb and dxs zero past NB); dxb[b] = dx[b / 2] / 2, dxs[b] = -12 * dxb[b] * sum(x)_b. */
static LM_ALWAYS_INLINE void row_dot(const int8_t *xp, const float *dxb, const float *dxs, int NB, int NBp,
                                     const uint8_t *wr, const uint8_t *sr, float *acc_out, const int NM) {
    __m512 a0[MAXM], a1[MAXM], corr[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = corr[m] = _mm512_setzero_ps();
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)LM_MX_CODES));
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i first_run = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int c0 = 0; c0 < NB; c0 += CHUNK) {
        const int nb = NB - c0 < CHUNK ? NB - c0 : CHUNK;
        const __m128i e8 = _mm_maskz_loadu_epi8((__mmask16)((1u << nb) - 1u), sr + c0);
        const __m512 ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(e8), 23));
        __m512 sc[MAXM];
        for (int m = 0; m < NM; m++) {
            sc[m] = _mm512_mul_ps(ws, _mm512_load_ps(dxb + (long)m * NBp + c0));
            corr[m] = _mm512_fmadd_ps(ws, _mm512_load_ps(dxs + (long)m * NBp + c0), corr[m]);
        }
        __m512i idx = first_run;
        for (int j = 0; j < nb; j += P) {
            const uint8_t *wp = wr + (long)(c0 + j) * BLOCK_BYTES;
            const int left = nb - j;
            const __m512i v = left >= P ? _mm512_loadu_si512((const void *)wp)
                                        : _mm512_maskz_loadu_epi8(((__mmask64)1 << (left * BLOCK_BYTES)) - 1, wp);
            lm_prefetch(wp + LM_PREFETCH_AHEAD);
            const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
            const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            for (int m = 0; m < NM; m++) {
                const int8_t *xg = xp + ((long)m * NBp + c0 + j) * BLOCK;
                __m512i iv = _mm512_dpbusd_epi32(zero, lo, _mm512_load_si512((const void *)xg));
                iv = _mm512_dpbusd_epi32(iv, hi, _mm512_load_si512((const void *)(xg + P * BLOCK_BYTES)));
                const __m512 s = _mm512_permutexvar_ps(idx, sc[m]);
                if (j & P)
                    a1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, a1[m]);
                else
                    a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, a0[m]);
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(P));
        }
    }
    for (int m = 0; m < NM; m++)
        acc_out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), corr[m]));
}

#else /* AVX2 + FMA */
#define MAXM 2
#define P 2
#define CHUNK 8

static LM_ALWAYS_INLINE void row_dot(const int8_t *xp, const float *dxb, const float *dxs, int NB, int NBp,
                                     const uint8_t *wr, const uint8_t *sr, float *acc_out, const int NM) {
    __m256 a0[MAXM], a1[MAXM], corr[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = corr[m] = _mm256_setzero_ps();
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LM_MX_CODES));
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first_run = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int c0 = 0; c0 < NB; c0 += CHUNK) {
        const int nb = NB - c0 < CHUNK ? NB - c0 : CHUNK;
        __m128i e8;
        if (nb == CHUNK) {
            e8 = _mm_loadl_epi64((const __m128i *)(sr + c0));
        } else { /* the row's last blocks: a copy, so nothing past the row is read */
            uint8_t tail[CHUNK] = {0};
            memcpy(tail, sr + c0, (size_t)nb);
            e8 = _mm_loadl_epi64((const __m128i *)tail);
        }
        const __m256 ws = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(e8), 23));
        __m256 sc[MAXM];
        for (int m = 0; m < NM; m++) {
            sc[m] = _mm256_mul_ps(ws, _mm256_load_ps(dxb + (long)m * NBp + c0));
            corr[m] = _mm256_fmadd_ps(ws, _mm256_load_ps(dxs + (long)m * NBp + c0), corr[m]);
        }
        __m256i idx = first_run;
        for (int j = 0; j < nb; j += P) {
            const uint8_t *wp = wr + (long)(c0 + j) * BLOCK_BYTES;
            const __m256i v = nb - j >= P ? _mm256_loadu_si256((const __m256i *)wp)
                                          : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128((const __m128i *)wp));
            if (!(j & P)) lm_prefetch(wp + LM_PREFETCH_AHEAD); /* one per cache line */
            const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
            const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            for (int m = 0; m < NM; m++) {
                const int8_t *xg = xp + ((long)m * NBp + c0 + j) * BLOCK;
                const __m256i x0 = _mm256_load_si256((const __m256i *)xg);
                const __m256i x1 = _mm256_load_si256((const __m256i *)(xg + P * BLOCK_BYTES));
                const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                const __m256i p = _mm256_madd_epi16(p16, ones);
                const __m256 s = _mm256_permutevar8x32_ps(sc[m], idx);
                if (j & P)
                    a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, a1[m]);
                else
                    a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, a0[m]);
            }
            idx = _mm256_add_epi32(idx, _mm256_set1_epi32(P));
        }
    }
    for (int m = 0; m < NM; m++) acc_out[m] = lm_hsum256(_mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), corr[m]));
}
#endif

/* One x row's int8 inputs (xq, NB blocks of 32) in run layout: per run of P blocks, the even inputs, then the odd. */
static void lay_out_row(const int8_t *xq, int NB, int NBp, int8_t *xp) {
    memset(xp, 0, (size_t)NBp * BLOCK);
    for (int b = 0; b < NB; b++) {
        const int8_t *src = xq + (long)b * BLOCK;
        int8_t *even = xp + (long)(b - b % P) * BLOCK + (b % P) * BLOCK_BYTES;
        int8_t *odd = even + P * BLOCK_BYTES;
        for (int i = 0; i < BLOCK_BYTES; i++) {
            even[i] = src[2 * i];
            odd[i] = src[2 * i + 1];
        }
    }
}

static LM_ALWAYS_INLINE void row_out(const int8_t *xp, const float *dxb, const float *dxs, int NB, int NBp,
                                     const uint8_t *wr, const uint8_t *sr, float bias, int has_bias, void *y,
                                     long ldy, int x_bf16, long n, int m0, const int NM) {
    float acc[MAXM];
    const long off = (long)m0 * NBp;
    row_dot(xp + off * BLOCK, dxb + off, dxs + off, NB, NBp, wr, sr, acc, NM);
    for (int m = 0; m < NM; m++) {
        float s = acc[m];
        if (has_bias) s += bias;
        lm_store(y, x_bf16, (long)(m0 + m) * ldy + n, s);
    }
}

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] the blocks'
 * bytes (ldw >= K / 2), scales: [N, lds] e8m0 bytes (lds >= K / 32), bias: [N] in x's dtype or NULL, y: [M, N]
 * (row stride ldy) in x's dtype. K must be a multiple of 32. */
int lm_linear_mxfp4(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const uint8_t *scales,
                    long lds, const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    if (K % BLOCK) return 2;
    const int NB = K / BLOCK;
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (ldw < (long)NB * BLOCK_BYTES || lds < NB) return 2;
    const int NBp = (NB + CHUNK - 1) / CHUNK * CHUNK;
    int8_t *xq = aligned_alloc(64, (size_t)M * G * LM_GROUP);
    int8_t *xp = aligned_alloc(64, (size_t)M * NBp * BLOCK);
    float *dxr = malloc(sizeof(float) * (size_t)M * G);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)M * G);
    float *dxb = aligned_alloc(64, sizeof(float) * (size_t)M * NBp);
    float *dxs = aligned_alloc(64, sizeof(float) * (size_t)M * NBp);
    if (!xq || !xp || !dxr || !xsum || !dxb || !dxs) {
        free(xq); free(xp); free(dxr); free(xsum); free(dxb); free(dxs);
        return 3;
    }
    lm_quantize_rows(x, ldx, x_bf16, M, K, G, xq, dxr, xsum);
    for (int m = 0; m < M; m++) {
        const int8_t *xr = xq + (long)m * G * LM_GROUP;
        lay_out_row(xr, NB, NBp, xp + (long)m * NBp * BLOCK);
        for (int b = 0; b < NBp; b++) {
            float d = 0.0f, corr = 0.0f;
            if (b < NB) {
                int32_t s = 0;
                for (int i = 0; i < BLOCK; i++) s += xr[(long)b * BLOCK + i];
                d = 0.5f * dxr[(long)m * G + b / 2];
                corr = -12.0f * d * (float)s; /* times the block's scale: the "- 12" */
            }
            dxb[(long)m * NBp + b] = d;
            dxs[(long)m * NBp + b] = corr;
        }
    }
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * ldw;
                const uint8_t *sr = scales + n * lds;
                const float b = bias ? lm_act(bias, x_bf16, n) : 0.0f;
                const int hb = bias != NULL;
                switch (nm) { /* one instance per row count: NM must be a constant (see row_dot) */
                case 1: row_out(xp, dxb, dxs, NB, NBp, wr, sr, b, hb, y, ldy, x_bf16, n, m0, 1); break;
#if MAXM > 2
                case 2: row_out(xp, dxb, dxs, NB, NBp, wr, sr, b, hb, y, ldy, x_bf16, n, m0, 2); break;
                case 3: row_out(xp, dxb, dxs, NB, NBp, wr, sr, b, hb, y, ldy, x_bf16, n, m0, 3); break;
                default: row_out(xp, dxb, dxs, NB, NBp, wr, sr, b, hb, y, ldy, x_bf16, n, m0, 4); break;
#else
                default: row_out(xp, dxb, dxs, NB, NBp, wr, sr, b, hb, y, ldy, x_bf16, n, m0, 2); break;
#endif
                }
            }
        }
    }
    free(xq); free(xp); free(dxr); free(xsum); free(dxb); free(dxs);
    return 0;
}
