/*
 * The element-wise steps of a Llama-family decoder layer at a decode step, around the linear and attention kernels:
 * residual add + RMSNorm, rotary embedding + the KV cache write, and SiLU(gate) * up.
 *
 * Why native: at a decode step these steps touch a few thousand numbers per row, yet run as a dozen torch operators
 * per layer (norms, rotate_half's slices and cat, the cache's index_put, the MLP's activation and product), each
 * paying torch's dispatch; on a 22-layer 1B Llama that was ~9 ms of a 40 ms int8 step. Here each is one call.
 *
 * Each step rounds as transformers' modules do in torch, so a bfloat16 result equals theirs up to the order of
 * one sum (RMSNorm's mean of squares) and the last bits of exp (SiLU): every product and sum that torch stores as
 * bfloat16 is rounded to bfloat16 here at the same point. A row's result depends on that row alone.
 *
 * Element types: float32 (bf16 = 0) or bfloat16 (bf16 = 1) throughout one call. Strides in elements.
 * Compiled once per instruction set like every kernel here; the loops are written so that -O3 vectorises them
 * for the path's width (no intrinsics needed: the work is small next to the weight reads around it).
 */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* x as torch holds it after storing into the dtype: bf16-rounded, or as is. */
static LM_ALWAYS_INLINE float lm_round(float x, int bf16) { return bf16 ? lm_bf16_to_f32(lm_f32_to_bf16(x)) : x; }

/* Largest row (features) the norm's float buffer takes. */
#define LM_NORM_MAX 32768

/*
 * For each of `rows` rows: if delta is given, h += delta (stored in h, rounded to the dtype: the residual add);
 * then out = weight * (h * rsqrt(mean(h^2) + eps)), the product inside rounded to the dtype before the weight
 * multiplies it (transformers' LlamaRMSNorm: float32 inside, cast back, then the weight).
 */
int lm_add_rms_norm(void *h, long ldh, const void *delta, long ldd, const void *weight, void *out, long ldo, int rows,
                    int n, float eps, int bf16) {
    if (rows < 1 || n < 1 || n > LM_NORM_MAX) return -1;
    float *row = (float *)malloc(sizeof(float) * (size_t)n);
    if (!row) return -3;
    for (int b = 0; b < rows; b++) {
        const long hb = (long)b * ldh, db = (long)b * ldd, ob = (long)b * ldo;
        for (int i = 0; i < n; i++) {
            float x = lm_act(h, bf16, hb + i);
            if (delta) {
                x = lm_round(x + lm_act(delta, bf16, db + i), bf16);
                lm_store(h, bf16, hb + i, x);
            }
            row[i] = x;
        }
        float part[16] = {0};
        int i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) part[j] += row[i + j] * row[i + j];
        float ss = 0.0f;
        for (int j = 0; j < 16; j++) ss += part[j];
        for (; i < n; i++) ss += row[i] * row[i];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int k = 0; k < n; k++)
            lm_store(out, bf16, ob + k, lm_act(weight, bf16, k) * lm_round(row[k] * r, bf16));
    }
    free(row);
    return 0;
}

/* One head of D values at x (rotated in place when dst is x): transformers' apply_rotary_pos_emb,
 * x * cos + rotate_half(x) * sin, with each product and the sum rounded to the dtype as torch stores them. */
static LM_ALWAYS_INLINE void rotate(const void *x, long xi, void *dst, long di, const void *cs, const void *sn,
                                    long ci, int D, int bf16, float *tmp) {
    const int half = D / 2;
    for (int i = 0; i < D; i++) tmp[i] = lm_act(x, bf16, xi + i);
    for (int i = 0; i < D; i++) {
        const float other = i < half ? -tmp[i + half] : tmp[i - half];
        const float a = lm_round(tmp[i] * lm_act(cs, bf16, ci + i), bf16);
        const float s = lm_round(other * lm_act(sn, bf16, ci + i), bf16);
        lm_store(dst, bf16, di + i, lm_round(a + s, bf16));
    }
}

/*
 * Rotary embedding and the cache write of one decode token per row. Row b is at position pos[b] of cache slot
 * slot[b]: its H query heads (q, row stride ldq, heads D apart) are rotated in place; its KV key heads (k) are
 * rotated into kcache[slot][head][pos] and its value heads (v) copied into vcache[slot][head][pos] (cache strides
 * cs0, cs1, cs2 for slot, head, position; both caches laid out alike). cos and sin hold one row of D values per
 * position (row stride ldc), in the dtype, as the model's rotary module makes them.
 */
int lm_rope_store(void *q, long ldq, const void *k, long ldk, const void *v, long ldv, const void *cos_t,
                  const void *sin_t, long ldc, const int64_t *pos, const int64_t *slot, void *kcache, void *vcache,
                  long cs0, long cs1, long cs2, int rows, int H, int KV, int D, int bf16) {
    if (rows < 1 || H < 1 || KV < 1 || D < 2 || D % 2 || D > 1024) return -1;
    float tmp[1024];
    const size_t es = bf16 ? 2 : 4;
    for (int b = 0; b < rows; b++) {
        const long ci = pos[b] * ldc;
        for (int hd = 0; hd < H; hd++) {
            const long qi = (long)b * ldq + (long)hd * D;
            rotate(q, qi, q, qi, cos_t, sin_t, ci, D, bf16, tmp);
        }
        for (int hd = 0; hd < KV; hd++) {
            const long at = slot[b] * cs0 + (long)hd * cs1 + pos[b] * cs2;
            rotate(k, (long)b * ldk + (long)hd * D, kcache, at, cos_t, sin_t, ci, D, bf16, tmp);
            memcpy((char *)vcache + (size_t)at * es, (const char *)v + (size_t)((long)b * ldv + (long)hd * D) * es,
                   (size_t)D * es);
        }
    }
    return 0;
}

/* Elements per chunk of the SiLU product; chunks are shared among threads. */
#define LM_ACT_CHUNK 1024

/*
 * out = silu(gate) * up for rows x n values (row strides ldg, ldu, ldo): transformers' LlamaMLP between its
 * projections, SiLU rounded to the dtype before the product, as torch stores it.
 */
int lm_silu_mul(const void *gate, long ldg, const void *up, long ldu, void *out, long ldo, int rows, int n, int bf16,
                int threads) {
    if (rows < 1 || n < 1) return -1;
    const int per_row = (n + LM_ACT_CHUNK - 1) / LM_ACT_CHUNK;
    const long chunks = (long)rows * per_row;
    if (threads < 1) threads = 1;
    if (chunks < 4 * threads) threads = 1; /* a single decode row's worth: forking costs more than it saves */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        const int b = (int)(c / per_row), i0 = (int)(c % per_row) * LM_ACT_CHUNK;
        const int i1 = i0 + LM_ACT_CHUNK < n ? i0 + LM_ACT_CHUNK : n;
        float buf[LM_ACT_CHUNK];
        for (int i = i0; i < i1; i++) {
            const float g = lm_act(gate, bf16, (long)b * ldg + i);
            const float x = g < -88.0f ? 88.0f : (g > 87.0f ? -87.0f : -g);
            buf[i - i0] = lm_round(g / (1.0f + lm_exp(x)), bf16);
        }
        for (int i = i0; i < i1; i++)
            lm_store(out, bf16, (long)b * ldo + i, lm_round(buf[i - i0] * lm_act(up, bf16, (long)b * ldu + i), bf16));
    }
    return 0;
}
