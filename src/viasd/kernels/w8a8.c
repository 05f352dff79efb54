/* int8 weights in groups of 32 x int8 activations: the 8-bit format's tile (lowbit.h) and its product, w8a8_linear.
 *
 * Weights: groups of 32 inputs of one row, w = scale * code + low, codes -128..127, a float32 scale and minimum
 * per group. A GGUF Q8_0 block is one such group as it is (its fp16 d as the scale, no minimum); a Q5_K
 * super-block is eight, its 5-bit codes widened to bytes and each group's scale d * sc and minimum -dmin * m
 * multiplied out in float32, where both products are exact (an fp16 times a 6-bit integer). Either way the
 * kernel computes on the file's own numbers, not on a rounding of them.
 * Layout, in tiles of 16 rows (lowbit.h), tile t:
 *   codes[t][o][4 * i + b] = code[16t + i][4o + b]       quad o of inputs, row i, b < 4 (int8)
 *   scale[t][g][i], low[t][g][i]: float32, row 16t + i, group g (rows past n are zero)
 * With a = round(x * 127 / max|x|) per token and group, step = max|x| / 127,
 *   y[m][n] = sum_g scale[n][g] * step_g * dot(code_g, a_g) + low[n][g] * step_g * sum(a_g).
 * The integer dot products are exact in both builds: AVX-512 VNNI multiplies unsigned by signed bytes, so it takes
 * code + 128 (the sign bit flipped) and subtracts 128 * sum(a_g) from each group's sum; AVX2 moves the codes'
 * signs onto the activations (|code| * sign(a, code)), whose pair sums, at most 2 * 128 * 127, fit 16 bits.
 */
#include "lowbit.h"

typedef struct w8a8_weights {
    const int8_t *codes;
    const float *scale, *low;
    int64_t k;
} w8a8_weights;

#ifdef LOWBIT_WIDE
static inline __attribute__((always_inline)) void w8a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w8a8_weights *w = weights;
    const int64_t k = w->k, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *offset = a->offset + block * groups * TOKENS;
    const int32_t *total = a->total + block * groups * TOKENS;
    const uint8_t *p = (const uint8_t *)w->codes + t * (k / 4) * 64;
    const float *scale = w->scale + t * groups * TILE, *low = w->low + t * groups * TILE;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 sum[TOKENS];
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dots[TOKENS];
        for (int r = 0; r < R; r++)
            dots[r] = _mm512_setzero_si512();
        prefetch(p + 8 * g * 64, 8);
        for (int o = 0; o < 8; o++) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + (8 * g + o) * 64)), flip);
            for (int r = 0; r < R; r++) {
                const int8_t *x = codes + (g * TOKENS + r) * GROUP + 4 * o;
                dots[r] = _mm512_dpbusd_epi32(dots[r], v, _mm512_set1_epi32(four(x)));
            }
        }
        const __m512 sc = _mm512_loadu_ps(scale + g * TILE), lo = _mm512_loadu_ps(low + g * TILE);
        for (int r = 0; r < R; r++) {
            const int64_t at = g * TOKENS + r;
            const __m512i exact = _mm512_sub_epi32(dots[r], _mm512_set1_epi32(128 * total[at]));
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sc, _mm512_set1_ps(step[at])), sum[r]);
            sum[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(offset[at]), sum[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * TILE, sum[r]);
}
#else
/* AVX2: a tile as two halves of 8 rows (the second 32 bytes of each 64), one lane per row. */
static inline __attribute__((always_inline)) void w8a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w8a8_weights *w = weights;
    const int64_t k = w->k, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *offset = a->offset + block * groups * TOKENS;
    const uint8_t *p = (const uint8_t *)w->codes + t * (k / 4) * 64;
    const float *scale = w->scale + t * groups * TILE, *low = w->low + t * groups * TILE;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 sum[TOKENS];
        for (int r = 0; r < R; r++)
            sum[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256i dots[TOKENS];
            for (int r = 0; r < R; r++)
                dots[r] = _mm256_setzero_si256();
            prefetch(p + 8 * g * 64, 8);
            for (int o = 0; o < 8; o++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + (8 * g + o) * 64 + 32 * h));
                const __m256i magnitude = _mm256_abs_epi8(v); /* -128 becomes 128, read unsigned */
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_set1_epi32(four(codes + (g * TOKENS + r) * GROUP + 4 * o));
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, v));
                    dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            const __m256 sc = _mm256_loadu_ps(scale + g * TILE + 8 * h), lo = _mm256_loadu_ps(low + g * TILE + 8 * h);
            for (int r = 0; r < R; r++) {
                const int64_t at = g * TOKENS + r;
                sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(sc, _mm256_set1_ps(step[at])), sum[r]);
                sum[r] = _mm256_fmadd_ps(lo, _mm256_set1_ps(offset[at]), sum[r]);
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + r * TILE + 8 * h, sum[r]);
    }
}
#endif

TILE_FUNCTIONS(w8a8_tile)

int w8a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const int8_t *codes, const float *scale,
                const float *low, int64_t n, const float *bias, void *out, int threads) {
    if (k % GROUP || n < 1)
        return VIASD_BAD_SHAPE;
    const w8a8_weights weights = {codes, scale, low, k};
    return lowbit_linear(&w8a8_tile_format, &weights, x, bf16, rows, k, n, bias, out, threads);
}
