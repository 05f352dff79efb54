/* A GGUF file's 6-bit (Q6_K) weights x int8 activations: the 6-bit format's tile (lowbit.h) and its product.
 *
 * Q4_K_M files keep their most sensitive tensors (the output head, half the value and down projections) as Q6_K:
 * per super-block of 256 inputs an fp16 scale d, per sub-block of 16 inputs an int8 scale s_j, and per weight a
 * 6-bit code q, with w = d * s_j * (q - 32). This format computes on exactly those numbers: 6.56 bits per weight
 * read from memory, where an int8 copy reads 8 and bf16 16.
 * Layout, in tiles of 16 rows (lowbit.h), tile t, row i (16t + i), codes split in a low nibble and a top pair of
 * bits:
 *   low[t][o][4i + b]  = (q[8o + b] & 15) | (q[8o + 4 + b] & 15) << 4          octet o, b < 4 (the 4-bit layout)
 *   high[t][s][4i + b] = q[16s + b] >> 4 | (q[16s + 4 + b] >> 4) << 2 | (q[16s + 8 + b] >> 4) << 4
 *                        | (q[16s + 12 + b] >> 4) << 6                            sub-block s of 16 inputs
 *   sub[t][s][i] = s_j (int8), d[t][s / 16][i] = d (fp16)
 * so that a few shifts of one 64-byte load put each octet's top bits beside its low nibbles. With the activations
 * quantized per token and group of 32 (lowbit.h) and F_s = d * s_s * step of sub-block s's group,
 *   y[m][n] = sum_s F_s * dot(q, a)_s - 32 * sum_s d * s_s * (step * sum(a)_s)
 * over the row's sub-blocks: integer dot products, scaled in float32 once per sub-block for 16 rows at once.
 */
#include "lowbit.h"

#define SUB VIASD_SUB
#define SUPER VIASD_SUPER

typedef struct w6a8_weights {
    const uint8_t *low, *high;
    const int8_t *sub;
    const uint16_t *d;
    int64_t k;
} w6a8_weights;

#ifdef LOWBIT_WIDE
static inline __attribute__((always_inline)) void w6a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w6a8_weights *w = weights;
    const int64_t k = w->k, subs = k / SUB, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *half = a->half + block * groups * TOKENS * 2;
    const uint8_t *low = w->low + t * (k / 8) * 64, *high = w->high + t * subs * 64;
    const int8_t *sub = w->sub + t * subs * TILE;
    const uint16_t *dd = w->d + t * (k / SUPER) * TILE;
    const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512 sum[TOKENS];
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_setzero_ps();
    __m512 d = _mm512_setzero_ps();
    for (int64_t s = 0; s < subs; s++) {
        if (s % (SUPER / SUB) == 0)
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dd + (s / (SUPER / SUB)) * TILE)));
        const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sub + s * TILE)))));
        prefetch(low + 2 * s * 64, 2);
        prefetch(high + s * 64, 1);
        const __m512i v0 = _mm512_loadu_si512((const void *)(low + 2 * s * 64));
        const __m512i v1 = _mm512_loadu_si512((const void *)(low + (2 * s + 1) * 64));
        const __m512i h = _mm512_loadu_si512((const void *)(high + s * 64));
        __m512i q[4];
        q[0] = _mm512_or_si512(_mm512_and_si512(v0, nibble), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
        q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble),
                                   _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
        q[2] = _mm512_or_si512(_mm512_and_si512(v1, nibble), _mm512_and_si512(h, top));
        q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble),
                                   _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
        for (int r = 0; r < R; r++) {
            const int8_t *x = codes + ((s / 2) * TOKENS + r) * GROUP + SUB * (s % 2);
            __m512i dots = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++)
                dots = _mm512_dpbusd_epi32(dots, q[c], _mm512_set1_epi32(four(x + 4 * c)));
            const int64_t at = (s / 2) * TOKENS + r;
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale, _mm512_set1_ps(step[at])), sum[r]);
            sum[r] = _mm512_fnmadd_ps(scale, _mm512_set1_ps(32.0f * half[2 * at + s % 2]), sum[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * TILE, sum[r]);
}
#else
static inline __attribute__((always_inline)) void w6a8_tile(const void *weights, int64_t t, const activations *a,
                                                            int64_t block, float *y, const int R) {
    const w6a8_weights *w = weights;
    const int64_t k = w->k, subs = k / SUB, groups = k / GROUP;
    const int8_t *codes = a->codes + block * groups * TOKENS * GROUP;
    const float *step = a->step + block * groups * TOKENS, *half = a->half + block * groups * TOKENS * 2;
    const uint8_t *low = w->low + t * (k / 8) * 64, *high = w->high + t * subs * 64;
    const int8_t *sub = w->sub + t * subs * TILE;
    const uint16_t *dd = w->d + t * (k / SUPER) * TILE;
    const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    for (int hf = 0; hf < 2; hf++) {
        __m256 sum[TOKENS];
        for (int r = 0; r < R; r++)
            sum[r] = _mm256_setzero_ps();
        __m256 d = _mm256_setzero_ps();
        for (int64_t s = 0; s < subs; s++) {
            if (s % (SUPER / SUB) == 0)
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + (s / (SUPER / SUB)) * TILE + 8 * hf)));
            const __m128i s8 = _mm_loadl_epi64((const __m128i *)(sub + s * TILE + 8 * hf));
            const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
            prefetch(low + 2 * s * 64, 2);
            prefetch(high + s * 64, 1);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(low + 2 * s * 64 + 32 * hf));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(low + (2 * s + 1) * 64 + 32 * hf));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(high + s * 64 + 32 * hf));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(v0, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
            q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
                                       _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
            q[2] = _mm256_or_si256(_mm256_and_si256(v1, nibble), _mm256_and_si256(h, top));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble),
                                       _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
            for (int r = 0; r < R; r++) {
                const int8_t *x = codes + ((s / 2) * TOKENS + r) * GROUP + SUB * (s % 2);
                /* Two byte dot products add up in 16 bits (each at most 2 * 63 * 128, two 32256), then widen. */
                const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], _mm256_set1_epi32(four(x))),
                                                     _mm256_maddubs_epi16(q[1], _mm256_set1_epi32(four(x + 4))));
                const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], _mm256_set1_epi32(four(x + 8))),
                                                     _mm256_maddubs_epi16(q[3], _mm256_set1_epi32(four(x + 12))));
                const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
                const int64_t at = (s / 2) * TOKENS + r;
                sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, _mm256_set1_ps(step[at])), sum[r]);
                sum[r] = _mm256_fnmadd_ps(scale, _mm256_set1_ps(32.0f * half[2 * at + s % 2]), sum[r]);
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + r * TILE + 8 * hf, sum[r]);
    }
}
#endif

TILE_FUNCTIONS(w6a8_tile)

int w6a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *low, const uint8_t *high,
                const int8_t *sub, const uint16_t *d, int64_t n, const float *bias, void *out, int threads) {
    if (k % SUPER || n < 1)
        return VIASD_BAD_SHAPE;
    const w6a8_weights weights = {low, high, sub, d, k};
    return lowbit_linear(&w6a8_tile_format, &weights, x, bf16, rows, k, n, bias, out, threads);
}
