/* y = x @ W.T on a CPU for a weight W kept in GGUF's quantized groups, in llama.cpp's manner:
   each row of x is quantized to int8 per 32 values (a float scale each), and a group's dot
   product is summed in integers, then scaled once in float. Unlike llama.cpp, a row goes in as
   two int8 levels (see quantize_chunks), so the result is the dequantized model's.

   Weights. A weight is `q * scale + offset` over groups of `gs` (16 or 32) consecutive k:
     scale  = d[g / sg] * sc[g]   (sc absent: 1)
     offset = dm[g / sg] * mn[g]  (mn absent: 1; dm absent: no offset)
   d, dm are f16 per "super-block" of `sg` groups and sc, mn int8 per group: the formats' own
   numbers, so the file's weights are kept exactly, and a scale is the float product llama.cpp's
   and gguf's dequantizers compute. They are laid out [blocks, groups, LANES].
   The quants are kept in blocks of LANES output features, 32 k at a time, so that one 32-byte
   load holds 4 consecutive k of each of the LANES features: the shape a byte multiply-add
   (vpmaddubsw, 4 products summed per 32-bit lane) wants, with no sum across lanes at the end.
     8-bit:  [blocks, in/32, 8 quads, LANES, 4]                       k = 32c + 4t + i
     4-bit:  [blocks, in/32, 4 quads, LANES, 4] bytes, low nibble k = 32c + 4t + i,
                                                 high nibble k = 32c + 16 + 4t + i
     5-bit:  [blocks, in/32, 5 quads, LANES, 4] bytes: quads 0-3 the low 4 bits as 4-bit's, quad 4
             the top bit of quad T (k = 32c + 4T + i) at bit T (the file's 5 bits a weight)
     6-bit:  [blocks, in/32, 6 quads, LANES, 4] bytes: quads 0-3 the low 4 bits as 4-bit's, quads
             4 and 5 the top 2 bits of k = 32c + 16h + 4t + i (h = 0, 1) in bits 2t, 2t + 1
     2-bit:  [blocks, in/32, 2 rows, LANES, 4] bytes: bits 2s, 2s + 1 of row t's hold
             k = 32c + 8s + 4t + i (s = 0..3), so quad 2s + t is one shift of one load
     3-bit:  [blocks, in/32, 3 rows, LANES, 4] bytes: rows 0 and 1 the low 2 bits as 2-bit's, row 2
             the top bit of quad T (k = 32c + 4T + i) at bit T
   A 6-bit quant is stored as u = q + shift (0..63: Q6_K's signed -32..31 with shift 32), a 5-bit
   one too (0..31: Q5_0's -16..15 with shift 16, Q5_1's and Q5_K's 0..31 with shift 0), and a 3-bit
   one (Q3_K's -4..3 with shift 4), and the loops subtract shift * (the sum of xq over the group)
   from u . xq.
   A part with a `table` keeps 4-bit indices of its 16 int8 values instead (IQ4's non-linear
   levels): a quant is table[index].

   Activations. Row r's 32 values of chunk c become xq = round(x / dx), dx = max|x| / 127 (as
   llama.cpp's q8 rows), and with two levels also what that left out, in steps FINER times finer
   (within 127 of them: it is within half a step of level 1), so that both levels' integer sums
   add up in one int32 (level 1's times FINER) and are scaled into float once; xsum
   = the float sums of each 16 values for the offsets: x . (q*s + o) ~= s * sum over levels of
   dx * (xq . q) + o * xsum (a 32-wide group's xsum the sum of its two); xqsum the integer sums
   of each level's xq over each 16 values (for the 3-, 5- and 6-bit shift).

   Rows are taken MT at a time so a block's weights, loaded once, serve several rows from L1.
   A batch of BATCH_ROWS rows or more in two levels goes to qmatmul_batch.c's loops instead. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const int8_t *xq; const float *dx; const float *xsum; const int32_t *xqsum;
    int64_t chunks, rows;  /* chunks = in / 32 */
    int32_t shift; const uint8_t *q; const half_bits *d; const half_bits *dm; const int8_t *sc; const int8_t *mn;
    const int8_t *table; int sg_shift; int64_t supers; float *y; int64_t y_stride;  /* sg = 1 << sg_shift; supers per row */
} Args;

/* Scale (and offset) of lane block b's scale group g, per lane. */
static inline void group_scale(const Args *a, int64_t b, int64_t g, int64_t groups, float *scale, float *offset) {
    const int64_t s = (b * a->supers + (g >> a->sg_shift)) * LANES, gi = (b * groups + g) * LANES;
    for (int l = 0; l < LANES; l++) {
        scale[l] = half_to_float(a->d[s + l]) * (a->sc ? (float)a->sc[gi + l] : 1.0f);
        if (offset) offset[l] = a->dm ? half_to_float(a->dm[s + l]) * (a->mn ? (float)a->mn[gi + l] : 1.0f) : 0.0f;
    }
}

#define FINER 254  /* level 2's step is level 1's / FINER */

#ifdef __AVX2__
#include <immintrin.h>

static inline __m256 load_factor(const Args *a, const half_bits *per_super, const int8_t *per_group,
                                 int64_t b, int64_t g, int64_t groups) {
    return group_factor(per_super, per_group, b, g, a->sg_shift, a->supers, groups);
}

#ifndef PREFETCH
#ifdef __AVX512F__  /* a newer core, more bandwidth: on Zen 5 one chat's decode ran 1.05-1.13x faster at
                       4096 than at 2048 (1B Q4_K_M and Q8_0, alternated; 3072-6144 level) */
#define PREFETCH 4096
#else
#define PREFETCH 2048  /* Zen 3 */
#endif
#endif

static inline __m256i broadcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* dot (rows r0 .. r0+MT-1 of chunk c, each half's sums of u . xq) less shift x each half's sum of
   xq (both levels', as the sums count them); then, for a 32-wide group, the halves as one sum. */
static inline __attribute__((always_inline)) void remove_shift(const Args *a, __m256i dot[4][2], int64_t r0, int64_t c,
                                                               const int MT, const int GS, const int LEVELS) {
    const int64_t level_stride = a->rows * a->chunks;
    for (int r = 0; r < MT; r++) {
        if (a->shift) {
            const int32_t *sums = a->xqsum + ((r0 + r) * a->chunks + c) * 2;
            int32_t sum0 = sums[0], sum1 = sums[1];
            if (LEVELS == 2) {
                const int32_t *fine = sums + level_stride * 2;
                sum0 = sum0 * FINER + fine[0], sum1 = sum1 * FINER + fine[1];
            }
            dot[r][0] = _mm256_sub_epi32(dot[r][0], _mm256_set1_epi32(a->shift * sum0));
            dot[r][1] = _mm256_sub_epi32(dot[r][1], _mm256_set1_epi32(a->shift * sum1));
        }
        if (GS == 32) dot[r][0] = _mm256_add_epi32(dot[r][0], dot[r][1]);
    }
}


/* The loops that sum products in 16 bits (`pairs`, per level, row and group half: HALVES of them
   in a chunk) widen them to 32 once per chunk, the finer level's scaled by `first`. */
static inline __attribute__((always_inline)) void clear_pairs(__m256i pairs[2][4][2], const int MT, const int LEVELS) {
    for (int v = 0; v < LEVELS; v++)
        for (int r = 0; r < MT; r++) pairs[v][r][0] = pairs[v][r][1] = _mm256_setzero_si256();
}

static inline __attribute__((always_inline)) void widen_pairs(__m256i pairs[2][4][2], __m256i dot[4][2], const int MT,
                                                               const int HALVES, const int LEVELS, const __m256i first,
                                                               const __m256i ones) {
    for (int r = 0; r < MT; r++)
        for (int h = 0; h < HALVES; h++) {
            dot[r][h] = _mm256_madd_epi16(pairs[0][r][h], first);
            if (LEVELS == 2) dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs[1][r][h], ones));
        }
}

/* Lane block b's outputs for rows r0 .. r0+MT-1; MT, GS, BITS, LEVELS, TABLE (4-bit indices of
   a->table) are constants at each call. Level 1 is the rounded row, level 2 (when LEVELS is 2)
   what rounding left out. */
static inline __attribute__((always_inline)) void block_rows(const Args *a, int64_t b, int64_t r0, const int MT,
                                                             const int GS, const int BITS, const int LEVELS,
                                                             const int TABLE) {
    const int64_t groups = a->chunks * CHUNK / GS, level_stride = a->rows * a->chunks;
    /* with two levels, level 1's sums count FINER of level 2's steps: both summed in one int32 */
    const __m256i ones = _mm256_set1_epi16(1), first = _mm256_set1_epi16(LEVELS == 2 ? FINER : 1), low4 = _mm256_set1_epi8(15);
    __m256 acc[4];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    const int64_t chunk_bytes = BITS * CHUNK * LANES / 8;
    for (int64_t c = 0; c < a->chunks; c++) {
        {   /* ask for the quants PREFETCH bytes ahead: one row reads them faster than the hardware's
               prefetcher fetches them on its own */
            const char *ahead = (const char *)a->q + (b * a->chunks + c) * chunk_bytes + PREFETCH;
            for (int64_t line = 0; line < chunk_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 0);
        }
        const int8_t *xq[2][4];
        for (int v = 0; v < LEVELS; v++)
            for (int r = 0; r < MT; r++) xq[v][r] = a->xq + ((v * level_stride) + (r0 + r) * a->chunks + c) * CHUNK;
        __m256i dot[1][4][2];  /* [row][half of the chunk] (halves for 16-wide groups), both levels */
        for (int r = 0; r < MT; r++) dot[0][r][0] = dot[0][r][1] = _mm256_setzero_si256();
        if (BITS == 6) {
            /* u . xq for the chunk's two halves apart (a 16-wide group each, for Q6_K), widened
               to 32 bits every two quads: a byte multiply-add's 16-bit sum is at most
               2 x 63 x 127 = 16,002, so two of them fit 16 bits (three would not). */
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK * 6 / 8) * LANES;
            const __m256i top_low = _mm256_loadu_si256((const __m256i *)(p + 128));
            const __m256i top_high = _mm256_loadu_si256((const __m256i *)(p + 160));
            for (int t = 0; t < 4; t += 2) {
                __m256i lo[2], hi[2];
                for (int u = 0; u < 2; u++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + (t + u) * 32));
                    lo[u] = _mm256_or_si256(_mm256_and_si256(w, low4), top_bits(top_low, t + u));
                    hi[u] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), top_bits(top_high, t + u));
                }
                for (int v = 0; v < LEVELS; v++)
                    for (int r = 0; r < MT; r++) {
                        dot[0][r][0] = _mm256_add_epi32(dot[0][r][0], _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[0], broadcast4(xq[v][r] + 4 * t)),
                            _mm256_maddubs_epi16(lo[1], broadcast4(xq[v][r] + 4 * t + 4))), v ? ones : first));
                        dot[0][r][1] = _mm256_add_epi32(dot[0][r][1], _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(hi[0], broadcast4(xq[v][r] + 16 + 4 * t)),
                            _mm256_maddubs_epi16(hi[1], broadcast4(xq[v][r] + 20 + 4 * t))), v ? ones : first));
                    }
            }
            remove_shift(a, dot[0], r0, c, MT, GS, LEVELS);
        } else if (BITS == 5) {
            /* u = q + shift (0..31): 16-bit sums hold a half's 4 quads, 4 x 2 products x 31 x 127
               < 2^15, each half apart (a group's shift takes its own sums). Quad t's low nibbles are
               k 4t + i, its high ones k 16 + 4t + i: their top bits at bits t and 4 + t. */
            __m256i pairs[2][4][2];
            clear_pairs(pairs, MT, LEVELS);
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK * 5 / 8) * LANES;
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(p + 128));
            for (int t = 0; t < 4; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(w, low4), fifth_bit(plane, t));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), fifth_bit(plane, 4 + t));
                for (int v = 0; v < LEVELS; v++)
                    for (int r = 0; r < MT; r++) {
                        pairs[v][r][0] = _mm256_add_epi16(pairs[v][r][0], _mm256_maddubs_epi16(lo, broadcast4(xq[v][r] + 4 * t)));
                        pairs[v][r][1] = _mm256_add_epi16(pairs[v][r][1], _mm256_maddubs_epi16(hi, broadcast4(xq[v][r] + 16 + 4 * t)));
                    }
            }
            widen_pairs(pairs, dot[0], MT, 2, LEVELS, first, ones);
            remove_shift(a, dot[0], r0, c, MT, GS, LEVELS);
        } else if (BITS == 3) {
            /* u = q + shift (0..7): 16-bit sums hold a whole chunk, 8 quads x 2 products x 7 x
               127 < 2^15, each half's apart (quads 0-3 are k 0-15) for the shift's sums. */
            const __m256i low2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
            __m256i pairs[2][4][2];
            clear_pairs(pairs, MT, LEVELS);
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK * 3 / 8) * LANES;
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(p + 64));
            for (int t = 0; t < 2; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                for (int s = 0; s < 4; s++) {
                    const int quad = 2 * s + t;  /* its top bit from bit `quad` to bit 2 (the mask drops what crosses bytes) */
                    const __m256i top = quad >= 2 ? _mm256_srli_epi16(plane, quad - 2) : _mm256_slli_epi16(plane, 2 - quad);
                    const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 2 * s), low2), _mm256_and_si256(top, bit2));
                    for (int v = 0; v < LEVELS; v++)
                        for (int r = 0; r < MT; r++)
                            pairs[v][r][s / 2] = _mm256_add_epi16(pairs[v][r][s / 2],
                                                                  _mm256_maddubs_epi16(u, broadcast4(xq[v][r] + 8 * s + 4 * t)));
                }
            }
            widen_pairs(pairs, dot[0], MT, 2, LEVELS, first, ones);
            remove_shift(a, dot[0], r0, c, MT, GS, LEVELS);
        } else if (BITS == 4 && TABLE) {
            /* The indices' values by a byte shuffle of the table (in both 128-bit lanes), then
               multiplied as 8-bit quants are: |value| x (x with value's sign). A product pair's
               16-bit sum may reach 2 x 127 x 127, so each is widened to 32 bits at once. The low
               nibbles are k 0-15, the high k 16-31. */
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a->table));
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK / 2) * LANES;
            for (int t = 0; t < 4; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(w, low4));
                const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), low4));
                const __m256i lo_abs = _mm256_abs_epi8(lo), hi_abs = _mm256_abs_epi8(hi);
                for (int v = 0; v < LEVELS; v++)
                    for (int r = 0; r < MT; r++) {
                        const __m256i step = v ? ones : first;
                        const __m256i low_half = _mm256_madd_epi16(_mm256_maddubs_epi16(
                            lo_abs, _mm256_sign_epi8(broadcast4(xq[v][r] + 4 * t), lo)), step);
                        const __m256i high_half = _mm256_madd_epi16(_mm256_maddubs_epi16(
                            hi_abs, _mm256_sign_epi8(broadcast4(xq[v][r] + 16 + 4 * t), hi)), step);
                        if (GS == 16) {
                            dot[0][r][0] = _mm256_add_epi32(dot[0][r][0], low_half);
                            dot[0][r][1] = _mm256_add_epi32(dot[0][r][1], high_half);
                        } else {
                            dot[0][r][0] = _mm256_add_epi32(dot[0][r][0], _mm256_add_epi32(low_half, high_half));
                        }
                    }
            }
        } else if (BITS == 2) {
            /* 16-bit sums hold a whole chunk: 8 quads x 2 products x 3 x 127 < 2^15. Quads 0-3
               (s = 0, 1) are k 0-15, quads 4-7 k 16-31: a 16-wide group's sums kept apart. */
            const __m256i low2 = _mm256_set1_epi8(3);
            __m256i pairs[2][4][2];
            clear_pairs(pairs, MT, LEVELS);
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK / 4) * LANES;
            for (int t = 0; t < 2; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                for (int s = 0; s < 4; s++) {
                    const __m256i u = _mm256_and_si256(_mm256_srli_epi16(w, 2 * s), low2);
                    for (int v = 0; v < LEVELS; v++)
                        for (int r = 0; r < MT; r++) {
                            const int h = GS == 16 ? s / 2 : 0;
                            pairs[v][r][h] = _mm256_add_epi16(pairs[v][r][h],
                                                              _mm256_maddubs_epi16(u, broadcast4(xq[v][r] + 8 * s + 4 * t)));
                        }
                }
            }
            widen_pairs(pairs, dot[0], MT, CHUNK / GS, LEVELS, first, ones);
        } else if (BITS == 4) {
            /* 16-bit sums hold a whole chunk: 4 quads x 2 nibbles x 2 products x 15 x 127 < 2^15.
               The low nibbles are k 0-15, the high k 16-31: a 16-wide group's sums kept apart. */
            __m256i pairs[2][4][2];
            clear_pairs(pairs, MT, LEVELS);
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK / 2) * LANES;
            for (int t = 0; t < 4; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i lo = _mm256_and_si256(w, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                for (int v = 0; v < LEVELS; v++)
                    for (int r = 0; r < MT; r++) {
                        const __m256i low_half = _mm256_maddubs_epi16(lo, broadcast4(xq[v][r] + 4 * t));
                        const __m256i high_half = _mm256_maddubs_epi16(hi, broadcast4(xq[v][r] + 16 + 4 * t));
                        if (GS == 16) {
                            pairs[v][r][0] = _mm256_add_epi16(pairs[v][r][0], low_half);
                            pairs[v][r][1] = _mm256_add_epi16(pairs[v][r][1], high_half);
                        } else {
                            pairs[v][r][0] = _mm256_add_epi16(pairs[v][r][0], _mm256_add_epi16(low_half, high_half));
                        }
                    }
            }
            widen_pairs(pairs, dot[0], MT, CHUNK / GS, LEVELS, first, ones);
        } else {
            const int8_t *p = (const int8_t *)a->q + (b * a->chunks + c) * CHUNK * LANES;
            for (int t = 0; t < 8; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i w_abs = _mm256_sign_epi8(w, w);
                const int h = GS == 16 ? t / 4 : 0;
                for (int v = 0; v < LEVELS; v++)
                    for (int r = 0; r < MT; r++) {
                        /* |w| * (x with w's sign): the unsigned-by-signed form vpmaddubsw takes. */
                        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(broadcast4(xq[v][r] + 4 * t), w));
                        dot[0][r][h] = _mm256_add_epi32(dot[0][r][h], _mm256_madd_epi16(pairs, v ? ones : first));
                    }
            }
        }
        const int64_t g0 = c * CHUNK / GS;
        for (int h = 0; h < CHUNK / GS; h++) {
            const __m256 scale = load_factor(a, a->d, a->sc, b, g0 + h, groups);
            for (int r = 0; r < MT; r++) {  /* the finest level's step: the sums count in it */
                const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(a->dx[(LEVELS - 1) * level_stride + (r0 + r) * a->chunks + c]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r][h]), s, acc[r]);
            }
        }
        if (a->dm)
            for (int h = 0; h < CHUNK / GS; h++) {
                const __m256 offset = load_factor(a, a->dm, a->mn, b, g0 + h, groups);
                for (int r = 0; r < MT; r++) {
                    const float *xs = a->xsum + ((r0 + r) * a->chunks + c) * 2;
                    acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(GS == 16 ? xs[h] : xs[0] + xs[1]), acc[r]);
                }
            }
    }
    for (int r = 0; r < MT; r++) _mm256_storeu_ps(a->y + (r0 + r) * a->y_stride + b * LANES, acc[r]);
}

#else  /* the same sums, one lane at a time */

static inline __attribute__((always_inline)) void block_rows(const Args *a, int64_t b, int64_t r0, const int MT,
                                                             const int GS, const int BITS, const int LEVELS,
                                                             const int TABLE) {
    const int64_t groups = a->chunks * CHUNK / GS, level_stride = a->rows * a->chunks;
    for (int r = 0; r < MT; r++) {
        float acc[LANES] = {0};
        for (int64_t c = 0; c < a->chunks; c++) {
            for (int h = 0; h < CHUNK / GS; h++) {
                float scale[LANES], offset[LANES];
                group_scale(a, b, c * CHUNK / GS + h, groups, scale, offset);
                const float *xs = a->xsum + ((r0 + r) * a->chunks + c) * 2;
                for (int l = 0; l < LANES; l++) {
                    for (int v = 0; v < LEVELS; v++) {
                        const int64_t row_chunk = v * level_stride + (r0 + r) * a->chunks + c;
                        const int8_t *xq = a->xq + row_chunk * CHUNK;
                        int32_t dot = 0;
                        for (int k = h * GS; k < (h + 1) * GS; k++) {
                            int q;
                            if (BITS == 2 || BITS == 3) {
                                const int64_t at = (b * a->chunks + c) * BITS * 32;  /* BITS rows of 32 bytes */
                                const int quad = k / 4;  /* 2s + t */
                                q = (a->q[at + (quad % 2) * 32 + l * 4 + k % 4] >> (2 * (quad / 2))) & 3;
                                if (BITS == 3) q = (q | ((a->q[at + 64 + l * 4 + k % 4] >> quad) & 1) << 2) - a->shift;
                            } else if (BITS == 4 || BITS == 5 || BITS == 6) {
                                const int64_t at = (b * a->chunks + c) * BITS * 32;  /* BITS quads of 32 bytes */
                                const uint8_t byte = a->q[at + (k % 16 / 4) * 32 + l * 4 + k % 4];
                                q = k < 16 ? byte & 15 : byte >> 4;
                                if (BITS == 5) {
                                    q = (q | ((a->q[at + 128 + l * 4 + k % 4] >> (k / 4)) & 1) << 4) - a->shift;
                                } else if (BITS == 6) {
                                    const uint8_t top = a->q[at + (4 + k / 16) * 32 + l * 4 + k % 4];
                                    q = (q | ((top >> (2 * (k % 16 / 4))) & 3) << 4) - a->shift;
                                } else if (TABLE) {
                                    q = a->table[q];
                                }
                            } else {
                                q = ((const int8_t *)a->q)[((b * a->chunks + c) * 8 + k / 4) * 32 + l * 4 + k % 4];
                            }
                            dot += q * xq[k];
                        }
                        acc[l] += (float)dot * scale[l] * a->dx[row_chunk];
                    }
                    if (a->dm) acc[l] += offset[l] * (GS == 16 ? xs[h] : xs[0] + xs[1]);
                }
            }
        }
        memcpy(a->y + (r0 + r) * a->y_stride + b * LANES, acc, sizeof(acc));
    }
}
#endif

/* Rows in tiles of 4 (2 with two levels, which hold twice the sums in registers). */
static inline __attribute__((always_inline)) void block(const Args *a, int64_t b, int64_t rows,
                                                        const int GS, const int BITS, const int LEVELS, const int TABLE) {
    int64_t r = 0;
    if (LEVELS == 1) {
        for (; r + 4 <= rows; r += 4) block_rows(a, b, r, 4, GS, BITS, 1, TABLE);
        if (rows - r == 3) { block_rows(a, b, r, 3, GS, BITS, 1, TABLE); r += 3; }
    }
    for (; r + 2 <= rows; r += 2) block_rows(a, b, r, 2, GS, BITS, LEVELS, TABLE);
    if (r < rows) block_rows(a, b, r, 1, GS, BITS, LEVELS, TABLE);
}

/* A part's blocks, each format's loop chosen once per call. */
static inline void format_block(const Args *a, const Part *p, int64_t b, int64_t rows, int64_t levels) {
    #define BY_FORMAT(LEVELS) \
        if (p->table && p->gs == 16) block(a, b, rows, 16, 4, LEVELS, 1); \
        else if (p->table) block(a, b, rows, 32, 4, LEVELS, 1); \
        else if (p->bits == 2 && p->gs == 16) block(a, b, rows, 16, 2, LEVELS, 0); \
        else if (p->bits == 2) block(a, b, rows, 32, 2, LEVELS, 0); \
        else if (p->bits == 3 && p->gs == 16) block(a, b, rows, 16, 3, LEVELS, 0); \
        else if (p->bits == 3) block(a, b, rows, 32, 3, LEVELS, 0); \
        else if (p->bits == 4 && p->gs == 16) block(a, b, rows, 16, 4, LEVELS, 0); \
        else if (p->bits == 4) block(a, b, rows, 32, 4, LEVELS, 0); \
        else if (p->bits == 5 && p->gs == 16) block(a, b, rows, 16, 5, LEVELS, 0); \
        else if (p->bits == 5) block(a, b, rows, 32, 5, LEVELS, 0); \
        else if (p->bits == 6 && p->gs == 16) block(a, b, rows, 16, 6, LEVELS, 0); \
        else if (p->bits == 6) block(a, b, rows, 32, 6, LEVELS, 0); \
        else if (p->gs == 16) block(a, b, rows, 16, 8, LEVELS, 0); \
        else block(a, b, rows, 32, 8, LEVELS, 0);
    if (levels == 2) { BY_FORMAT(2) } else { BY_FORMAT(1) }
    #undef BY_FORMAT
}

/* Row r of x [rows, in] (row stride x_stride) as int8 per 32 values, in `levels` levels: level 1
   is round(x / dx) with dx = max|x| / 127 (llama.cpp's q8 rows), level 2 what level 1 left out
   (within dx / 2) in steps of dx / FINER, so two levels carry x to ~1/64000 of the chunk's
   largest value. xq [levels, rows, in], dx [levels, rows, in/32]; xsum [rows, in/16] the float
   sums by 16 (for the offsets), xqsum [levels, rows, in/16] the integer sums of xq by 16 (for the
   3-, 5- and 6-bit shift). Called inside a parallel region: the threads share the chunks. */
static void quantize_chunks(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t levels,
                            int8_t *xq, float *dx, float *xsum, int32_t *xqsum) {
    const int64_t chunks = in / CHUNK;
    #pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t rc = r * chunks + c;
        float v[CHUNK], halves[2] = {0.0f, 0.0f};
        memcpy(v, x + r * x_stride + c * CHUNK, sizeof(v));
        for (int i = 0; i < CHUNK; i++) halves[i / 16] += v[i];
        memcpy(xsum + rc * 2, halves, sizeof(halves));
        float amax = 0.0f;
        for (int i = 0; i < CHUNK; i++) amax = fmaxf(amax, fabsf(v[i]));
        for (int64_t level = 0; level < levels; level++) {
            const float step = level == 0 ? amax / 127.0f : dx[rc] / FINER;
            const float inverse = amax == 0.0f ? 0.0f : level == 0 ? 127.0f / amax : FINER / dx[rc];
            int8_t *out = xq + (level * rows * chunks + rc) * CHUNK;
            int32_t sums[2] = {0, 0};
            for (int i = 0; i < CHUNK; i++) {
                const long rounded = lrintf(v[i] * inverse);  /* within 127 but for float rounding */
                out[i] = (int8_t)(rounded > 127 ? 127 : rounded < -127 ? -127 : rounded);
                v[i] -= (float)out[i] * step;
                sums[i / 16] += out[i];
            }
            dx[level * rows * chunks + rc] = step;
            memcpy(xqsum + (level * rows * chunks + rc) * 2, sums, sizeof(sums));
        }
    }
}

/* y [rows, ...] (row stride y_stride) = x [rows, in] @ [W1; W2; ...].T for the parts, inside a
   parallel region the caller opened: x quantized once (scratch xq, dx, xsum as quantize_chunks
   lays them out), then each part's blocks shared by the threads. Parts run one after another: a
   part's last block may write past its columns (its padding), which the next part then
   overwrites. Ends at a barrier: y is whole when it returns. */
void qlinear_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t levels,
                       const Scratch *scratch, const Part *parts, int64_t num_parts, float *y, int64_t y_stride) {
    if (levels == 2 && rows >= BATCH_ROWS && qlinear_batch_in_region(x, rows, x_stride, in, scratch, parts, num_parts, y, y_stride))
        return;
    quantize_chunks(x, rows, x_stride, in, levels, scratch->xq, scratch->dx, scratch->xsum, scratch->xqsum);
    /* (a barrier ended that) */
    for (int64_t i = 0; i < num_parts; i++) {
        const Part *p = &parts[i];
        const Args a = {scratch->xq, scratch->dx, scratch->xsum, scratch->xqsum, in / CHUNK, rows, (int32_t)p->shift,
                        p->q, p->d, p->dm, p->sc, p->mn, p->table, __builtin_ctzll(p->sg), in / p->gs / p->sg,
                        y + p->column, y_stride};
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < p->blocks; b++) format_block(&a, p, b, rows, levels);
    }
}

/* The same, in a parallel region of its own. */
void qlinear(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t levels,
             const Scratch *scratch, const Part *parts, int64_t num_parts, float *y, int64_t y_stride) {
    #pragma omp parallel
    qlinear_in_region(x, rows, x_stride, in, levels, scratch, parts, num_parts, y, y_stride);
}
