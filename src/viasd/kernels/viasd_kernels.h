/* The C interface of viasd's kernels: every function Python calls, the structs it fills in, and the sizes both
 * sides use. The kernels' sources include it (so the compiler holds each definition to its declaration here), and
 * Python binds to it with cffi, which reads this file: it must stay declarations only (no macros but the include
 * guard, no inline code), as cffi's parser takes them. Sizes, status codes and product kinds are enum constants
 * so that Python reads them from here too (viasd.kernels.build: `sizes`, `statuses`, `kinds`).
 *
 * Conventions: activations and outputs are float32, or bf16 (uint16_t bits) where `bf16` is set; weights in the
 * layouts each format's Python module documents; functions return a `viasd_status`.
 */
#ifndef VIASD_KERNELS_H
#define VIASD_KERNELS_H

#include <stdint.h>

enum viasd_sizes {
    VIASD_GROUP = 32,          /* inputs per activation step (int8 codes), and per 4-bit weight scale and minimum */
    VIASD_SUB = 16,            /* inputs per int8 sub-block scale of 6-bit weights */
    VIASD_SUPER = 256,         /* inputs per fp16 super-block scale of 6-bit weights */
    VIASD_TILE = 16,           /* output rows per tile of the low-bit formats (lowbit.h) */
    VIASD_LANES = 16,          /* floats per vector of the bf16 kernels: head dims and hidden sizes are multiples */
    VIASD_MAX_HEAD_DIM = 256,  /* the attention kernel's largest head dim */
    VIASD_MAX_GROUP = 16       /* the attention kernel's most query heads per key/value head */
};

/* What every function returns. */
enum viasd_status {
    VIASD_OK = 0,
    VIASD_NO_MEMORY = -1,      /* scratch memory could not be had */
    VIASD_BAD_SHAPE = -2       /* shapes (or a product kind) the kernel does not take */
};

/* The kinds of low-bit product (`viasd_linear.kind`). */
enum viasd_kind {
    VIASD_FOUR_BIT = 4,        /* w4a8.c: t0 packed codes, t1 scales, t2 minimums */
    VIASD_SIX_BIT = 6,         /* w6a8.c: t0 low nibbles, t1 high bit pairs, t2 sub-block scales, t3 super-blocks' */
    VIASD_EIGHT_BIT = 8        /* w8a8.c: t0 int8 codes, t1 float32 scales, t2 float32 minimums */
};

/* How a decoder's RMSNorms round (`viasd_layer.norm_kind`): Llama's (Qwen2, Qwen3, Mistral, Phi-3) round the
 * normalized row to bf16 before the weight's product; Gemma's multiply by (1 + weight) in float32 and round once. */
enum viasd_norm {
    VIASD_NORM_LLAMA = 0,
    VIASD_NORM_GEMMA = 1
};

/* The gating activation of a decoder's MLP (`viasd_layer.activation`). */
enum viasd_activation {
    VIASD_SILU = 0,
    VIASD_GELU_TANH = 1        /* GELU's tanh approximation (Gemma's gelu_pytorch_tanh) */
};

/* One low-bit product y[rows][n] = x[rows][k] @ W^T + bias of a `viasd_kind`; bias float32 or NULL. */
typedef struct viasd_linear {
    int64_t kind, k, n;
    const void *t0, *t1, *t2, *t3;
    const float *bias;
} viasd_linear;

/* One decoder layer of a Llama-style model for `fused_layers`: `inputs` products make the q|k|v columns (1: all
 * three fused; 3: q, k, v), `mlp_inputs` the gate|up ones (1 or 2). Norms are RMSNorm weights in float32 as the
 * norm multiplies by them (Gemma's 1 + weight), rounding as `norm_kind` says: norm1 before attention, norm2 before
 * the MLP; post_attention and post_mlp (Gemma 3's, or NULL) on the attention's and the MLP's outputs before each
 * residual sum; q_norm and k_norm (Qwen3's and Gemma 3's, or NULL) on each head's query and key [dim], before the
 * rotary embedding. `window`: the positions a query sees (itself included) in a sliding-window layer, 0 for all;
 * `local`: the layer rotates by the second (local) table of cos and sin (Gemma 3's sliding layers). */
typedef struct viasd_layer {
    const float *norm1, *norm2, *post_attention, *post_mlp, *q_norm, *k_norm;
    float eps1, eps2, eps_post_attention, eps_post_mlp, eps_q, eps_k;
    int64_t norm_kind, activation, window, local;
    int64_t inputs, mlp_inputs;
    viasd_linear qkv[3], o, gate_up[2], down;
} viasd_layer;

/* int4 weights in groups of 32 (fp16 scale and minimum) x int8 activations per token and group (w4a8.c). */
int w4a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *packed, const uint16_t *scale,
                const uint16_t *low, int64_t n, const float *bias, void *out, int threads);

/* A GGUF file's 6-bit (Q6_K) weights x int8 activations per token and group (w6a8.c). */
int w6a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const uint8_t *low, const uint8_t *high,
                const int8_t *sub, const uint16_t *d, int64_t n, const float *bias, void *out, int threads);

/* int8 weights in groups of 32 (float32 scale and minimum) x int8 activations per token and group (w8a8.c). */
int w8a8_linear(const void *x, int bf16, int64_t rows, int64_t k, const int8_t *codes, const float *scale,
                const float *low, int64_t n, const float *bias, void *out, int threads);

/* A GGUF tensor's blocks [rows][bytes] in the tiles of the kernel that takes them, the same numbers rearranged
 * (repack.c): Q4_K as w4a8's (packed, scale, low), Q6_K as w6a8's (low, high, sub, d), Q8_0 and Q5_0 as w8a8's
 * (codes, scale, low). */
int q4k_repack(const uint8_t *blocks, int64_t rows, int64_t columns, uint8_t *packed, uint16_t *scale, uint16_t *low,
               int threads);
int q6k_repack(const uint8_t *blocks, int64_t rows, int64_t columns, uint8_t *low, uint8_t *high, int8_t *sub,
               uint16_t *d, int threads);
int q8_0_repack(const uint8_t *blocks, int64_t rows, int64_t columns, int8_t *codes, float *scale, float *low,
                int threads);
int q5_0_repack(const uint8_t *blocks, int64_t rows, int64_t columns, int8_t *codes, float *scale, float *low,
                int threads);

/* bf16 weights x float32 activations, float32 out, for CPUs without bf16 matrix instructions (bf16.c). */
int bf16_linear(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, float *out, int threads);

/* bf16 weights x bf16 activations, float32 out, on CPUs with AVX-512 BF16 (bf16_native.c); call it only where the
 * CPU reports avx512_bf16. Built by a compiler without AVX-512 BF16, it refuses every shape (VIASD_BAD_SHAPE). */
int bf16_native_linear(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, float *out,
                       int threads);

/* A short pass's attention of one layer in bf16: rotary embedding, cache write, attention over the causal prefix or,
 * where `window` > 0, over the last `window` positions up to each query's own (attention.c). */
int short_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, uint16_t *key_store,
                    uint16_t *value_store, int64_t capacity, int64_t past, int64_t rows, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, int64_t window, uint16_t *out, int threads);

/* All decoder layers of a short pass of a bf16 model whose products are all low-bit ones, over the new tokens of one
 * or several sequences, each with its own cache (fused_layers.c); local_cos and local_sin rotate the layers marked
 * `local`. */
int fused_layers(uint16_t *x, int64_t rows, int64_t hidden, int64_t count, const viasd_layer *layers,
                 const uint16_t *cos, const uint16_t *sin, const uint16_t *local_cos, const uint16_t *local_sin,
                 int64_t sequences, const int64_t *starts,
                 uint16_t *const *key_stores, uint16_t *const *value_stores, const int64_t *capacity,
                 const int64_t *past, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t inner,
                 int threads);

#endif
