/* What viasd's low-bit products share: the weight formats' tiles, the quantized activations they read, and the
 * driver that runs any format's tiles (lowbit.c). A format (w4a8.c, w6a8.c, w8a8.c) is only its tile: how it unpacks its
 * weights and multiplies them with a block of tokens; the driver does the rest (activation quantization, tiling,
 * threading, bias, float32 or bf16 output), once for every format.
 *
 * Tiles. Weights are stored in tiles of TILE = 16 output rows: within a tile, the codes of 8 consecutive inputs of
 * all 16 rows fill 64 bytes, one 32-bit lane per row (its low nibbles inputs i..i+3, its high nibbles i+4..i+7).
 * So one 512-bit register holds the weights of 16 rows, and one int8 dot-product instruction multiplies them with
 * four activations of one token broadcast to every lane: the 16 rows' partial sums accumulate lane by lane, and a
 * group's scale (a vector of the 16 rows' scales) is applied once per group of 32 inputs, for every token of the
 * block with the weights unpacked once. That is what makes a block of tokens cost about what one token costs: the
 * float work per token is one scaling per 16 rows x 32 inputs, not one per row and group.
 *
 * Activations are quantized per token and group of 32 inputs: codes a = round(x * 127 / max|x|) (ties to even),
 * the group's step max|x| / 127, and the step times the sum of the codes of each half (16 inputs) and of the whole
 * group, for the terms that the weights' offsets add (a minimum, or 6-bit's -32, times the sum of the codes it
 * multiplies). Inputs and outputs are float32 or bf16: bf16 inputs widen exactly, outputs are rounded to bf16 as
 * torch rounds.
 *
 * A token's result never depends on the other tokens of its block (exact verification relies on that): every
 * token goes through the same operations in the same order whatever the block's size R, which is a constant at
 * each of a tile's call sites (the tile functions are made for each R). Two builds: AVX-512 VNNI (LOWBIT_WIDE) and
 * AVX2, which add the same terms in the same order per lane, and may still differ from each other in a last bit
 * (an AVX2 tile is two halves of 8 rows).
 */
#ifndef VIASD_LOWBIT_H
#define VIASD_LOWBIT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "viasd_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LOWBIT_WIDE 1
#define TOKENS 8 /* tokens per tile call: 8 accumulators and 8 sums of 16 rows fit the 32 vector registers */
#else
#define TOKENS 4 /* AVX2: 16 registers of 8 lanes */
#endif

#define TILE VIASD_TILE
#define GROUP VIASD_GROUP

/* The quantized activations, as the driver lays them out for the tiles: in blocks of TOKENS tokens, and within a
 * block group by group, the block's tokens side by side, so that a tile finds token r of any group at a constant
 * offset from one pointer (a tile of 8 tokens would otherwise spend its registers on 8 of them). */
typedef struct activations {
    const int8_t *codes;   /* [blocks][groups][TOKENS][32] */
    const float *step;     /* [blocks][groups][TOKENS]: each group's step */
    const float *offset;   /* [blocks][groups][TOKENS]: step * the sum of the group's codes */
    const float *half;     /* [blocks][groups][TOKENS][2]: step * the sum of each half's codes */
    const int32_t *total;  /* [blocks][groups][TOKENS]: the sum of the group's codes, as an integer */
    int64_t groups;
} activations;

/* One tile (16 output rows) for the first R tokens of block `block`: y[r][i] = the dot product of row
 * 16 * tile + i with token TOKENS * block + r, without bias. */
typedef void (*tile_fn)(const void *weights, int64_t tile, const activations *a, int64_t block, float *y);

/* A weight format: its tile function for each R = 1 .. TOKENS (index R). */
typedef struct lowbit_format {
    tile_fn tile[TOKENS + 1];
} lowbit_format;

/* out[rows][n] = x[rows][k] @ W^T + bias in `format` (weights: its own struct); 0, or -1 without memory. */
int lowbit_linear(const lowbit_format *format, const void *weights, const void *x, int bf16, int64_t rows,
                  int64_t k, int64_t n, const float *bias, void *out, int threads);

/* `TILE_FUNCTIONS(name)` makes name_1 .. name_TOKENS from `name(weights, tile, a, first, y, R)` (always inline)
 * and the format struct `name_format` that lists them. */
#define TILE_FUNCTION(name, R)                                                                                     \
    static void name##_##R(const void *w, int64_t t, const activations *a, int64_t block, float *y) {              \
        name(w, t, a, block, y, R);                                                                                \
    }
#ifdef LOWBIT_WIDE
#define TILE_FUNCTIONS(name)                                                                                       \
    TILE_FUNCTION(name, 1) TILE_FUNCTION(name, 2) TILE_FUNCTION(name, 3) TILE_FUNCTION(name, 4)                    \
    TILE_FUNCTION(name, 5) TILE_FUNCTION(name, 6) TILE_FUNCTION(name, 7) TILE_FUNCTION(name, 8)                    \
    static const lowbit_format name##_format = {                                                                   \
        {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}};
#else
#define TILE_FUNCTIONS(name)                                                                                       \
    TILE_FUNCTION(name, 1) TILE_FUNCTION(name, 2) TILE_FUNCTION(name, 3) TILE_FUNCTION(name, 4)                    \
    static const lowbit_format name##_format = {{0, name##_1, name##_2, name##_3, name##_4}};
#endif

/* Ask for the `lines` cache lines PREFETCH bytes past `at`: a tile streams its weights, and the hardware's own
 * prefetcher alone left a single token's product at about two thirds of the rate the machine streams memory. */
#define PREFETCH 4096
static inline __attribute__((always_inline)) void prefetch(const uint8_t *at, int lines) {
    for (int i = 0; i < lines; i++)
        __builtin_prefetch(at + PREFETCH + 64 * i, 0, 3);
}

/* Four activation codes of a token as one 32-bit value, to broadcast to every lane. */
static inline int32_t four(const int8_t *codes) {
    int32_t v;
    memcpy(&v, codes, sizeof v);
    return v;
}

/* AVX2 has no int8 dot-product instruction: `maddubs` multiplies 32 unsigned codes with 32 signed activations and
 * adds neighbouring pairs in 16 bits (saturating), `madd` with ones widens pairs of those to 32 bits. The tiles add
 * as many pair sums in 16 bits as their codes' range allows before widening: the same integers as VNNI's sums, with
 * fewer multiplies. */

#endif
