/* int4 weights x int8 activations on x86 CPUs with AVX-512 VNNI: y = x @ W^T for one Linear layer.
 *
 * A single-token pass only has to stream the weights from memory, so its speed is their size: 4.5 bits per
 * weight here (a 4-bit code, and an fp16 scale and minimum per group of 64), against 8 for int8 and 16 for
 * bf16. The arithmetic is the integer dot product VNNI does in one instruction (unsigned codes times signed
 * activations), so a pass stays bound by memory, not by unpacking.
 *
 * Weights, per output row n and group g of 64 inputs (w ~ low + code * scale):
 *   packed[n][g*32 + j] = code[g*64 + j] | code[g*64 + 32 + j] << 4, j < 32
 *   scale[n][g], low[n][g]: fp16
 * Activations are quantized per row (token) and group: a = round(x * 127 / max|x|), step = max|x| / 127, so
 *   y[m][n] = sum_g scale[n][g] * step_g * dot(code_g, a_g) + low[n][g] * step_g * sum(a_g),
 * the exact product of the dequantized weights and activations. A row's result never depends on the other
 * rows of the block (exact verification relies on that), and it depends on the activations only through their
 * codes, so the last-bit noise of attention computed in blocks of another size rarely reaches it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 64

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Per row and group: int8 codes of x, their step max|x|/127, and step * sum of the codes (the minimum term's). */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *a, float *step, float *sum) {
    const int64_t groups = k / GROUP;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + m * k + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                const float t = fabsf(v[i]);
                amax = t > amax ? t : amax;
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = a + m * k + g * GROUP;
            int total = 0;
            for (int i = 0; i < GROUP; i++) {
                q[i] = (int8_t)nearbyintf(v[i] * inv);
                total += q[i];
            }
            step[m * groups + g] = amax / 127.0f;
            sum[m * groups + g] = (float)total * (amax / 127.0f);
        }
    }
}

/* dot(code_g, a_g) for group g as 8 int32 lanes: the low nibbles take the group's first 32 activations. */
static inline __m256i group_dot(const uint8_t *w, const int8_t *a, __m256i nibble) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(v, nibble),
                                            _mm256_loadu_si256((const __m256i *)a));
    return _mm256_dpbusd_epi32(dot, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                               _mm256_loadu_si256((const __m256i *)(a + 32)));
}

/* One output of one row: sum_g scale_g * step_g * dot_g + low_g * sum_g. The factors scale_g * step_g are made
 * 8 groups at a time; two accumulators keep the adds of neighbouring groups independent. */
static float row_output(const uint8_t *w, const uint16_t *scale, const uint16_t *low, const int8_t *a,
                        const float *step, const float *sum, int64_t groups) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps(), minimum = _mm256_setzero_ps();
    float factor[8];
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
        _mm256_storeu_ps(factor, _mm256_mul_ps(sc, _mm256_loadu_ps(step + g)));
        const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(low + g)));
        minimum = _mm256_fmadd_ps(lo, _mm256_loadu_ps(sum + g), minimum);
        for (int i = 0; i < 8; i += 2) {
            const __m256i d0 = group_dot(w + (g + i) * 32, a + (g + i) * GROUP, nibble);
            const __m256i d1 = group_dot(w + (g + i + 1) * 32, a + (g + i + 1) * GROUP, nibble);
            even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(factor + i), even);
            odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(factor + i + 1), odd);
        }
    }
    float tail = 0.0f;
    for (; g < groups; g++) {
        const __m256i d = group_dot(w + g * 32, a + g * GROUP, nibble);
        even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(_cvtsh_ss(scale[g]) * step[g]), even);
        tail += _cvtsh_ss(low[g]) * sum[g];
    }
    return sum8(_mm256_add_ps(even, odd)) + sum8(minimum) + tail;
}

/* out[rows][n] = x[rows][k] @ W^T; returns 0, or -1 when scratch memory could not be had. */
int w4a8_linear(const float *x, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scale,
                const uint16_t *low, int64_t n, float *out, int threads) {
    const int64_t groups = k / GROUP;
    int8_t *a = malloc((size_t)(rows * k));
    float *step = malloc((size_t)(rows * groups) * sizeof(float));
    float *sum = malloc((size_t)(rows * groups) * sizeof(float));
    if (!a || !step || !sum) {
        free(a), free(step), free(sum);
        return -1;
    }
    quantize_rows(x, rows, k, a, step, sum);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        /* The output's row of weights stays in L1 across the block's tokens: memory is read once. */
        for (int64_t m = 0; m < rows; m++)
            out[m * n + j] = row_output(packed + j * (k / 2), scale + j * groups, low + j * groups, a + m * k,
                                        step + m * groups, sum + m * groups, groups);
    }
    free(a), free(step), free(sum);
    return 0;
}
