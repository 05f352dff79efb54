/* A GGUF file's Q4_K, Q6_K, Q8_0 and Q5_0 blocks rearranged into the tiles of viasd's 4-, 6- and 8-bit kernels
 * (w4a8.c, w6a8.c, w8a8.c), the same numbers: what views/gguf.py's numpy converters compute, at memory speed, so that a model's view is made
 * from its file at each start instead of being kept in the cache as a second copy of the file.
 *
 * Each output tile (16 rows) is written by one thread from the 16 rows of blocks it covers; rows past the tensor's
 * last one are zeros. Scales rounded to fp16 round to nearest, ties to even, as torch's .half() does.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "viasd_kernels.h"

#define TILE VIASD_TILE
#define SUPER VIASD_SUPER
#define Q4K_BYTES 144
#define Q6K_BYTES 210
#define SMALL 32 /* weights per Q8_0 or Q5_0 block */
#define Q8_0_BYTES 34
#define Q5_0_BYTES 22

static float half_to_float(const uint8_t *bytes) {
    uint16_t bits;
    memcpy(&bits, bytes, 2);
    return _cvtsh_ss(bits);
}

static uint16_t float_to_half(float value) { return (uint16_t)_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT); }

/* Sub-block j's 6-bit scale and minimum of a Q4_K (or Q5_K) block's 12 scale bytes, as ggml packs them. */
static void scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Codes of one row as w4a8's tile wants them: `octets[o]` is the 4-byte lane of row i for inputs 8o..8o+7 (low
 * nibbles inputs 8o..8o+3, high ones 8o+4..8o+7). */
static void q4k_row(const uint8_t *row, int64_t columns, uint8_t *packed, int64_t i, uint16_t *scale, uint16_t *low) {
    for (int64_t b = 0; b < columns / SUPER; b++) {
        const uint8_t *block = row + b * Q4K_BYTES;
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min(block + 4, j, &sc, &m);
            scale[(b * 8 + j) * TILE + i] = float_to_half(d * (float)sc);
            low[(b * 8 + j) * TILE + i] = float_to_half(-dmin * (float)m);
        }
        uint8_t codes[SUPER];
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++) {
                const uint8_t byte = block[16 + 32 * c + j];
                codes[64 * c + j] = byte & 15;
                codes[64 * c + 32 + j] = byte >> 4;
            }
        for (int o = 0; o < SUPER / 8; o++)
            for (int q = 0; q < 4; q++)
                packed[((b * SUPER / 8 + o) * TILE + i) * 4 + q] = codes[8 * o + q] | codes[8 * o + 4 + q] << 4;
    }
}

int q4k_repack(const uint8_t *blocks, int64_t rows, int64_t columns, uint8_t *packed, uint16_t *scale, uint16_t *low,
               int threads) {
    if (rows <= 0 || columns <= 0 || columns % SUPER) return VIASD_BAD_SHAPE;
    const int64_t tiles = (rows + TILE - 1) / TILE, row_bytes = columns / SUPER * Q4K_BYTES;
    const int64_t tile_packed = columns / 8 * 4 * TILE, tile_groups = columns / 32 * TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *p = packed + t * tile_packed;
        uint16_t *s = scale + t * tile_groups, *l = low + t * tile_groups;
        if ((t + 1) * TILE > rows) {  /* the last tile's rows past the tensor stay zero */
            memset(p, 0, (size_t)tile_packed);
            memset(s, 0, (size_t)tile_groups * 2);
            memset(l, 0, (size_t)tile_groups * 2);
        }
        for (int64_t i = 0; i < TILE && t * TILE + i < rows; i++)
            q4k_row(blocks + (t * TILE + i) * row_bytes, columns, p, i, s, l);
    }
    return VIASD_OK;
}

/* One row of Q6_K blocks in w6a8's tile: low nibbles as w4a8's codes, top bit pairs per 16 inputs (byte b of row
 * i's lane in sub-block s holds, in bits 2q..2q+1, the top bits of input 16s + 4q + b), int8 and fp16 scales. */
static void q6k_row(const uint8_t *row, int64_t columns, uint8_t *lows, uint8_t *high, int8_t *sub, uint16_t *d,
                    int64_t i) {
    for (int64_t b = 0; b < columns / SUPER; b++) {
        const uint8_t *block = row + b * Q6K_BYTES;
        uint8_t codes[SUPER];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
            for (int w = 0; w < 128; w++) {
                const uint8_t nibble = w < 64 ? ql[w] & 15 : ql[w - 64] >> 4;
                codes[128 * h + w] = nibble | ((qh[w % 32] >> (2 * (w / 32))) & 3) << 4;
            }
        }
        for (int o = 0; o < SUPER / 8; o++)
            for (int q = 0; q < 4; q++)
                lows[((b * SUPER / 8 + o) * TILE + i) * 4 + q] =
                    (codes[8 * o + q] & 15) | (codes[8 * o + 4 + q] & 15) << 4;
        for (int s = 0; s < SUPER / 16; s++) {
            for (int q = 0; q < 4; q++) {
                uint8_t byte = 0;
                for (int quarter = 0; quarter < 4; quarter++)
                    byte |= (uint8_t)((codes[16 * s + 4 * quarter + q] >> 4) << (2 * quarter));
                high[((b * SUPER / 16 + s) * TILE + i) * 4 + q] = byte;
            }
            sub[(b * SUPER / 16 + s) * TILE + i] = (int8_t)block[192 + s];
        }
        memcpy(&d[b * TILE + i], block + 208, 2);
    }
}

int q6k_repack(const uint8_t *blocks, int64_t rows, int64_t columns, uint8_t *low, uint8_t *high, int8_t *sub,
               uint16_t *d, int threads) {
    if (rows <= 0 || columns <= 0 || columns % SUPER) return VIASD_BAD_SHAPE;
    const int64_t tiles = (rows + TILE - 1) / TILE, row_bytes = columns / SUPER * Q6K_BYTES;
    const int64_t tile_low = columns / 8 * 4 * TILE, tile_high = columns / 16 * 4 * TILE;
    const int64_t tile_sub = columns / 16 * TILE, tile_d = columns / SUPER * TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *lo = low + t * tile_low, *hi = high + t * tile_high;
        int8_t *s = sub + t * tile_sub;
        uint16_t *dd = d + t * tile_d;
        if ((t + 1) * TILE > rows) {
            memset(lo, 0, (size_t)tile_low);
            memset(hi, 0, (size_t)tile_high);
            memset(s, 0, (size_t)tile_sub);
            memset(dd, 0, (size_t)tile_d * 2);
        }
        for (int64_t i = 0; i < TILE && t * TILE + i < rows; i++)
            q6k_row(blocks + (t * TILE + i) * row_bytes, columns, lo, hi, s, dd, i);
    }
    return VIASD_OK;
}

/* One row's codes and scales of Q8_0 (fp16 d, 32 int8 codes: weight = d * code) or Q5_0 (fp16 d, 4 bytes of fifth
 * bits, bit j of the little-endian word for weight j, 16 bytes of low nibbles, byte j weights j and j + 16:
 * weight = d * (code - 16)) blocks, as w8a8's tile holds them: quad o of row i is the 4-byte lane of inputs
 * 4o..4o+3, a float32 scale d and minimum 0 per 32 inputs. */
static void small_row(int five, const uint8_t *row, int64_t columns, int8_t *codes, float *scale, float *low,
                      int64_t i) {
    const int64_t bytes = five ? Q5_0_BYTES : Q8_0_BYTES;
    for (int64_t b = 0; b < columns / SMALL; b++) {
        const uint8_t *block = row + b * bytes;
        int8_t values[SMALL];
        if (five) {
            uint32_t high;
            memcpy(&high, block + 2, 4);
            for (int j = 0; j < 16; j++) {
                values[j] = (int8_t)(((block[6 + j] & 15) | ((high >> j) & 1) << 4) - 16);
                values[j + 16] = (int8_t)(((block[6 + j] >> 4) | ((high >> (j + 16)) & 1) << 4) - 16);
            }
        } else {
            memcpy(values, block + 2, SMALL);
        }
        for (int q = 0; q < SMALL / 4; q++)
            memcpy(codes + ((b * SMALL / 4 + q) * TILE + i) * 4, values + 4 * q, 4);
        scale[b * TILE + i] = half_to_float(block);
        low[b * TILE + i] = 0.0f;
    }
}

static int small_repack(int five, const uint8_t *blocks, int64_t rows, int64_t columns, int8_t *codes, float *scale,
                        float *low, int threads) {
    if (rows <= 0 || columns <= 0 || columns % SMALL) return VIASD_BAD_SHAPE;
    const int64_t tiles = (rows + TILE - 1) / TILE, row_bytes = columns / SMALL * (five ? Q5_0_BYTES : Q8_0_BYTES);
    const int64_t tile_codes = columns * TILE, tile_groups = columns / SMALL * TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int8_t *c = codes + t * tile_codes;
        float *s = scale + t * tile_groups, *l = low + t * tile_groups;
        if ((t + 1) * TILE > rows) {
            memset(c, 0, (size_t)tile_codes);
            memset(s, 0, (size_t)tile_groups * 4);
            memset(l, 0, (size_t)tile_groups * 4);
        }
        for (int64_t i = 0; i < TILE && t * TILE + i < rows; i++)
            small_row(five, blocks + (t * TILE + i) * row_bytes, columns, c, s, l, i);
    }
    return VIASD_OK;
}

int q8_0_repack(const uint8_t *blocks, int64_t rows, int64_t columns, int8_t *codes, float *scale, float *low,
                int threads) {
    return small_repack(0, blocks, rows, columns, codes, scale, low, threads);
}

int q5_0_repack(const uint8_t *blocks, int64_t rows, int64_t columns, int8_t *codes, float *scale, float *low,
                int threads) {
    return small_repack(1, blocks, rows, columns, codes, scale, low, threads);
}
