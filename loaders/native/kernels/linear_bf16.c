/*
 * y = x @ W^T (+ bias) for bfloat16 x, W, bias and y, with float32 accumulation, for a few rows of x.
 *
 * Why: at decode time a linear layer multiplies one (or a handful of) activation rows by a weight matrix that is
 * read once per token, so its speed is the memory bandwidth it reaches. torch's bf16 path on CPU reaches about
 * half of it on this project's machines (measured, not diagnosed); reading W's rows in place reaches close to the
 * streaming rate. W is read where it lies, so a weight that is a view of a safetensors file mapping stays
 * zero-copy.
 *
 * Two instruction-set paths, one per build (loaders/native/kernel_build.py compiles this file once per path):
 * - AVX-512 (with AVX512-BF16): 32 bf16 pairs per pairwise dot-product instruction;
 * - AVX2 + FMA: a bf16 is the top half of a float32, so a 32-bit lane holding two bf16 values yields the odd one
 *   by masking the low half and the even one by shifting it up: two fused multiply-adds per 16 values, no
 *   conversion instruction.
 * - AMX (the "amx" build: AVX-512 plus AMX-BF16, Sapphire Rapids and later): see amx_linear below.
 * The rows of W are split among OpenMP threads (torch's runtime, torch's thread count).
 */
#include "common.h"

#define ROWS 4   /* rows of W per step: independent accumulator chains hide the FMA latency (lm_reduce4 takes 4) */

#if defined(__AVX512F__)
#define MAXM 4   /* rows of x per pass: 4 x ROWS accumulators + 4 weight vectors fit the 32 zmm registers */

/* One block of `nrows` (1..ROWS) rows of W against `nm` (1..MAXM) rows of x. `next` is the first row of the next
 * block (NULL for the last): its rows are asked for at the offset this block reads, one block ahead, so the weight
 * stream keeps enough misses in flight where the hardware prefetcher alone does not (small matrices). */
static inline void block(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                         uint16_t *y, long ldy, int n0, int nrows, int nm, int K, const uint16_t *next) {
    __m512 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    const uint16_t *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const int kfull = K & ~31;
    for (int k = 0; k < kfull; k += 32) {
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = lm_load_bh(wr[r] + k);
        if (next)
            for (int r = 0; r < ROWS; r++) _mm_prefetch((const char *)(next + (long)r * ldw + k), _MM_HINT_T1);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512bh xv = lm_load_bh(x + (long)m * ldx + k);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    if (kfull < K) {
        const __mmask32 tail = (__mmask32)((1ull << (K - kfull)) - 1ull);
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = lm_load_bh_tail(wr[r] + kfull, tail);
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            __m512bh xv = lm_load_bh_tail(x + (long)m * ldx + kfull, tail);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    for (int m = 0; m < nm; m++) {
        float s[ROWS];
        _mm_storeu_ps(s, lm_reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        for (int r = 0; r < nrows; r++) {
            const float v = bias ? s[r] + lm_bf16_to_f32(bias[n0 + r]) : s[r];
            y[(long)m * ldy + n0 + r] = lm_f32_to_bf16(v);
        }
    }
}

#else /* AVX2 + FMA */
#define MAXM 2   /* 2 x ROWS accumulators + even/odd halves of x and W fit the 16 ymm registers */

static inline void block(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                         uint16_t *y, long ldy, int n0, int nrows, int nm, int K, const uint16_t *next) {
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
        if (next && (k & 31) == 0)
            for (int r = 0; r < ROWS; r++) _mm_prefetch((const char *)(next + (long)r * ldw + k), _MM_HINT_T1);
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
    for (int m = 0; m < nm; m++) {
        float sums[ROWS];
        _mm_storeu_ps(sums, lm_reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        for (int r = 0; r < nrows; r++) {
            float s = sums[r];
            for (int k = kfull; k < K; k++) s += lm_bf16_to_f32(x[(long)m * ldx + k]) * lm_bf16_to_f32(wr[r][k]);
            if (bias) s += lm_bf16_to_f32(bias[n0 + r]);
            y[(long)m * ldy + n0 + r] = lm_f32_to_bf16(s);
        }
    }
}
#endif

/* Block `b` of rows [n_begin, N) of y with the vector kernel above (ROWS rows of W against every row of x). */
static inline void vector_block(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                                uint16_t *y, long ldy, int M, int n_begin, int N, int K, int b) {
    const int n0 = n_begin + b * ROWS;
    const int nrows = N - n0 < ROWS ? N - n0 : ROWS;
    const uint16_t *next = n0 + ROWS + ROWS <= N ? w + (long)(n0 + ROWS) * ldw : NULL;
    for (int m0 = 0; m0 < M; m0 += MAXM) {
        const int nm = M - m0 < MAXM ? M - m0 : MAXM;
        block(x + (long)m0 * ldx, ldx, w, ldw, bias, y + (long)m0 * ldy, ldy, n0, nrows, nm, K, next);
    }
}

/* Rows [n_begin, N) of y with the vector kernel above. */
static void vector_rows(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias, uint16_t *y,
                        long ldy, int M, int n_begin, int N, int K, int threads) {
    const int nblocks = (N - n_begin + ROWS - 1) / ROWS;
    if (nblocks <= 0) return;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nblocks; b++) vector_block(x, ldx, w, ldw, bias, y, ldy, M, n_begin, N, K, b);
}

#if defined(__AMX_BF16__)
/*
 * AMX: y^T = W x^T on the tile unit. One TDPBF16PS multiplies a 16 x 32 tile of W (16 rows of W, read in place with
 * W's row stride) by a 32 x 16 tile of x^T (x repacked once per call into the unit's pair layout: for each pair of
 * inputs k, k+1, the 16 rows' values side by side) into a 16 x 16 float32 tile of y^T. 16 rows of x per tile, so
 * a batch of 16 decode rows costs about what one row costs: the weight stream, not arithmetic, stays the limit.
 * Each output element is its own float32 sum over k in the same order whatever the other rows of x are, so a
 * row's result does not depend on its batch (and every batch size takes this path). Rows of W past the last
 * multiple of 16 take the vector kernel, for every batch size alike. Linux hands a thread the tile registers only
 * after the process asks for them (arch_prctl); if it refuses, every call takes the vector kernel.
 */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of W, and of x, per tile */
#define AMX_K 32    /* bf16 inputs per tile row (64 bytes) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_permission(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return state == 1;
}

/* Store C tile `t` (a compile-time constant in each case) and write its 16 x 16 block of y, bias added. */
#define AMX_STORE(t) _tile_stored(t, c, 64)
static void amx_write(const float *c, const uint16_t *bias, uint16_t *y, long ldy, int n0, int m0, int M) {
    for (int r = 0; r < AMX_ROWS; r++) {
        const float b = bias ? lm_bf16_to_f32(bias[n0 + r]) : 0.0f;
        for (int j = 0; j < AMX_ROWS && m0 + j < M; j++) y[(long)(m0 + j) * ldy + n0 + r] = lm_f32_to_bf16(c[r * 16 + j] + b);
    }
}

/* Rows [0, nfull) of y (nfull a multiple of 16), for M <= 32 rows of x: two 16-row blocks of W per step (C tiles
 * 0, 1 for x rows 0-15 and 2, 3 for rows 16-31; W in tiles 4, 5; x^T in 6, 7). */
static int amx_linear(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias, uint16_t *y,
                      long ldy, int M, int nfull, int K, int threads) {
    const int kpad = (K + AMX_K - 1) / AMX_K * AMX_K;
    const int mblocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    const size_t block_elems = (size_t)kpad * AMX_ROWS; /* one x^T block: kpad/2 rows of 16 pairs */
    uint16_t *xp = aligned_alloc(64, block_elems * 2 * (size_t)mblocks);
    if (!xp) return 3;
    memset(xp, 0, block_elems * 2 * (size_t)mblocks);
    for (int m = 0; m < M; m++) {
        uint16_t *b = xp + (size_t)(m / AMX_ROWS) * block_elems + (size_t)(m % AMX_ROWS) * 2;
        const uint16_t *xr = x + (long)m * ldx;
        for (int k = 0; k < K; k++) b[(size_t)(k / 2) * 32 + (k & 1)] = xr[k];
    }
    const int kfull = K / AMX_K * AMX_K;
    const int pairs = (nfull / AMX_ROWS + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.colsb[t] = 64;
            cfg.rows[t] = AMX_ROWS;
        }
        _tile_loadconfig(&cfg);
        float c[AMX_ROWS * 16] __attribute__((aligned(64)));
        uint16_t tail[2][AMX_ROWS * AMX_K] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++) {
            const int n0 = p * 2 * AMX_ROWS;
            const int two = n0 + AMX_ROWS < nfull;
            const uint16_t *w0 = w + (long)n0 * ldw, *w1 = w + (long)(n0 + AMX_ROWS) * ldw;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k = 0; k < kpad; k += AMX_K) {
                if (k < kfull) {
                    _tile_loadd(4, w0 + k, ldw * 2);
                    if (two) _tile_loadd(5, w1 + k, ldw * 2);
                } else { /* K's last partial tile: copied beside zeros, so nothing past a row's end is read */
                    memset(tail, 0, sizeof tail);
                    for (int r = 0; r < AMX_ROWS; r++) {
                        memcpy(tail[0] + r * AMX_K, w0 + (long)r * ldw + k, (size_t)(K - k) * 2);
                        if (two) memcpy(tail[1] + r * AMX_K, w1 + (long)r * ldw + k, (size_t)(K - k) * 2);
                    }
                    _tile_loadd(4, tail[0], AMX_K * 2);
                    if (two) _tile_loadd(5, tail[1], AMX_K * 2);
                }
                _tile_loadd(6, xp + (size_t)k * AMX_ROWS, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 5, 6);
                if (mblocks > 1) {
                    _tile_loadd(7, xp + block_elems + (size_t)k * AMX_ROWS, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            AMX_STORE(0);
            amx_write(c, bias, y, ldy, n0, 0, M);
            if (mblocks > 1) {
                AMX_STORE(2);
                amx_write(c, bias, y, ldy, n0, AMX_ROWS, M);
            }
            if (two) {
                AMX_STORE(1);
                amx_write(c, bias, y, ldy, n0 + AMX_ROWS, 0, M);
                if (mblocks > 1) {
                    AMX_STORE(3);
                    amx_write(c, bias, y, ldy, n0 + AMX_ROWS, AMX_ROWS, M);
                }
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}
#endif

/* Returns 0 on success. x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N]. */
int lm_linear_bf16(const uint16_t *x, long ldx, const uint16_t *w, long ldw, const uint16_t *bias,
                   uint16_t *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    int n_vector = 0; /* rows from here on take the vector kernel */
#if defined(__AMX_BF16__)
    if (M <= 2 * AMX_ROWS && amx_permission()) {
        n_vector = N / AMX_ROWS * AMX_ROWS;
        if (n_vector > 0) {
            const int rc = amx_linear(x, ldx, w, ldw, bias, y, ldy, M, n_vector, K, threads);
            if (rc != 0) return rc;
        }
    }
#endif
    vector_rows(x, ldx, w, ldw, bias, y, ldy, M, n_vector, N, K, threads);
    return 0;
}

/*
 * Several products that read the same x (a layer's q, k and v projections, or its gate and up projections):
 * y_i = x @ W_i^T (+ bias_i) for i < count, in one parallel loop over all their blocks, so the thread team forks
 * once for them and both threads stay busy to the end of the last one. Each y_i is bit for bit what
 * lm_linear_bf16 gives for W_i alone (same blocks, same sums). W_i: [ns[i], K] with row stride ldws[i]; biases[i]
 * may be NULL. Returns 0 on success.
 */
int lm_linear_bf16_multi(const uint16_t *x, long ldx, int count, const uint16_t *const *ws, const long *ldws,
                         const uint16_t *const *biases, uint16_t *const *ys, const long *ldys, const int *ns, int M,
                         int K, int threads) {
    if (count < 1 || count > LM_MULTI_MAX || M < 1 || K < 1 || threads < 1) return 1;
    for (int i = 0; i < count; i++)
        if (ns[i] < 1) return 1;
#if defined(__AMX_BF16__)
    for (int i = 0; i < count; i++) { /* the tile path has its own loop; one call per product keeps it */
        const int rc = lm_linear_bf16(x, ldx, ws[i], ldws[i], biases[i], ys[i], ldys[i], M, ns[i], K, threads);
        if (rc != 0) return rc;
    }
#else
    int first[LM_MULTI_MAX + 1]; /* first[i]: the index of product i's first block in the shared loop */
    first[0] = 0;
    for (int i = 0; i < count; i++) first[i + 1] = first[i] + (ns[i] + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < first[count]; g++) {
        int i = 0;
        while (g >= first[i + 1]) i++;
        vector_block(x, ldx, ws[i], ldws[i], biases[i], ys[i], ldys[i], M, 0, ns[i], K, g - first[i]);
    }
#endif
    return 0;
}
