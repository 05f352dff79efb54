/* The driver of viasd's low-bit products (lowbit.h): it quantizes the activations, hands blocks of tokens to the
 * format's tiles, tile by tile over the threads, and writes the outputs with their bias, in float32 or rounded to
 * bf16. Nothing here depends on the weights' format. */
#include <stdlib.h>

#include "lowbit.h"

/* 32 inputs of x from `at` as float32: bf16 values widened into `buffer` (exactly), float32 ones in place. */
static inline const float *group_floats(const void *x, int bf16, int64_t at, float *buffer) {
    if (!bf16)
        return (const float *)x + at;
    const uint16_t *v = (const uint16_t *)x + at;
    for (int i = 0; i < GROUP; i++) {
        const uint32_t bits = (uint32_t)v[i] << 16;
        memcpy(buffer + i, &bits, sizeof bits);
    }
    return buffer;
}

#ifdef LOWBIT_WIDE
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

/* y + bias, stored as float32 or rounded to the nearest bf16 (ties to even; NaN stays NaN), torch's rounding. */
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

/* A tile's TILE outputs of one token (fewer for the last, partial tile): `put` for each, in a loop the compiler
 * vectorizes. */
static inline void put_tile(void *out, int bf16, int64_t at, const float *y, const float *bias, int64_t column,
                            int64_t count) {
    for (int64_t i = 0; i < count; i++)
        put(out, bf16, at + i, y[i], bias, column + i);
}

int lowbit_linear(const lowbit_format *format, const void *weights, const void *x, int bf16, int64_t rows,
                  int64_t k, int64_t n, const float *bias, void *out, int threads) {
    const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
    const int64_t slots = (rows + TOKENS - 1) / TOKENS * TOKENS * groups; /* whole blocks of tokens, per group */
    int8_t *codes = malloc((size_t)(slots * GROUP));
    float *step = malloc((size_t)slots * sizeof(float));
    float *offset = malloc((size_t)slots * sizeof(float));
    float *half = malloc((size_t)(slots * 2) * sizeof(float));
    int32_t *total = malloc((size_t)slots * sizeof(int32_t));
    if (!codes || !step || !offset || !half || !total) {
        free(codes), free(step), free(offset), free(half), free(total);
        return VIASD_NO_MEMORY;
    }
    const activations a = {codes, step, offset, half, total, groups};
#pragma omp parallel num_threads(threads)
    {
        /* The activations first (every thread waits for all of them at the loop's end), then the tiles. */
#pragma omp for schedule(static)
        for (int64_t mg = 0; mg < rows * groups; mg++) {
            const int64_t m = mg / groups, g = mg % groups;
            const int64_t slot = (m / TOKENS * groups + g) * TOKENS + m % TOKENS; /* token m's group g */
            float buffer[GROUP];
            int32_t sums[2];
            const float s = quantize_group(group_floats(x, bf16, mg * GROUP, buffer), codes + slot * GROUP, sums);
            step[slot] = s;
            offset[slot] = (float)(sums[0] + sums[1]) * s;
            half[2 * slot] = (float)sums[0] * s;
            half[2 * slot + 1] = (float)sums[1] * s;
            total[slot] = sums[0] + sums[1];
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t column = t * TILE, count = n - column < TILE ? n - column : TILE;
            float y[TOKENS * TILE];
            for (int64_t m = 0; m < rows; m += TOKENS) {
                const int64_t block = rows - m < TOKENS ? rows - m : TOKENS;
                format->tile[block](weights, t, &a, m / TOKENS, y);
                for (int64_t r = 0; r < block; r++)
                    put_tile(out, bf16, (m + r) * n + column, y + r * TILE, bias, column, count);
            }
        }
    }
    free(codes), free(step), free(offset), free(half), free(total);
    return VIASD_OK;
}
