/*
 * Weight quantization at load, in the layouts linear_q8.c and linear_q4.c read (loaders/native/quantization.py describes
 * them). The same arithmetic as cpu_quant.py's torch fallback, operation for operation (IEEE division, round to
 * nearest even, float16 scales rounded to nearest even but never below the exact one, no contracted multiply-adds: built with
 * -ffp-contract=off), so both give the same bytes; the tests compare them. Rows are split among OpenMP threads.
 *
 * Why native: torch spends several full passes and float32 temporaries per weight; a 1B model took minutes on a
 * busy 2-core machine, where this takes about a second.
 */
#include "common.h"

enum { LM_F32 = 0, LM_BF16 = 1, LM_F16 = 2 };

static inline float lm_weight(const void *w, int dtype, long i) {
    if (dtype == LM_BF16) return lm_bf16_to_f32(((const uint16_t *)w)[i]);
    if (dtype == LM_F16) return _cvtsh_ss(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

/* q: [N, ldq] int8 (ldq >= G*LM_GROUP; zero past K), scales: [N] float32. */
int lm_quantize_q8(const void *w, long ldw, int dtype, int N, int K, int8_t *q, long ldq, float *scales,
                   int threads) {
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (N < 1 || K < 1 || threads < 1 || ldq < (long)G * LM_GROUP) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const long row = (long)n * ldw;
        float amax = 0.0f;
        for (int k = 0; k < K; k++) {
            const float a = fabsf(lm_weight(w, dtype, row + k));
            amax = a > amax ? a : amax;
        }
        float s = amax / 127.0f;
        if (!(s > 0.0f)) s = 1.0f;
        int8_t *qr = q + (long)n * ldq;
        for (int k = 0; k < K; k++) {
            float v = nearbyintf(lm_weight(w, dtype, row + k) / s);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            qr[k] = (int8_t)v;
        }
        for (long k = K; k < ldq; k++) qr[k] = 0;
        scales[n] = s;
    }
    return 0;
}

/* packed: [N, ldp] bytes (ldp >= G*LM_GROUP/2), scales: [N, lds] float16 (lds >= G). */
int lm_quantize_q4(const void *w, long ldw, int dtype, int N, int K, uint8_t *packed, long ldp, uint16_t *scales,
                   long lds, int threads) {
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (N < 1 || K < 1 || threads < 1 || ldp < (long)G * (LM_GROUP / 2) || lds < G) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const long row = (long)n * ldw;
        for (int g = 0; g < G; g++) {
            float v[LM_GROUP];
            const int k0 = g * LM_GROUP;
            for (int i = 0; i < LM_GROUP; i++) v[i] = k0 + i < K ? lm_weight(w, dtype, row + k0 + i) : 0.0f;
            int best = 0;
            for (int i = 1; i < LM_GROUP; i++)
                if (fabsf(v[i]) > fabsf(v[best])) best = i;
            const float exact = v[best] / -8.0f;
            uint16_t d16 = _cvtss_sh(exact, 0);
            /* never shrink the scale by rounding: the opposite end, clamped at code 15, would land over a step away */
            if (fabsf(_cvtsh_ss(d16)) < fabsf(exact) && (d16 & 0x7FFF) < 0x7BFF) d16++;
            const float d = _cvtsh_ss(d16);
            const float inv = d != 0.0f ? 1.0f / d : 0.0f;
            uint8_t codes[LM_GROUP];
            for (int i = 0; i < LM_GROUP; i++) {
                const float t = v[i] * inv;
                float c = nearbyintf(t + 8.0f);
                c = c > 15.0f ? 15.0f : (c < 0.0f ? 0.0f : c);
                codes[i] = (uint8_t)c;
            }
            uint8_t *p = packed + (long)n * ldp + (long)g * (LM_GROUP / 2);
            for (int j = 0; j < LM_GROUP / 2; j++) p[j] = (uint8_t)(codes[j] | (codes[j + LM_GROUP / 2] << 4));
            scales[(long)n * lds + g] = d16;
        }
    }
    return 0;
}
