/* A GGUF file's 6-bit (Q6_K) weights x int8 activations on x86 CPUs: y = x @ W^T for one Linear layer, in two
 * builds of this file, AVX-512 VNNI (LOWBIT_WIDE) and AVX2, like w4a8.c.
 *
 * Q4_K_M files keep their most sensitive tensors (the output head, half the value and down projections) as Q6_K:
 * per super-block of 256 inputs an fp16 scale d, per sub-block of 16 inputs an int8 scale s_j, and per weight a
 * 6-bit code q, with w = d * s_j * (q - 32). This kernel computes on exactly those numbers: 6.56 bits per weight
 * read from memory, where an int8 copy reads 8 and bf16 16, so a single-token pass stays bound by memory.
 *
 * Layout, per output row n (k a multiple of 256), codes split in a low nibble and a high pair of bits:
 *   low[n][c*32 + j] = (q[c*64 + j] & 15) | (q[c*64 + 32 + j] & 15) << 4      chunk c of 64 inputs, j < 32
 *   high[n][p*32 + t]: bits 0-1 q[c*64 + 32 + t] >> 4, bits 2-3 q[c'*64 + 32 + t] >> 4,
 *                      bits 4-5 q[c*64 + t] >> 4,      bits 6-7 q[c'*64 + t] >> 4     pair p: c = 2p, c' = 2p+1
 *   sub[n][b*16 + j] = s_j of super-block b (int8), d[n][b] = its d (fp16)
 * (`low` is w4a8's layout; the high bits of a pair of chunks sit where a few shifts of one load put them.)
 * Activations are quantized per row (token) and group of 32, as in w4a8.c: a = round(x * 127 / max|x|), step =
 * max|x| / 127. With F_j = d * s_j * step of sub-block j's group,
 *   y[m][n] = sum_j F_j * dot(q, a)_j - 32 * sum_j F_j * sum(a)_j
 * over the row's sub-blocks: integer dot products, scaled in float32. A row's result never depends on the other
 * rows of its block: R below is a constant at each call site, and each row goes through the same operations in
 * the same order whatever R is.
 */
#include <stdlib.h>

#include "lowbit.h"
#include "viasd_kernels.h"

#define GROUP VIASD_GROUP
#define CHUNK VIASD_CHUNK
#define SUPER VIASD_SUPER /* sixteen sub-blocks of 16, eight groups, four chunks, two pairs */
#define BLOCK 4   /* tokens per weight read */

/* d * s_j for the sixteen sub-blocks of one super-block, as two vectors of eight. */
static inline void sub_scales(const int8_t *sub, uint16_t d, __m256 *first, __m256 *second) {
    const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d));
    const __m128i s = _mm_loadu_si128((const __m128i *)sub);
    *first = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
    *second = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))));
}

#ifdef LOWBIT_WIDE
/* --- AVX-512 VNNI ------------------------------------------------------------------------------------------
 * A pair of chunks fills one 512-bit register: its 64 bytes of low nibbles hold [c's 0..31 | c''s 0..31] in the
 * low nibbles and [c's 32..63 | c''s 32..63] in the high ones; the row's activations are stored in that order. */

static inline int64_t pair_offset(int64_t c, int i) {
    return (c & ~(int64_t)1) * CHUNK + (i >= 32 ? 64 : 0) + (c & 1) * 32 + (i & 31);
}

static inline __attribute__((always_inline)) void rows_output(
    const uint8_t *low, const uint8_t *high, const int8_t *sub, const uint16_t *d, const int8_t *a,
    const float *step, const float *sum, int64_t k, const int R, float *out, int64_t n) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    /* Lane l of a pair's first/second register holds a dot product of sub-block FIRST[p][l/4] / SECOND[p][l/4]. */
    const __m512i first_lanes[2] = {
        _mm512_set_epi32(5, 5, 5, 5, 4, 4, 4, 4, 1, 1, 1, 1, 0, 0, 0, 0),
        _mm512_set_epi32(13, 13, 13, 13, 12, 12, 12, 12, 9, 9, 9, 9, 8, 8, 8, 8)};
    const __m512i second_lanes[2] = {
        _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 3, 3, 3, 3, 2, 2, 2, 2),
        _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 11, 11, 11, 11, 10, 10, 10, 10)};
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const int64_t supers = k / SUPER, groups = k / GROUP, subs = k / 16;
    __m512 acc[BLOCK], minimum[BLOCK];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        minimum[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < supers; b++) {
        __m256 lo, hi;
        sub_scales(sub + 16 * b, d[b], &lo, &hi);
        const __m512 ds = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
        __m512 factor[BLOCK];
        for (int r = 0; r < R; r++) {
            const __m512 steps = _mm512_castps256_ps512(_mm256_loadu_ps(step + r * groups + 8 * b));
            factor[r] = _mm512_mul_ps(ds, _mm512_permutexvar_ps(twice, steps));
            minimum[r] = _mm512_fmadd_ps(factor[r], _mm512_loadu_ps(sum + r * subs + 16 * b), minimum[r]);
        }
        for (int p = 0; p < 2; p++) {
            const int64_t c = 4 * b + 2 * p;
            const __m512i v = _mm512_loadu_si512((const void *)(low + c * 32));
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(high + c * 16)));
            /* bits 4-5 of h: c's 0..31, bits 6-7: c''s 0..31, bits 0-1: c's 32..63, bits 2-3: c''s 32..63 */
            const __m512i h_first = _mm512_mask_blend_epi64(0xF0, h, _mm512_srli_epi16(h, 2));
            const __m512i h_second = _mm512_mask_blend_epi64(0xF0, _mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2));
            /* 0xF8: a | (b & c) */
            const __m512i first = _mm512_ternarylogic_epi32(_mm512_and_si512(v, nibble), h_first, two, 0xF8);
            const __m512i second = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), h_second, two, 0xF8);
            for (int r = 0; r < R; r++) {
                const int8_t *x = a + r * k + c * CHUNK;
                const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)x));
                const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), second, _mm512_loadu_si512((const void *)(x + 64)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(first_lanes[p], factor[r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(second_lanes[p], factor[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        out[r * n] = sum16(acc[r]) - 32.0f * sum16(minimum[r]);
}
#else
/* --- AVX2 --------------------------------------------------------------------------------------------------
 * One chunk per 256-bit register: its low nibbles are inputs 0..31, its high ones 32..63, and a row's activations
 * are stored in plain order. */

static inline int64_t pair_offset(int64_t c, int i) {
    return c * CHUNK + i;
}

/* The int32 dot products of 32 codes (0..63) and 32 activations, four bytes per lane; a pair of products is at
 * most 2 * 63 * 127, which the 16-bit sums of maddubs hold. */
static inline __m256i dot32(__m256i codes, __m256i activations, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, activations), ones);
}

static inline __attribute__((always_inline)) void rows_output(
    const uint8_t *low, const uint8_t *high, const int8_t *sub, const uint16_t *d, const int8_t *a,
    const float *step, const float *sum, int64_t k, const int R, float *out, int64_t n) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    const __m256i lower = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), upper = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const int64_t supers = k / SUPER, groups = k / GROUP, subs = k / 16;
    __m256 acc[BLOCK], minimum[BLOCK];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        minimum[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < supers; b++) {
        __m256 ds[2];
        sub_scales(sub + 16 * b, d[b], &ds[0], &ds[1]);
        __m256 factor[BLOCK][2];
        for (int r = 0; r < R; r++) {
            const __m256 steps = _mm256_loadu_ps(step + r * groups + 8 * b);
            factor[r][0] = _mm256_mul_ps(ds[0], _mm256_permutevar8x32_ps(steps, lower));
            factor[r][1] = _mm256_mul_ps(ds[1], _mm256_permutevar8x32_ps(steps, upper));
            minimum[r] = _mm256_fmadd_ps(factor[r][0], _mm256_loadu_ps(sum + r * subs + 16 * b), minimum[r]);
            minimum[r] = _mm256_fmadd_ps(factor[r][1], _mm256_loadu_ps(sum + r * subs + 16 * b + 8), minimum[r]);
        }
        for (int i = 0; i < 4; i++) {
            const int64_t c = 4 * b + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(low + c * 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(high + (c & ~(int64_t)1) * 16));
            /* chunk 2p: bits 4-5 (inputs 0..31) and 0-1 (32..63); chunk 2p+1: bits 6-7 and 2-3 */
            const __m256i h_first = (i & 1) ? _mm256_srli_epi16(h, 2) : h;
            const __m256i h_second = (i & 1) ? _mm256_slli_epi16(h, 2) : _mm256_slli_epi16(h, 4);
            const __m256i first = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(h_first, two));
            const __m256i second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                                                   _mm256_and_si256(h_second, two));
            /* sub-blocks 4i, 4i+1 (first) and 4i+2, 4i+3 (second): lanes 4(i%2) .. 4(i%2)+3 of factor[r][i/2] */
            const int e = 4 * (i & 1);
            const __m256i pick_first = _mm256_setr_epi32(e, e, e, e, e + 1, e + 1, e + 1, e + 1);
            const __m256i pick_second = _mm256_setr_epi32(e + 2, e + 2, e + 2, e + 2, e + 3, e + 3, e + 3, e + 3);
            for (int r = 0; r < R; r++) {
                const int8_t *x = a + r * k + c * CHUNK;
                const __m256i d0 = dot32(first, _mm256_loadu_si256((const __m256i *)x), ones);
                const __m256i d1 = dot32(second, _mm256_loadu_si256((const __m256i *)(x + 32)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_permutevar8x32_ps(factor[r][i / 2], pick_first), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_permutevar8x32_ps(factor[r][i / 2], pick_second), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        out[r * n] = sum8(acc[r]) - 32.0f * sum8(minimum[r]);
}
#endif

/* Chunk c of one row: its 64 int8 codes (where `pair_offset` puts them), each group's step, each sub-block's sum
 * of codes. */
static inline void quantize_chunk(const float *v, int64_t c, int8_t *q, float *step, float *sum) {
    for (int h = 0; h < 2; h++) {
        int32_t halves[2];
        step[h] = quantize_group(v + 32 * h, q + pair_offset(c, 32 * h), halves);
        sum[2 * h] = (float)halves[0];
        sum[2 * h + 1] = (float)halves[1];
    }
}

/* out[rows][n] = x[rows][k] @ W^T + bias (k a multiple of 256; bias may be NULL; x and out float32, or bf16 where
 * `bf16`); returns 0, or -1 when scratch memory could not be had. */
int w6a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *low, const uint8_t *high,
                const int8_t *sub, const uint16_t *d, int64_t n, const float *bias, void *out, int threads) {
    const int64_t groups = k / GROUP, subs = k / 16, chunks = k / CHUNK;
    int8_t *a = malloc((size_t)(rows * k));
    float *step = malloc((size_t)(rows * groups) * sizeof(float));
    float *sum = malloc((size_t)(rows * subs) * sizeof(float));
    if (!a || !step || !sum) {
        free(a), free(step), free(sum);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t mc = 0; mc < rows * chunks; mc++) {
            const int64_t m = mc / chunks, c = mc % chunks;
            float buffer[CHUNK];
            const float *v = chunk_floats(x, bf16, m * k + c * CHUNK, buffer);
            quantize_chunk(v, c, a + m * k, step + 2 * mc, sum + 4 * mc);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *lw = low + j * (k / 2), *hw = high + j * (k / 4);
            const int8_t *sw = sub + j * subs;
            const uint16_t *dw = d + j * (k / SUPER);
            float y[BLOCK] = {0};
            for (int64_t m = 0; m < rows; m += BLOCK) {
#define ROWS(R) rows_output(lw, hw, sw, dw, a + m * k, step + m * groups, sum + m * subs, k, R, y, 1)
                switch (rows - m < BLOCK ? rows - m : BLOCK) { /* R a constant in each case */
                case BLOCK: ROWS(BLOCK); break;
                case 3: ROWS(3); break;
                case 2: ROWS(2); break;
                case 1: ROWS(1); break;
                }
#undef ROWS
                for (int64_t r = 0; r < rows - m && r < BLOCK; r++)
                    put(out, bf16, (m + r) * n + j, y[r], bias, j);
            }
        }
    }
    free(a), free(step), free(sum);
    return 0;
}
