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
    VIASD_SIX_BIT = 6          /* w6a8.c: t0 low nibbles, t1 high bit pairs, t2 sub-block scales, t3 super-blocks' */
};

/* One low-bit product y[rows][n] = x[rows][k] @ W^T + bias of a `viasd_kind`; bias float32 or NULL. */
typedef struct viasd_linear {
    int64_t kind, k, n;
    const void *t0, *t1, *t2, *t3;
    const float *bias;
} viasd_linear;

/* One decoder layer of a Llama-style model for `fused_layers`: `inputs` products make the q|k|v columns (1: all
 * three fused; 3: q, k, v), `mlp_inputs` the gate|up ones (1 or 2); norms are RMSNorm weights [hidden] in bf16. */
typedef struct viasd_layer {
    const uint16_t *norm1, *norm2;
    float eps1, eps2;
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

/* bf16 weights x float32 activations, float32 out, for CPUs without bf16 matrix instructions (bf16.c). */
int bf16_linear(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, float *out, int threads);

/* A short pass's attention of one layer in bf16: rotary embedding, cache write, attention (attention.c). */
int short_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, uint16_t *key_store,
                    uint16_t *value_store, int64_t capacity, int64_t past, int64_t rows, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, uint16_t *out, int threads);

/* All decoder layers of a short pass of a bf16 model whose products are all low-bit ones, over the new tokens of one
 * or several sequences, each with its own cache (fused_layers.c). */
int fused_layers(uint16_t *x, int64_t rows, int64_t hidden, int64_t count, const viasd_layer *layers,
                 const uint16_t *cos, const uint16_t *sin, int64_t sequences, const int64_t *starts,
                 uint16_t *const *key_stores, uint16_t *const *value_stores, const int64_t *capacity,
                 const int64_t *past, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t inner,
                 int threads);

#endif
