/*
 * Shared by every kernel source: bf16 <-> f32 conversion, and the int8 quantization of activation rows that the
 * quantized kernels (linear_q8.c, linear_q4.c) multiply against their weights.
 *
 * Each source is compiled once per instruction set (see loaders/cpu_kernels.py): with -mavx512... flags the
 * __AVX512F__ branch is taken, with -mavx2 -mfma -mf16c the AVX2 branch; both export the same symbols, so
 * Python binds one library per instruction set and the rest of the code never knows which it got.
 */
#ifndef LM_COMMON_H
#define LM_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Quantized kernels work on groups of this many inputs: one activation scale per group of each row, and, for
 * 4-bit weights, one weight scale per group of each output channel. 64 int8 values fill one zmm register. */
#define LM_GROUP 64

static inline float lm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does when it stores a float32 result as bfloat16. */
static inline uint16_t lm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float lm_act(const void *x, int bf16, long i) {
    return bf16 ? lm_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline void lm_store(void *y, int bf16, long i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = lm_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/*
 * Quantize M rows of x ([M, K], row stride ldx, float32 or bfloat16) to int8, symmetric, one scale per group of
 * LM_GROUP: xq [M, G*LM_GROUP] (zero-padded past K), dx [M, G] the scales, xsum [M, G] the sum of each group's
 * int8 values (the 4-bit kernel's zero-point correction needs it). Values lie in [-127, 127], never -128, so the
 * AVX2 sign trick (|x| times sign-adjusted w) cannot overflow its 16-bit pair sums.
 */
static inline void lm_quantize_rows(const void *x, long ldx, int bf16, int M, int K, int G, int8_t *xq, float *dx,
                             int32_t *xsum) {
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const int k0 = g * LM_GROUP;
            const int k1 = k0 + LM_GROUP < K ? k0 + LM_GROUP : K;
            float amax = 0.0f;
            for (int k = k0; k < k1; k++) {
                float a = fabsf(lm_act(x, bf16, (long)m * ldx + k));
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = xq + (long)m * G * LM_GROUP + k0;
            int32_t s = 0;
            for (int k = k0; k < k1; k++) {
                int v = (int)lrintf(lm_act(x, bf16, (long)m * ldx + k) * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                q[k - k0] = (int8_t)v;
                s += v;
            }
            for (int k = k1; k < k0 + LM_GROUP; k++) q[k - k0] = 0;
            dx[(long)m * G + g] = d;
            xsum[(long)m * G + g] = s;
        }
    }
}

#if defined(__AVX512F__)
#define LM_ISA "avx512"
#else
#define LM_ISA "avx2"
#endif

#endif
