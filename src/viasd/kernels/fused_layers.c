/* The decoder layers of a short pass (a decoding step, a verification block) of a Llama-style bf16 model whose
 * Linear layers are all viasd's low-bit ones, in one call: per layer RMSNorm, the q/k/v products, per-head q/k
 * norms where the model has them (Qwen3, Gemma 3), attention (rotary embedding, cache write, a sliding window where
 * the layer has one), the output product (normed again in Gemma 3) and residual, RMSNorm, the gate/up products,
 * SiLU or GELU (tanh) gating, the down product (normed again in Gemma 3) and residual.
 *
 * The products and the attention are viasd's own kernels (w4a8.c, w6a8.c, w8a8.c, attention.c, built into the same
 * library and each checked on its own at load); this file only strings them together with the few elementwise steps between them, so a pass costs one call instead of a dozen torch
 * operations and module calls per layer (some 4 ms of a 40 ms decoding step of the 1.5B target's 4-bit view).
 * Every step rounds to bf16 where torch's bf16 operations round (after the norm's scaling and its weight, or once
 * after both in Gemma's norm; after the activation, after the gating product, after each residual sum), so the
 * results are torch's to within its own last-bit noise (a sum of squares, an exponential), and each row (token) is
 * computed on its own: the same bits in any block.
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
    if (l->kind == VIASD_EIGHT_BIT)
        return w8a8_linear(x, 1, rows, l->k, l->t0, l->t1, l->t2, l->n, l->bias, out, threads);
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

/* 16 floats from p. */
static inline vf load_floats(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* RMSNorm of `rows` rows of `width` values (a multiple of LANES), row m at x + m * stride, into out (the same
 * layout; it may be x): in float32, x * rsqrt(mean(x^2) + eps), then times the weight, as transformers computes
 * it: Llama's (and Qwen's, Mistral's, Phi-3's) norm rounds to bf16 before the weight's product and after it;
 * Gemma's multiplies by its float32 (1 + weight) first and rounds once. */
static void rms_norm(const uint16_t *x, int64_t stride, const float *weight, float eps, int64_t kind, int64_t rows,
                     int64_t width, uint16_t *out) {
    for (int64_t m = 0; m < rows; m++) {
        const uint16_t *row = x + m * stride;
        vf squares = splat(0.0f);
        for (int64_t i = 0; i < width; i += LANES) {
            const vf v = load(row + i);
            squares += v * v;
        }
        const vf inverse = splat(1.0f / sqrtf(total(squares) / (float)width + eps));
        uint16_t normed[LANES];
        for (int64_t i = 0; i < width; i += LANES) {
            if (kind == VIASD_NORM_GEMMA) {
                store(out + m * stride + i, (load(row + i) * inverse) * load_floats(weight + i));
            } else {
                store(normed, load(row + i) * inverse);
                store(out + m * stride + i, load_floats(weight + i) * load(normed));
            }
        }
    }
}

/* Each head's `dim` values of the q and k columns of qkv [rows][q_width + 2 * kv_width] normed in place (Qwen3's and
 * Gemma 3's q_norm and k_norm, over the head dim). */
static void head_norms(const viasd_layer *l, uint16_t *qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t dim) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
    for (int64_t h = 0; h < heads; h++)
        rms_norm(qkv + h * dim, width, l->q_norm, l->eps_q, l->norm_kind, rows, dim, qkv + h * dim);
    for (int64_t h = 0; h < kv_heads; h++) {
        uint16_t *k = qkv + (heads + h) * dim;
        rms_norm(k, width, l->k_norm, l->eps_k, l->norm_kind, rows, dim, k);
    }
}

/* x += y, rounded to bf16 (count a multiple of LANES). */
static void add(uint16_t *x, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; i += LANES)
        store(x + i, load(x + i) + load(y + i));
}

/* tanh lane by lane, as 1 - 2 / (e^(2x) + 1): its absolute error is e^x's few units in the last place, which is
 * what GELU's 1 + tanh keeps (the clamp leaves e^(2x) finite, so the tails come out as exactly 1 and -1). */
static inline vf tanh_of(vf x) { return splat(1.0f) - splat(2.0f) / (exp_clamped(x + x) + splat(1.0f)); }

/* out = act(gate) * up, each rounded to bf16 (gate_up [rows][2 * inner]: gate columns, then up columns; inner a
 * multiple of LANES); act SiLU, x / (1 + e^-x), or GELU's tanh approximation,
 * x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), in torch's order of operations. */
static void gate(const uint16_t *gate_up, int64_t rows, int64_t inner, int64_t activation, uint16_t *out) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* beta: sqrt(2 / pi) */
    uint16_t activated[LANES];
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < inner; i += LANES) {
            const vf g = load(gate_up + m * 2 * inner + i);
            if (activation == VIASD_GELU_TANH) {
                const vf inner_term = splat(beta) * (g + splat(kappa) * (g * g * g));
                store(activated, splat(0.5f) * g * (splat(1.0f) + tanh_of(inner_term)));
            } else {
                store(activated, g / (splat(1.0f) + exp_clamped(-g)));
            }
            store(out + m * inner + i, load(activated) * load(gate_up + m * 2 * inner + inner + i));
        }
}

/* Runs `count` layers on x [rows][hidden] (bf16, updated in place), whose rows are the new tokens of `sequences`
 * sequences one after the other: sequence s has rows starts[s] .. starts[s + 1] - 1 and its own cache. Per sequence
 * s and layer i (index s * count + i): its cache stores [kv_heads][capacity][dim], positions 0 .. past - 1 filled
 * (the pass's go after them). The products and norms run over all rows together, attention per sequence over its
 * own cache: each row's result is the same as in a pass of its sequence alone. Layers marked `local` rotate by
 * local_cos and local_sin, the others by cos and sin ([rows][dim] each). Returns 0, -1 when memory could not be had,
 * another negative number when a kernel refused its shapes. */
int fused_layers(uint16_t *x, int64_t rows, int64_t hidden, int64_t count, const viasd_layer *layers,
                 const uint16_t *cos, const uint16_t *sin, const uint16_t *local_cos, const uint16_t *local_sin,
                 int64_t sequences, const int64_t *starts,
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
        const uint16_t *c = l->local ? local_cos : cos, *z = l->local ? local_sin : sin;
        rms_norm(x, hidden, l->norm1, l->eps1, l->norm_kind, rows, hidden, h);
        status = products(l->qkv, l->inputs, h, rows, wide, scratch, threads);
        if (status)
            break;
        if (l->q_norm)
            head_norms(l, wide, rows, heads, kv_heads, dim);
        for (int64_t s = 0; s < sequences && !status; s++) {
            const int64_t first = starts[s], n = starts[s + 1] - starts[s], at = s * count + i;
            const uint16_t *q = wide + first * qkv_width;
            status = short_attention(q, qkv_width, q + q_width, qkv_width, q + q_width + kv_width, qkv_width,
                                     c + first * dim, z + first * dim, key_stores[at], value_stores[at],
                                     capacity[at], past[at], n, heads, kv_heads, dim, scale, l->window,
                                     attended + first * q_width, threads);
        }
        if (status || (status = product(&l->o, attended, rows, h, threads)))
            break;
        if (l->post_attention)
            rms_norm(h, hidden, l->post_attention, l->eps_post_attention, l->norm_kind, rows, hidden, h);
        add(x, h, rows * hidden);
        rms_norm(x, hidden, l->norm2, l->eps2, l->norm_kind, rows, hidden, h);
        status = products(l->gate_up, l->mlp_inputs, h, rows, wide, scratch, threads);
        if (status)
            break;
        gate(wide, rows, inner, l->activation, attended);
        if ((status = product(&l->down, attended, rows, h, threads)))
            break;
        if (l->post_mlp)
            rms_norm(h, hidden, l->post_mlp, l->eps_post_mlp, l->norm_kind, rows, hidden, h);
        add(x, h, rows * hidden);
    }
    free(h), free(wide), free(scratch), free(attended);
    return status;
}
