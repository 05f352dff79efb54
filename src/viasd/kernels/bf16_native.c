/* bf16 weights x bf16 activations on x86 CPUs with AVX-512 BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids):
 * y = x @ W^T in float32 for one Linear layer and a pass of a few tokens.
 *
 * torch multiplies a single token with bf16 weights at about half the rate these CPUs stream memory (17 of 30 GB/s
 * on a 2-core Zen 4), and a decoding step of a dense bf16 model is nothing but such products. Here each output row
 * of weights is read from memory once for up to BLOCK tokens, 32 weights per instruction (`vdpbf16ps`: pairs of
 * bf16 products, exact in float32, added in float32), so a single token's product runs at the rate memory gives
 * and a block of up to 8 costs about 1.2 single ones (bound by the products: 16 tokens cost about 2.3). Each
 * token goes through the same instructions in the same order whatever block it is in (one accumulator per row
 * over the inputs in steps of 32, a masked tail, one reduction), so its result does not depend on the block: plain
 * decoding and block verification compute the same logits.
 *
 * The function is compiled for AVX-512 BF16 whatever the library's build, and Python calls it only on a CPU that
 * reports the instructions (kernels/bf16_native.py); a compiler that cannot make them gets a stub that refuses every
 * shape, which the kernel's check at load notices.
 */
#include <immintrin.h>
#include <stdint.h>

#include "viasd_kernels.h"

#if defined(__clang__) ? (__clang_major__ >= 9) : (defined(__GNUC__) && __GNUC__ >= 10)
#define BF16_NATIVE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BLOCK 8 /* tokens per read of two weight rows: 16 accumulators of 32 registers */
#define STEP 32 /* bf16 inputs per instruction */
/* Bytes ahead of the inputs being read that each row asks for, into L2: a block of tokens reads its rows slower than
 * memory streams them, and the hardware's prefetcher alone left a block of 8 at torch's cost. Into L2, not L1: the
 * weights are read once, and 16 KB of them waiting in L1 pushed the block's inputs (24 KB for 8 tokens of 1,536)
 * out of it; into L1 a block of 4 cost 1.39x and a block of 8 1.29x what it costs into L2 (Zen 4, 28 layers). */
#define PREFETCH 8192

/* Output rows j .. j + J - 1 for R tokens: one accumulator per row and token, over the inputs in steps of 32 (the
 * last one masked), then one reduction. In blocks of more than two tokens two rows share each load of a token's
 * inputs (J = 2): a 512-bit load per product would bound a block at one product per cycle. */
BF16_NATIVE_TARGET static inline __attribute__((always_inline)) void rows_output(
    const uint16_t *w, const uint16_t *x, int64_t k, const int J, const int R, float *out, int64_t n) {
    __m512 acc[2][BLOCK];
    for (int j = 0; j < J; j++)
        for (int r = 0; r < R; r++)
            acc[j][r] = _mm512_setzero_ps();
    const int64_t whole = k / STEP * STEP;
    for (int64_t i = 0; i < k; i += STEP) {
        const __mmask32 mask = i < whole ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k - i)) - 1u);
        __m512bh wj[2];
        for (int j = 0; j < J; j++) {
            _mm_prefetch((const char *)(w + j * k + i) + PREFETCH, _MM_HINT_T1);
            wj[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)(w + j * k + i));
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xr = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)(x + r * k + i));
            for (int j = 0; j < J; j++)
                acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wj[j], xr);
        }
    }
    for (int j = 0; j < J; j++)
        for (int r = 0; r < R; r++)
            out[r * n + j] = _mm512_reduce_add_ps(acc[j][r]);
}

BF16_NATIVE_TARGET int bf16_native_linear(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n,
                                          float *out, int threads) {
    if (k < 1 || n < 1 || rows < 0)
        return VIASD_BAD_SHAPE;
    const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t j = 2 * p;
        const uint16_t *wj = w + j * k;
        int64_t m = 0;
#define ROWS(R)                                                                                                    \
    do {                                                                                                           \
        if (R <= 2) {                                                                                              \
            rows_output(wj, x + m * k, k, 1, R, out + m * n + j, n);                                               \
            if (j + 1 < n)                                                                                         \
                rows_output(wj + k, x + m * k, k, 1, R, out + m * n + j + 1, n);                                   \
        } else if (j + 1 < n)                                                                                      \
            rows_output(wj, x + m * k, k, 2, R, out + m * n + j, n);                                               \
        else                                                                                                       \
            rows_output(wj, x + m * k, k, 1, R, out + m * n + j, n);                                               \
    } while (0)
        for (; m + BLOCK <= rows; m += BLOCK)
            ROWS(BLOCK);
        switch (rows - m) {
        case 7: ROWS(7); break;
        case 6: ROWS(6); break;
        case 5: ROWS(5); break;
        case 4: ROWS(4); break;
        case 3: ROWS(3); break;
        case 2: ROWS(2); break;
        case 1: ROWS(1); break;
        }
#undef ROWS
    }
    return VIASD_OK;
}

#else
int bf16_native_linear(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, float *out,
                       int threads) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)out, (void)threads;
    return VIASD_BAD_SHAPE;
}
#endif
