/* The attention of a short pass (a decoding step, a verification block) of a bf16 model on x86 CPUs, in one call:
 * the rotary embedding of the pass's queries and keys, its keys and values written into the layer's cache store,
 * and every query attending its causal prefix, or in a sliding-window layer the last `window` positions of it.
 *
 * Torch spends some 100 us per layer on this at a few hundred tokens of context, most of it in the dozen small
 * operations around the attention product; here it is one call. The rotary embedding rounds to bf16 after each
 * product and after the sum, as torch's bf16 operations do, so the cache entries are the bits torch writes. The
 * attention itself is computed per query row in float32 (scores, softmax, weighted values) and rounded once: its
 * last bits differ from torch's kernel, which blocks the work otherwise, but a row's result depends only on its
 * query and the cache before it, never on the other rows of the pass, so a token verified in a block gets the
 * logits it gets when decoded alone.
 *
 * Written with GCC's vector extensions (bf16_vectors.h).
 *
 * Layout (elements, bf16): queries [rows][heads * dim] and keys, values [rows][kv_heads * dim], each with its own
 * row stride (they may be columns of one fused projection); cos, sin [rows][dim]; the stores
 * [kv_heads][capacity][dim], positions 0 .. past - 1 filled; out [rows][heads * dim]. Query head h reads key/value
 * head h / (heads / kv_heads), as transformers' repeat_kv does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_vectors.h"
#include "viasd_kernels.h"

#define MAX_DIM VIASD_MAX_HEAD_DIM /* head dims up to this, multiples of LANES */
#define MAX_GROUP VIASD_MAX_GROUP  /* query heads per key/value head */
#define TILE_HEADS 4  /* query heads x ... */
#define TILE_CHUNKS 4 /* ... chunks of LANES values whose weighted sums are made together (16 registers) */

/* y = x * cos + rotate_half(x) * sin for one head's dim values, rounded to bf16 after each operation as torch's
 * bf16 arithmetic rounds (rotate_half(x) = [-x2, x1] for x = [x1, x2]). */
static void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t dim, uint16_t *y) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < dim; d++) {
        const float turned = d < half ? -widen(x[d + half]) : widen(x[d - half]);
        y[d] = narrow(round_bf16(widen(x[d]) * widen(cos[d])) + round_bf16(turned * widen(sin[d])));
    }
}

/* The outputs of query row m for the `group` query heads of key/value head `kv` (heads kv * group ...): their
 * scores against keys 0 .. past + m, softmax, weighted sum of values. `scores` has room for group * (past + m + 1). */
static void attend_row(const uint16_t *q, const uint16_t *cos, const uint16_t *sin, const uint16_t *keys,
                       const uint16_t *values, int64_t visible, int64_t group, int64_t dim, float scale,
                       float *scores, uint16_t *out) {
    const int64_t chunks = dim / LANES;
    vf query[MAX_GROUP][MAX_DIM / LANES];
    for (int64_t g = 0; g < group; g++) {
        uint16_t turned[MAX_DIM];
        rotate(q + g * dim, cos, sin, dim, turned);
        for (int64_t c = 0; c < chunks; c++)
            query[g][c] = load(turned + c * LANES);
    }
    for (int64_t j = 0; j < visible; j++) {
        vf key[MAX_DIM / LANES];
        for (int64_t c = 0; c < chunks; c++)
            key[c] = load(keys + j * dim + c * LANES);
        for (int64_t g = 0; g < group; g++) {
            vf dot = query[g][0] * key[0];
            for (int64_t c = 1; c < chunks; c++)
                dot += query[g][c] * key[c];
            scores[g * visible + j] = total(dot) * scale;
        }
    }
    const int64_t whole = visible / LANES * LANES;
    float inverse[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) { /* scores -> e^(score - max), and 1 / their sum */
        float *s = scores + g * visible;
        float top = s[0];
        for (int64_t j = 1; j < visible; j++)
            top = s[j] > top ? s[j] : top;
        vf sum = splat(0.0f);
        for (int64_t j = 0; j < whole; j += LANES) {
            vf e;
            memcpy(&e, s + j, sizeof e);
            e = exp_clamped(e - splat(top));
            memcpy(s + j, &e, sizeof e);
            sum += e;
        }
        if (whole < visible) { /* the tail, padded with lanes that add 0 */
            vf e = splat(-100.0f), pad = splat(0.0f);
            memcpy(&e, s + whole, (size_t)(visible - whole) * sizeof(float));
            e = exp_clamped(e - splat(top));
            memcpy(&pad, &e, (size_t)(visible - whole) * sizeof(float));
            memcpy(s + whole, &pad, (size_t)(visible - whole) * sizeof(float));
            sum += pad;
        }
        inverse[g] = 1.0f / total(sum);
    }
    /* The weighted values, a tile of TILE_HEADS heads x TILE_CHUNKS chunks of the head dim at a time (their
     * accumulators stay in registers and each value chunk is widened once per tile); every output element sums
     * its terms over j in order, whatever the tiling. */
    for (int64_t g0 = 0; g0 < group; g0 += TILE_HEADS) {
        const int64_t heads_here = group - g0 < TILE_HEADS ? group - g0 : TILE_HEADS;
        for (int64_t c0 = 0; c0 < chunks; c0 += TILE_CHUNKS) {
            const int64_t chunks_here = chunks - c0 < TILE_CHUNKS ? chunks - c0 : TILE_CHUNKS;
            vf acc[TILE_HEADS][TILE_CHUNKS];
            for (int64_t g = 0; g < TILE_HEADS; g++)
                for (int64_t c = 0; c < TILE_CHUNKS; c++)
                    acc[g][c] = splat(0.0f);
            for (int64_t j = 0; j < visible; j++) {
                vf value[TILE_CHUNKS];
                for (int64_t c = 0; c < chunks_here; c++)
                    value[c] = load(values + j * dim + (c0 + c) * LANES);
                for (int64_t g = 0; g < heads_here; g++) {
                    const vf weight = splat(scores[(g0 + g) * visible + j]);
                    for (int64_t c = 0; c < chunks_here; c++)
                        acc[g][c] += weight * value[c];
                }
            }
            for (int64_t g = 0; g < heads_here; g++)
                for (int64_t c = 0; c < chunks_here; c++)
                    store(out + (g0 + g) * dim + (c0 + c) * LANES, acc[g][c] * splat(inverse[g0 + g]));
        }
    }
}

/* Returns 0, -1 when scratch memory could not be had, -2 for shapes the kernel does not take. */
int short_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, uint16_t *key_store,
                    uint16_t *value_store, int64_t capacity, int64_t past, int64_t rows, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, int64_t window, uint16_t *out, int threads) {
    const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
    if (rows < 1 || group < 1 || group > MAX_GROUP || group * kv_heads != heads || dim % LANES || dim > MAX_DIM ||
        past + rows > capacity || window < 0)
        return VIASD_BAD_SHAPE;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* The pass's keys (rotated) and values into the stores first: a query row reads those before it. */
#pragma omp for schedule(static)
        for (int64_t mh = 0; mh < rows * kv_heads; mh++) {
            const int64_t m = mh / kv_heads, h = mh % kv_heads;
            const int64_t at = (h * capacity + past + m) * dim;
            rotate(k + m * k_stride + h * dim, cos + m * dim, sin + m * dim, dim, key_store + at);
            memcpy(value_store + at, v + m * v_stride + h * dim, (size_t)dim * sizeof(uint16_t));
        }
        float *scores = malloc((size_t)(group * (past + rows)) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t hm = 0; hm < kv_heads * rows; hm++) {
            const int64_t h = hm / rows, m = hm % rows;
            /* The store holds consecutive positions: query m (index past + m) sees indices from `first` on. */
            const int64_t first = window > 0 && past + m + 1 > window ? past + m + 1 - window : 0;
            if (!scores)
                continue;
            attend_row(q + m * q_stride + h * group * dim, cos + m * dim, sin + m * dim,
                       key_store + (h * capacity + first) * dim, value_store + (h * capacity + first) * dim,
                       past + m + 1 - first, group, dim, scale, scores, out + m * heads * dim + h * group * dim);
        }
        free(scores);
    }
    return failed ? VIASD_NO_MEMORY : VIASD_OK;
}
