/* What viasd's bf16 C kernels of short passes (short_attention.c, fused_layers.c) share: vectors of 16 floats in
 * GCC's vector extensions (one AVX-512 register in the wide build, two AVX2 ones in the other), bf16 loads and
 * torch's bf16 rounding, a fixed-order lane sum, and an exponential.
 */
#ifndef VIASD_BF16_VECTORS_H
#define VIASD_BF16_VECTORS_H

#include <stdint.h>
#include <string.h>

#include "viasd_kernels.h"

#define LANES VIASD_LANES

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

static inline float widen(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The nearest bf16 (ties to even; NaN stays NaN): torch's rounding. */
static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return widen(narrow(f)); }

/* 16 bf16 values from p, as floats (exactly). */
static inline vf load(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* 16 floats to p as the nearest bf16s (ties to even; NaN stays NaN). */
static inline void store(uint16_t *p, vf v) {
    const vu bits = (vu)v;
    const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const vu nan = (vu)((bits & 0x7FFFFFFFu) > 0x7F800000u);
    const vh h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vh);
    memcpy(p, &h, sizeof h);
}

static inline vf splat(float f) { return (vf){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

/* The sum of the lanes, as a tree (the same order every time). */
static inline float total(vf v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* e^x lane by lane, within a few units in the last place, for x clamped to [-87, 88]: below it gives about 1e-38
 * instead of a smaller number or 0 (which no softmax sum of at least 1 and no SiLU notices), above about 1.6e38
 * (SiLU's x / (1 + e^-x) of such an x is -0 either way). */
static inline vf exp_clamped(vf x) {
    const vf low = splat(-87.0f), high = splat(88.0f), magic = splat(12582912.0f); /* 1.5 * 2^23 rounds */
    x = pick(x < low, low, x);
    x = pick(x > high, high, x);
    const vf shifted = x * splat(1.44269504f) + magic;
    const vf n = shifted - magic;
    const vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f); /* x - n ln 2, in two parts */
    vf p = splat(1.98756912e-4f);
    p = p * r + splat(1.39819885e-3f);
    p = p * r + splat(8.33345205e-3f);
    p = p * r + splat(4.16657665e-2f);
    p = p * r + splat(1.66666657e-1f);
    p = p * r + splat(5.00000000e-1f);
    p = (p * r) * r + r + splat(1.0f);
    const vi power = (((vi)shifted - (vi)magic) + 127) << 23; /* 2^n */
    return p * (vf)power;
}

#endif
