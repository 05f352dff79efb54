/* int4 weights x int8 activations on x86 CPUs with AVX-512 VNNI: y = x @ W^T for one Linear layer.
 *
 * A single-token pass only has to stream the weights from memory, so its speed is their size: 4.5 bits per
 * weight here (a 4-bit code, and an fp16 scale and minimum per group of 64), against 8 for int8 and 16 for
 * bf16. The arithmetic is the integer dot product VNNI does in one instruction (unsigned codes times signed
 * activations), 64 byte products per instruction, so a single token stays bound by memory. A block of tokens
 * (verification) unpacks each group's codes once for up to BLOCK tokens; there the dot products set the pace.
 *
 * Weights, per output row n and group g of 64 inputs (w ~ low + code * scale):
 *   packed[n][g*32 + j] = code[g*64 + j] | code[g*64 + 32 + j] << 4, j < 32
 *   scale[n][g], low[n][g]: fp16
 * Activations are quantized per row (token) and group: a = round(x * 127 / max|x|), step = max|x| / 127, so
 *   y[m][n] = sum_g scale[n][g] * step_g * dot(code_g, a_g) + low[n][g] * step_g * sum(a_g),
 * the exact product of the dequantized weights and activations. A row's result never depends on the other
 * rows of the block (exact verification relies on that), and it depends on the activations only through their
 * codes, so the last-bit noise of attention computed in blocks of another size rarely reaches it.
 *
 * Two neighbouring groups share one 512-bit register: 64 bytes of packed codes are group g's 32 then group
 * g+1's, so their low nibbles are [g's codes 0..31 | g+1's 0..31] and their high nibbles the codes 32..63.
 * The quantized activations of the whole 8-group blocks are stored in the same order (`pair_offset`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 64
#define BLOCK 4 /* tokens per weight read (R <= BLOCK); more spill registers and run slower */

/* Where code i of activation group g goes: in the whole 8-group blocks (g < paired), pairs of groups are laid
 * out as [g's 0..31 | g+1's 0..31 | g's 32..63 | g+1's 32..63] to meet the weights' nibbles; the rest in order. */
static inline int64_t pair_offset(int64_t g, int i, int64_t paired) {
    if (g >= paired) return g * GROUP + i;
    return (g & ~(int64_t)1) * GROUP + (i >= 32 ? 64 : 0) + (g & 1) * 32 + (i & 31);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Group g of one row: its 64 int8 codes (where `pair_offset` puts them), its step max|x|/127 and step * the sum
 * of its codes (the minimum term's). The product rounds to nearest even, as the default rounding mode does. */
static inline void quantize_group(const float *v, int64_t g, int64_t paired, int8_t *q, float *step, float *sum) {
    __m512 x[4], top = _mm512_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm512_loadu_ps(v + 16 * i);
        top = _mm512_max_ps(top, _mm512_abs_ps(x[i]));
    }
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv));
        total = _mm512_add_epi32(total, c);
        _mm_storeu_si128((__m128i *)(q + pair_offset(g, 16 * i, paired)), _mm512_cvtepi32_epi8(c));
    }
    *step = amax / 127.0f;
    *sum = (float)_mm512_reduce_add_epi32(total) * (amax / 127.0f);
}

/* One output for each of R rows (tokens): sum_g scale_g * step_g * dot_g + low_g * sum_g. Each row goes
 * through the same operations in the same order whatever R is (the factors scale_g * step_g made 8 groups at a
 * time, one accumulator holding even groups in its low half and odd ones in its high half, then the tail), so
 * its result does not depend on the block: R is a constant at each call site, and the loops over r unroll. */
static inline __attribute__((always_inline)) void rows_output(
    const uint8_t *w, const uint16_t *scale, const uint16_t *low, const int8_t *a, const float *step,
    const float *sum, int64_t k, int64_t groups, const int R, float *out, int64_t n) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t paired = groups / 8 * 8;
    __m512 acc[BLOCK];
    __m256 minimum[BLOCK];
    float tail[BLOCK];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        minimum[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    for (int64_t g = 0; g < paired; g += 8) {
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
        const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(low + g)));
        __m512 factor[BLOCK];
        for (int r = 0; r < R; r++) {
            factor[r] = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(step + r * groups + g)));
            minimum[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(sum + r * groups + g), minimum[r]);
        }
        for (int i = 0; i < 8; i += 2) {
            /* lanes 0..7 take group g+i's factor, lanes 8..15 group g+i+1's */
            const __m512i pick = _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1,
                                                  i, i, i, i, i, i, i, i);
            const __m512i v = _mm512_loadu_si512((const void *)(w + (g + i) * 32));
            const __m512i first = _mm512_and_si512(v, nibble), second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; r++) {
                const int8_t *x = a + r * k + (g + i) * GROUP;
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)x));
                d = _mm512_dpbusd_epi32(d, second, _mm512_loadu_si512((const void *)(x + 64)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pick, factor[r]), acc[r]);
            }
        }
    }
    const __m256i nibble8 = _mm512_castsi512_si256(nibble);
    for (int64_t g = paired; g < groups; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * 32));
        const __m256i first = _mm256_and_si256(v, nibble8), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble8);
        for (int r = 0; r < R; r++) {
            const int8_t *x = a + r * k + g * GROUP;
            __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), first, _mm256_loadu_si256((const __m256i *)x));
            d = _mm256_dpbusd_epi32(d, second, _mm256_loadu_si256((const __m256i *)(x + 32)));
            const __m512 f = _mm512_castps256_ps512(_mm256_set1_ps(_cvtsh_ss(scale[g]) * step[r * groups + g]));
            acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castsi256_si512(d)), f, acc[r], 0x00FF);
            tail[r] += _cvtsh_ss(low[g]) * sum[r * groups + g];
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
        out[r * n] = sum8(halves) + sum8(minimum[r]) + tail[r];
    }
}

/* out[rows][n] = x[rows][k] @ W^T; returns 0, or -1 when scratch memory could not be had. */
int w4a8_linear(const float *x, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scale,
                const uint16_t *low, int64_t n, float *out, int threads) {
    const int64_t groups = k / GROUP, paired = groups / 8 * 8;
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
        for (int64_t mg = 0; mg < rows * groups; mg++) {
            const int64_t m = mg / groups, g = mg % groups;
            quantize_group(x + m * k + g * GROUP, g, paired, a + m * k, step + mg, sum + mg);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            /* The output's row of weights is read from memory once for the whole block: BLOCK tokens at a time. */
            const uint8_t *w = packed + j * (k / 2);
            const uint16_t *sc = scale + j * groups, *lo = low + j * groups;
            int64_t m = 0;
#define ROWS(R) rows_output(w, sc, lo, a + m * k, step + m * groups, sum + m * groups, k, groups, R, out + m * n + j, n)
            for (; m + BLOCK <= rows; m += BLOCK)
                ROWS(BLOCK);
            switch (rows - m) { /* the rest of the block, with R a constant in each case */
            case 3: ROWS(3); break;
            case 2: ROWS(2); break;
            case 1: ROWS(1); break;
            }
#undef ROWS
        }
    }
    free(a), free(step), free(sum);
    return 0;
}
