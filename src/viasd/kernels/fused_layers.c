/* The decoder layers of a short pass (a decoding step, a verification block) of a Llama-style bf16 model whose
 * Linear layers are all viasd's low-bit ones, in one call: per layer RMSNorm, the q/k/v products, attention
 * (rotary embedding and cache write included), the output product and residual, RMSNorm, the gate/up products,
 * SiLU gating, the down product and residual.
 *
 * The products and the attention are viasd's own kernels (w4a8.c, w6a8.c, attention.c, built into the same
 * library and each checked on its own at load); this file only strings them together with the few elementwise steps between them, so a pass costs one call instead of a dozen torch
 * operations and module calls per layer (some 4 ms of a 40 ms decoding step of the 1.5B target's 4-bit view).
 * Every step rounds to bf16 where torch's bf16 operations round (after the norm's scaling and its weight, after
 * SiLU, after the gating product, after each residual sum), so the results are torch's to within its own
 * last-bit noise (a sum of squares, an exponential), and each row (token) is computed on its own: the same bits
 * in any block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_vectors.h"
#include "viasd_kernels.h"

static int product(const viasd_linear *l, const uint16_t *x, int64_t rows, uint16_t *out, int threads) {
    if (l->kind == VIASD_FOUR_BIT)
        return w4a8_linear(x, 1, rows, l->k, l->t0, l->t1, l->t2, l->n, l->bias, out, threads);
    if (l->kind == VIASD_SIX_BIT)
        return w6a8_linear(x, 1, rows, l->k, l->t0, l->t1, l->t2, l->t3, l->n, l->bias, out, threads);
    return VIASD_BAD_SHAPE;
}

/* Products of the same input side by side: out[rows][sum of n], through `scratch` when there are several. */
static int products(const viasd_linear *ls, int64_t count, const uint16_t *x, int64_t rows, uint16_t *out,
                    uint16_t *scratch, int threads) {
    if (count == 1)
        return product(ls, x, rows, out, threads);
    int64_t width = 0, at = 0;
    for (int64_t i = 0; i < count; i++)
        width += ls[i].n;
    for (int64_t i = 0; i < count; i++) {
        const int status = product(ls + i, x, rows, scratch, threads);
        if (status)
            return status;
        for (int64_t m = 0; m < rows; m++)
            memcpy(out + m * width + at, scratch + m * ls[i].n, (size_t)ls[i].n * sizeof(uint16_t));
        at += ls[i].n;
    }
    return VIASD_OK;
}

/* RMSNorm as transformers' Llama and Qwen2 compute it: in float32, x * rsqrt(mean(x^2) + eps) rounded to bf16,
 * then times the weight, rounded again (hidden a multiple of LANES). */
static void rms_norm(const uint16_t *x, const uint16_t *weight, float eps, int64_t rows, int64_t hidden, uint16_t *out) {
    for (int64_t m = 0; m < rows; m++) {
        const uint16_t *row = x + m * hidden;
        vf squares = splat(0.0f);
        for (int64_t i = 0; i < hidden; i += LANES) {
            const vf v = load(row + i);
            squares += v * v;
        }
        const vf inverse = splat(1.0f / sqrtf(total(squares) / (float)hidden + eps));
        uint16_t normed[LANES];
        for (int64_t i = 0; i < hidden; i += LANES) {
            store(normed, load(row + i) * inverse);
            store(out + m * hidden + i, load(weight + i) * load(normed));
        }
    }
}

/* x += y, rounded to bf16 (count a multiple of LANES). */
static void add(uint16_t *x, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; i += LANES)
        store(x + i, load(x + i) + load(y + i));
}

/* out = silu(gate) * up, each rounded to bf16 (gate_up [rows][2 * inner]: gate columns, then up columns; inner a
 * multiple of LANES). */
static void gate(const uint16_t *gate_up, int64_t rows, int64_t inner, uint16_t *out) {
    uint16_t activated[LANES];
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < inner; i += LANES) {
            const vf g = load(gate_up + m * 2 * inner + i);
            store(activated, g / (splat(1.0f) + exp_clamped(-g)));
            store(out + m * inner + i, load(activated) * load(gate_up + m * 2 * inner + inner + i));
        }
}

/* Runs `count` layers on x [rows][hidden] (bf16, updated in place), whose rows are the new tokens of `sequences`
 * sequences one after the other: sequence s has rows starts[s] .. starts[s + 1] - 1 and its own cache. Per sequence
 * s and layer i (index s * count + i): its cache stores [kv_heads][capacity][dim], positions 0 .. past - 1 filled
 * (the pass's go after them). The products and norms run over all rows together, attention per sequence over its
 * own cache: each row's result is the same as in a pass of its sequence alone. Returns 0, -1 when memory could not
 * be had, another negative number when a kernel refused its shapes. */
int fused_layers(uint16_t *x, int64_t rows, int64_t hidden, int64_t count, const viasd_layer *layers,
                 const uint16_t *cos, const uint16_t *sin, int64_t sequences, const int64_t *starts,
                 uint16_t *const *key_stores, uint16_t *const *value_stores, const int64_t *capacity,
                 const int64_t *past, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t inner,
                 int threads) {
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    const int64_t widest = 2 * inner > qkv_width ? 2 * inner : qkv_width;
    uint16_t *h = malloc((size_t)(rows * hidden) * sizeof(uint16_t));
    uint16_t *wide = malloc((size_t)(rows * widest) * sizeof(uint16_t));    /* q|k|v, then gate|up */
    uint16_t *scratch = malloc((size_t)(rows * widest) * sizeof(uint16_t)); /* one product of several */
    uint16_t *attended = malloc((size_t)(rows * (q_width > inner ? q_width : inner)) * sizeof(uint16_t));
    int status = (!h || !wide || !scratch || !attended) ? VIASD_NO_MEMORY : VIASD_OK;
    for (int64_t i = 0; i < count && !status; i++) {
        const viasd_layer *l = layers + i;
        rms_norm(x, l->norm1, l->eps1, rows, hidden, h);
        status = products(l->qkv, l->inputs, h, rows, wide, scratch, threads);
        if (status)
            break;
        for (int64_t s = 0; s < sequences && !status; s++) {
            const int64_t first = starts[s], n = starts[s + 1] - starts[s], at = s * count + i;
            const uint16_t *q = wide + first * qkv_width;
            status = short_attention(q, qkv_width, q + q_width, qkv_width, q + q_width + kv_width, qkv_width,
                                     cos + first * dim, sin + first * dim, key_stores[at], value_stores[at],
                                     capacity[at], past[at], n, heads, kv_heads, dim, scale,
                                     attended + first * q_width, threads);
        }
        if (status || (status = product(&l->o, attended, rows, h, threads)))
            break;
        add(x, h, rows * hidden);
        rms_norm(x, l->norm2, l->eps2, rows, hidden, h);
        status = products(l->gate_up, l->mlp_inputs, h, rows, wide, scratch, threads);
        if (status)
            break;
        gate(wide, rows, inner, attended);
        if ((status = product(&l->down, attended, rows, h, threads)))
            break;
        add(x, h, rows * hidden);
    }
    free(h), free(wide), free(scratch), free(attended);
    return status;
}
