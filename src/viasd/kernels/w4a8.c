/* int4 weights x int8 activations: the 4-bit format's tile (lowbit.h) and its product, w4a8_linear.
 *
 * Weights: groups of 32 inputs of one row, w ~ low + code * scale, codes 0..15, an fp16 scale and minimum per
 * group (a GGUF Q4_K block's numbers: its sub-block scales and minimums multiplied out). A single-token pass only
 * streams them from memory: 5 bits per weight, against 8 for int8 and 16 for bf16.
 * Layout, in tiles of 16 rows (lowbit.h), tile t:
 *   packed[t][o][4 * i + b] = code[16t + i][8o + b] | code[16t + i][8o + 4 + b] << 4     octet o, row i, b < 4
 *   scale[t][g][i], low[t][g][i]: fp16, row 16t + i, group g (rows past n are zero)
 * With a = round(x * 127 / max|x|) per token and group, step = max|x| / 127,
 *   y[m][n] = sum_g scale[n][g] * step_g * dot(code_g, a_g) + low[n][g] * step_g * sum(a_g),
 * the exact product of the dequantized weights and activations: the integer dot products of a group add up lane
 * by lane (one lane per row), then scale and minimum come in once per group, for 16 rows at once.
 */
#include "lowbit.h"

typedef struct w4a8_weights {
    const uint8_t *packed;
    const uint16_t *scale, *low;
    int64_t k;
} w4a8_weights;

#ifdef LOWBIT_WIDE
static inline __attribute__((always_inline)) void w4a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w4a8_weights *w = weights;
    const int64_t k = w->k, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *offset = a->offset + block * groups * TOKENS;
    const uint8_t *p = w->packed + t * (k / 8) * 64;
    const uint16_t *scale = w->scale + t * groups * TILE, *low = w->low + t * groups * TILE;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 sum[TOKENS];
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dots[TOKENS];
        for (int r = 0; r < R; r++)
            dots[r] = _mm512_setzero_si512();
        prefetch(p + 4 * g * 64, 4);
        for (int o = 0; o < 4; o++) {
            const __m512i v = _mm512_loadu_si512((const void *)(p + (4 * g + o) * 64));
            const __m512i first4 = _mm512_and_si512(v, nibble), next4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; r++) {
                const int8_t *x = codes + (g * TOKENS + r) * GROUP + 8 * o;
                dots[r] = _mm512_dpbusd_epi32(dots[r], first4, _mm512_set1_epi32(four(x)));
                dots[r] = _mm512_dpbusd_epi32(dots[r], next4, _mm512_set1_epi32(four(x + 4)));
            }
        }
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * TILE)));
        const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(low + g * TILE)));
        for (int r = 0; r < R; r++) {
            const int64_t at = g * TOKENS + r;
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(sc, _mm512_set1_ps(step[at])), sum[r]);
            sum[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(offset[at]), sum[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * TILE, sum[r]);
}
#else
/* AVX2: a tile as two halves of 8 rows (the second 32 bytes of each 64), one lane per row. */
static inline __attribute__((always_inline)) void w4a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w4a8_weights *w = weights;
    const int64_t k = w->k, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *offset = a->offset + block * groups * TOKENS;
    const uint8_t *p = w->packed + t * (k / 8) * 64;
    const uint16_t *scale = w->scale + t * groups * TILE, *low = w->low + t * groups * TILE;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 sum[TOKENS];
        for (int r = 0; r < R; r++)
            sum[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            /* A group's eight byte dot products add up in 16 bits (each is at most 2 * 15 * 128, eight of them
             * 30720), widened to 32 once per group: the same integers as widening each, at half the multiplies. */
            __m256i pairs[TOKENS];
            for (int r = 0; r < R; r++)
                pairs[r] = _mm256_setzero_si256();
            prefetch(p + 4 * g * 64, 4);
            for (int o = 0; o < 4; o++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (4 * g + o) * 64 + 32 * h));
                const __m256i first4 = _mm256_and_si256(v, nibble);
                const __m256i next4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = codes + (g * TOKENS + r) * GROUP + 8 * o;
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(first4, _mm256_set1_epi32(four(x))));
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(next4, _mm256_set1_epi32(four(x + 4))));
                }
            }
            const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g * TILE + 8 * h)));
            const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(low + g * TILE + 8 * h)));
            for (int r = 0; r < R; r++) {
                const int64_t at = g * TOKENS + r;
                const __m256i dots = _mm256_madd_epi16(pairs[r], ones);
                sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(sc, _mm256_set1_ps(step[at])), sum[r]);
                sum[r] = _mm256_fmadd_ps(lo, _mm256_set1_ps(offset[at]), sum[r]);
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + r * TILE + 8 * h, sum[r]);
    }
}
#endif

TILE_FUNCTIONS(w4a8_tile)

int w4a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scale,
                const uint16_t *low, int64_t n, const float *bias, void *out, int threads) {
    if (k % GROUP || n < 1)
        return VIASD_BAD_SHAPE;
    const w4a8_weights weights = {packed, scale, low, k};
    return lowbit_linear(&w4a8_tile_format, &weights, x, bf16, rows, k, n, bias, out, threads);
}
