/* bf16 weights x float32 activations on x86 CPUs with AVX2 and FMA: y = x @ W^T for one Linear layer.
 *
 * For CPUs without bf16 matrix instructions (no AVX-512 BF16, no AMX), where torch multiplies a block of
 * tokens with bf16 weights at about the cost of that many single-token products, so that verifying a block of
 * drafts costs as much as decoding it. Here each output row of weights is read from memory once for up to BLOCK
 * tokens and widened to float32 in registers (a bf16 is the top half of a float32), so a block of a few tokens
 * costs about what one does. Each token goes through the same operations in the same order whatever block it
 * is in (two accumulators per token, over the inputs in order, then the tail), so its result does not depend on
 * the block: plain decoding and block verification compute the same logits.
 */
#include <immintrin.h>
#include <stdint.h>

#include "viasd_kernels.h"

#define BLOCK 4

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __attribute__((always_inline)) void rows_output(const uint16_t *w, const float *x, int64_t k,
                                                               const int R, float *out, int64_t n) {
    __m256 acc[BLOCK][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t whole = k / 16 * 16;
    for (int64_t i = 0; i < whole; i += 16) {
        const __m256 w0 = widen(w + i), w1 = widen(w + i + 8);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float tail = 0.0f;
        for (int64_t i = whole; i < k; i++) {
            union { uint32_t u; float f; } v = {(uint32_t)w[i] << 16};
            tail += v.f * x[r * k + i];
        }
        out[r * n] = sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + tail;
    }
}

int bf16_linear(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *wj = w + j * k;
        int64_t m = 0;
#define ROWS(R) rows_output(wj, x + m * k, k, R, out + m * n + j, n)
        for (; m + BLOCK <= rows; m += BLOCK) ROWS(BLOCK);
        switch (rows - m) {
        case 3: ROWS(3); break;
        case 2: ROWS(2); break;
        case 1: ROWS(1); break;
        }
#undef ROWS
    }
    return VIASD_OK;
}
