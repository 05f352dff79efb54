/* int4 weights x int8 activations on x86 CPUs: y = x @ W^T for one Linear layer, in two builds of this file:
 * AVX-512 VNNI (LOWBIT_WIDE, recent Xeons and AMD Zen 4) and AVX2 (nearly every x86 CPU since 2015).
 *
 * A single-token pass only has to stream the weights from memory, so its speed is their size: 5 bits per
 * weight here (a 4-bit code, and an fp16 scale and minimum per group of 32), against 8 for int8 and 16 for
 * bf16. The arithmetic is the integer dot product of unsigned codes and signed activations (VNNI: one
 * instruction for 64 byte products; AVX2: two, maddubs then madd, with the same int32 result, since a pair of
 * products is at most 2 * 15 * 127 and never saturates 16 bits), so a single token stays bound by memory. A
 * block of tokens (verification) unpacks each chunk's codes once for up to BLOCK tokens; there the dot
 * products set the pace.
 *
 * Weights, per output row n, in chunks of 64 inputs that hold two groups of 32 (w ~ low + code * scale):
 *   packed[n][c*32 + j] = code[c*64 + j] | code[c*64 + 32 + j] << 4, j < 32
 *   scale[n][g], low[n][g]: fp16, group g = inputs g*32 .. g*32+31
 * This is the layout of a GGUF Q4_K block's codes (a super-block of 256 is four such chunks, its eight
 * sub-block scales and minimums are our groups), so such a model's weights are taken over exactly.
 * Activations are quantized per row (token) and group: a = round(x * 127 / max|x|), step = max|x| / 127, so
 *   y[m][n] = sum_g scale[n][g] * step_g * dot(code_g, a_g) + low[n][g] * step_g * sum(a_g),
 * the exact product of the dequantized weights and activations. A row's result never depends on the other
 * rows of the block (exact verification relies on that), and it depends on the activations only through their
 * codes, so the last-bit noise of attention computed in blocks of another size rarely reaches it. The two
 * builds add the same terms in different orders, so their last bits may differ; each is the same whatever
 * the block.
 */
#include <stdlib.h>

#include "lowbit.h"
#include "viasd_kernels.h"

#define GROUP VIASD_GROUP
#define CHUNK VIASD_CHUNK
#define BLOCK 4  /* tokens per weight read (R <= BLOCK); more spill registers and run slower */

#ifdef LOWBIT_WIDE
/* --- AVX-512 VNNI ------------------------------------------------------------------------------------------
 * Two neighbouring chunks share one 512-bit register: 64 bytes of packed codes are chunk c's 32 then chunk
 * c+1's, so their low nibbles are groups [2c | 2c+2] and their high nibbles groups [2c+1 | 2c+3]. The quantized
 * activations of the whole 8-chunk blocks are stored in the same order (`pair_offset`).
 */
/* Where code i of activation chunk c goes: in the whole 8-chunk blocks (c < paired), pairs of chunks are laid
 * out as [c's 0..31 | c+1's 0..31 | c's 32..63 | c+1's 32..63] to meet the weights' nibbles; the rest in order. */
static inline int64_t pair_offset(int64_t c, int i, int64_t paired) {
    if (c >= paired) return c * CHUNK + i;
    return (c & ~(int64_t)1) * CHUNK + (i >= 32 ? 64 : 0) + (c & 1) * 32 + (i & 31);
}

/* One output for each of R rows (tokens): sum_g scale_g * step_g * dot_g + low_g * sum_g. Each row goes
 * through the same operations in the same order whatever R is (the factors scale_g * step_g made 16 groups at
 * a time, one accumulator taking every group's products lane by lane, then the tail), so its result does not
 * depend on the block: R is a constant at each call site, and the loops over r unroll. */
static inline __attribute__((always_inline)) void rows_output(
    const uint8_t *w, const uint16_t *scale, const uint16_t *low, const int8_t *a, const float *step,
    const float *sum, int64_t k, int64_t groups, const int R, float *out, int64_t n) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t chunks = groups / 2, paired = chunks / 8 * 8;
    __m512 acc[BLOCK], minimum[BLOCK];
    float tail[BLOCK];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        minimum[r] = _mm512_setzero_ps();
        tail[r] = 0.0f;
    }
    for (int64_t c = 0; c < paired; c += 8) {
        const int64_t g = 2 * c; /* 16 groups: g .. g+15 */
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g)));
        const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(low + g)));
        __m512 factor[BLOCK];
        for (int r = 0; r < R; r++) {
            factor[r] = _mm512_mul_ps(sc, _mm512_loadu_ps(step + r * groups + g));
            minimum[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(sum + r * groups + g), minimum[r]);
        }
        for (int i = 0; i < 8; i += 2) {
            /* low nibbles: lanes 0..7 group 2i, lanes 8..15 group 2i+2; high nibbles: 2i+1 and 2i+3 */
            const int e = 2 * i;
            const __m512i pick_low = _mm512_set_epi32(e + 2, e + 2, e + 2, e + 2, e + 2, e + 2, e + 2, e + 2,
                                                      e, e, e, e, e, e, e, e);
            const __m512i pick_high = _mm512_set_epi32(e + 3, e + 3, e + 3, e + 3, e + 3, e + 3, e + 3, e + 3,
                                                       e + 1, e + 1, e + 1, e + 1, e + 1, e + 1, e + 1, e + 1);
            const __m512i v = _mm512_loadu_si512((const void *)(w + (c + i) * 32));
            const __m512i first = _mm512_and_si512(v, nibble), second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; r++) {
                const int8_t *x = a + r * k + (c + i) * CHUNK;
                const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)x));
                const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), second, _mm512_loadu_si512((const void *)(x + 64)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(pick_low, factor[r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(pick_high, factor[r]), acc[r]);
            }
        }
    }
    const __m256i nibble8 = _mm512_castsi512_si256(nibble);
    for (int64_t c = paired; c < chunks; c++) {
        const int64_t g = 2 * c;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + c * 32));
        const __m256i first = _mm256_and_si256(v, nibble8), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble8);
        const float sc0 = _cvtsh_ss(scale[g]), sc1 = _cvtsh_ss(scale[g + 1]);
        for (int r = 0; r < R; r++) {
            const int8_t *x = a + r * k + c * CHUNK;
            const __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), first, _mm256_loadu_si256((const __m256i *)x));
            const __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), second, _mm256_loadu_si256((const __m256i *)(x + 32)));
            const __m512 f0 = _mm512_castps256_ps512(_mm256_set1_ps(sc0 * step[r * groups + g]));
            const __m512 f1 = _mm512_castps256_ps512(_mm256_set1_ps(sc1 * step[r * groups + g + 1]));
            acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castsi256_si512(d0)), f0, acc[r], 0x00FF);
            acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castsi256_si512(d1)), f1, acc[r], 0x00FF);
            tail[r] += _cvtsh_ss(low[g]) * sum[r * groups + g];
            tail[r] += _cvtsh_ss(low[g + 1]) * sum[r * groups + g + 1];
        }
    }
    for (int r = 0; r < R; r++)
        out[r * n] = sum16(acc[r]) + sum16(minimum[r]) + tail[r];
}
#else
/* --- AVX2 --------------------------------------------------------------------------------------------------
 * One chunk per 256-bit register: its 32 packed bytes hold group 2c in the low nibbles and group 2c+1 in the
 * high ones, and a row's quantized activations are stored in plain order, so chunk c's 64 codes are groups 2c
 * and 2c+1 one after the other. Sixteen registers are few: the minimum terms are summed in a loop of their own.
 */
#define W4A8_QUAD 4 /* chunks whose 8 groups' factors are made at once */

static inline int64_t pair_offset(int64_t c, int i, int64_t paired) {
    (void)paired;
    return c * CHUNK + i;
}

/* The int32 dot products of 32 codes (bytes 0..15 as unsigned) and 32 activations, four bytes per lane. */
static inline __m256i dot32(__m256i codes, __m256i activations, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, activations), ones);
}

/* One output for each of R rows: the same operations in the same order whatever R is (see the wide build). */
static inline __attribute__((always_inline)) void rows_output(
    const uint8_t *w, const uint16_t *scale, const uint16_t *low, const int8_t *a, const float *step,
    const float *sum, int64_t k, int64_t groups, const int R, float *out, int64_t n) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t chunks = groups / 2, quads = chunks / W4A8_QUAD * W4A8_QUAD;
    __m256 acc[BLOCK];
    float tail[BLOCK];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    for (int64_t c = 0; c < quads; c += W4A8_QUAD) {
        const int64_t g = 2 * c; /* 8 groups: g .. g+7 */
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
        __m256 factor[BLOCK];
        for (int r = 0; r < R; r++)
            factor[r] = _mm256_mul_ps(sc, _mm256_loadu_ps(step + r * groups + g));
        for (int i = 0; i < W4A8_QUAD; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (c + i) * 32));
            const __m256i first = _mm256_and_si256(v, nibble), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            const __m256i pick_low = _mm256_set1_epi32(2 * i), pick_high = _mm256_set1_epi32(2 * i + 1);
            for (int r = 0; r < R; r++) {
                const int8_t *x = a + r * k + (c + i) * CHUNK;
                const __m256i d0 = dot32(first, _mm256_loadu_si256((const __m256i *)x), ones);
                const __m256i d1 = dot32(second, _mm256_loadu_si256((const __m256i *)(x + 32)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_permutevar8x32_ps(factor[r], pick_low), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_permutevar8x32_ps(factor[r], pick_high), acc[r]);
            }
        }
    }
    for (int64_t c = quads; c < chunks; c++) {
        const int64_t g = 2 * c;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + c * 32));
        const __m256i first = _mm256_and_si256(v, nibble), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const float sc0 = _cvtsh_ss(scale[g]), sc1 = _cvtsh_ss(scale[g + 1]);
        for (int r = 0; r < R; r++) {
            const int8_t *x = a + r * k + c * CHUNK;
            const __m256i d0 = dot32(first, _mm256_loadu_si256((const __m256i *)x), ones);
            const __m256i d1 = dot32(second, _mm256_loadu_si256((const __m256i *)(x + 32)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(sc0 * step[r * groups + g]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(sc1 * step[r * groups + g + 1]), acc[r]);
        }
    }
    /* The minimum terms, low_g * step_g * sum(a_g), 8 groups at a time and then one by one. */
    const int64_t eights = groups / 8 * 8;
    for (int r = 0; r < R; r++) {
        __m256 minimum = _mm256_setzero_ps();
        for (int64_t g = 0; g < eights; g += 8) {
            const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(low + g)));
            minimum = _mm256_fmadd_ps(lo, _mm256_loadu_ps(sum + r * groups + g), minimum);
        }
        for (int64_t g = eights; g < groups; g++)
            tail[r] += _cvtsh_ss(low[g]) * sum[r * groups + g];
        out[r * n] = sum8(acc[r]) + sum8(minimum) + tail[r];
    }
}
#endif

/* Chunk c of one row: its 64 int8 codes (where `pair_offset` puts them), and for each of its two groups the
 * step max|x|/127 and step * the sum of its codes (the minimum term's). */
static inline void quantize_chunk(const float *v, int64_t c, int64_t paired, int8_t *q, float *step, float *sum) {
    for (int h = 0; h < 2; h++) {
        int32_t halves[2];
        step[h] = quantize_group(v + 32 * h, q + pair_offset(c, 32 * h, paired), halves);
        sum[h] = (float)(halves[0] + halves[1]) * step[h];
    }
}

/* out[rows][n] = x[rows][k] @ W^T + bias (k a multiple of 64; bias may be NULL; x and out float32, or bf16 where
 * `bf16`); returns 0, or -1 when scratch memory could not be had. */
int w4a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scale,
                const uint16_t *low, int64_t n, const float *bias, void *out, int threads) {
    const int64_t groups = k / GROUP, chunks = k / CHUNK, paired = chunks / 8 * 8;
    int8_t *a = malloc((size_t)(rows * k));
    float *step = malloc((size_t)(rows * groups) * sizeof(float));
    float *sum = malloc((size_t)(rows * groups) * sizeof(float));
    if (!a || !step || !sum) {
        free(a), free(step), free(sum);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        /* The activations first (every thread waits for all of them at the loop's end), then the outputs. */
#pragma omp for schedule(static)
        for (int64_t mc = 0; mc < rows * chunks; mc++) {
            const int64_t m = mc / chunks, c = mc % chunks;
            float buffer[CHUNK];
            const float *v = chunk_floats(x, bf16, m * k + c * CHUNK, buffer);
            quantize_chunk(v, c, paired, a + m * k, step + 2 * mc, sum + 2 * mc);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            /* The output's row of weights is read from memory once for the whole block: BLOCK tokens at a time. */
            const uint8_t *w = packed + j * (k / 2);
            const uint16_t *sc = scale + j * groups, *lo = low + j * groups;
            float y[BLOCK] = {0};
            for (int64_t m = 0; m < rows; m += BLOCK) {
#define ROWS(R) rows_output(w, sc, lo, a + m * k, step + m * groups, sum + m * groups, k, groups, R, y, 1)
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
