/* What viasd's low-bit CPU kernels (w4a8.c, w6a8.c) share: horizontal sums, and the quantization of a group of
 * 32 activations to int8, in an AVX-512 (LOWBIT_WIDE) and an AVX2 version that give the same codes.
 *
 * A group's codes are a = round(x * 127 / max|x|) (to nearest even, as the default rounding mode does), its step
 * max|x| / 127, and the sums of the codes of its two halves of 16 are kept for the terms that weights' offsets
 * add (a minimum times the sum of the codes it multiplies). Inputs and outputs are float32 or bf16 (a model's
 * activations as they come): bf16 inputs widen exactly, outputs are rounded to bf16 as torch rounds.
 */
#ifndef VIASD_LOWBIT_H
#define VIASD_LOWBIT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LOWBIT_WIDE 1
#endif

/* The 64 inputs of x from `at` as float32: bf16 values widened into `buffer` (exactly), float32 ones in place. */
static inline const float *chunk_floats(const void *x, int bf16, int64_t at, float *buffer) {
    if (!bf16)
        return (const float *)x + at;
    const uint16_t *v = (const uint16_t *)x + at;
    for (int i = 0; i < 64; i++) {
        const uint32_t bits = (uint32_t)v[i] << 16;
        memcpy(buffer + i, &bits, sizeof bits);
    }
    return buffer;
}

/* Output `index` = y (+ bias[column] where there is a bias), stored as float32 or rounded to the nearest bf16
 * (ties to even; NaN stays NaN), the rounding torch's conversion makes. */
static inline void put(void *out, int bf16, int64_t index, float y, const float *bias, int64_t column) {
    if (bias)
        y += bias[column];
    if (!bf16) {
        ((float *)out)[index] = y;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    ((uint16_t *)out)[index] =
        (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#ifdef LOWBIT_WIDE
static inline float sum16(__m512 v) {
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* 32 activations v as 32 int8 codes at q; returns the step; sums[0], sums[1]: the codes' sums over each half. */
static inline float quantize_group(const float *v, int8_t *q, int32_t sums[2]) {
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(c1));
    sums[0] = _mm512_reduce_add_epi32(c0);
    sums[1] = _mm512_reduce_add_epi32(c1);
    return amax / 127.0f;
}
#else
static inline int32_t sum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float quantize_group(const float *v, int8_t *q, int32_t sums[2]) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' per-lane interleave */
    __m256 x[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(x[i], magnitude));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float amax = _mm_cvtss_f32(t);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i code[4];
    for (int i = 0; i < 4; i++)
        code[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(words, order));
    sums[0] = sum8i(_mm256_add_epi32(code[0], code[1]));
    sums[1] = sum8i(_mm256_add_epi32(code[2], code[3]));
    return amax / 127.0f;
}
#endif

#endif
