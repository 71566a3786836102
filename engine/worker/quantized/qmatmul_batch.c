/* y = x @ W.T for a batch of rows (qmatmul.c's loops serve a few rows; these, many), on AVX2 or
   AVX-512 VNNI.

   Why another loop: at 32 rows the int8 loops ran at ~1.9 cycles per byte multiply-add against
   ~0.66 that a Zen 3 core can issue, with the two levels' sums spilled out of registers, and the
   6- and 8-bit formats widened to 32 bits at every step. Here each row goes in as one int16
   level per 32 values (dx = max|x| / 32767: the same precision as qmatmul.c's two int8 levels,
   whose second level is at most 1/254 of the first), and the weights as int16 too, so one
   vpmaddwd multiplies 2 k of 8 output features and sums them into 32 bits that hold a whole
   group (|q| <= 127, |xq| <= 32767: 32 products fit), for every format alike.

   The weights are unpacked from qmatmul.c's layout once per slab of SLAB chunks of TILE_BLOCKS
   lane blocks into a small buffer ([chunk][k pair][block] x 8 lanes x 2 k, int16: 8 KiB), which
   then serves every row of the batch from L1: for a tile of TILE_ROWS rows, each k pair costs
   TILE_BLOCKS loads of weights, TILE_ROWS broadcasts of x and TILE_BLOCKS x TILE_ROWS
   multiply-adds, the sums in registers; each group's are scaled into float sums, also in
   registers, which are stored into y after the first slab and added into it after each other
   slab. A part's last block may write past its columns into the next part's, as in qmatmul.c: that
   part's first slab then stores over them.

   The quants and factors come from memory (a 1B model's weights are 700 MB): each slab asks for
   the next one's quants (or the next unit's, with its factors) while its tiles run, a share
   before each tile, so that they arrive while the tiles multiply: loads waiting on them held ~25%
   of a 32-row product's samples, and asking ahead took its time from 7.4 to 6.5 ms (one thread,
   the 1B's gate/up, Zen 5); asked for in shares rather than all before the tiles, the unpacking's
   loads still waiting on them (13% of a 32-chat step), 6.6 -> 6.2 ms, a step 0.93x.

   With AVX-512 VNNI (Zen 4/5, Ice Lake and later) the same layout serves 512-bit tiles: one
   vpdpwssd multiplies and adds 2 k of two blocks, and the slab is unpacked two blocks at a time
   with a byte permute. At 32 rows, 2.3-2.4x the AVX2 tiles on the same Zen 5 (Q4_K, Q6_K, Q8_0,
   8,192 x 2,048), about 60% of what its vpdpwssd issue rate allows: the rest is the unpacking,
   the groups' float scaling (3 operations a group a tile sum) and y's additions.

   Spans (the K-quants, with a byte permute): Zen 5 issues the float scaling on the pipes that
   vpdpwssd uses, so the unpacking multiplies each group's small integer factor sc into its
   weights (int16: |q sc| <= 32 x 128), x goes in per SPAN_VALUES values at most X_LIMIT (per 32
   at 32767 otherwise), and a span of chunks sharing one f16 factor and one dx is summed in int32
   before it is scaled once: Q4_K's 4 chunks (128 x 15 x 63 x 16383 < 2^31), Q6_K's two groups of
   16 as one chunk. Q4_K 1.05-1.06x and Q6_K 1.05x faster at 32 rows (16,384 x 2,048, one
   thread), a 32-chat step of the 1B Q4_K_M 0.96-0.97x the time; its top-1 agreement the same
   (gguf_quality.py: per 256 values at 8191, 99.69%). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>

#define TILE_BLOCKS 2  /* lane blocks (of 8 output features) a tile holds */
#define TILE_ROWS 3    /* rows a tile holds: 6 sums, 6 float sums, 2 weights and a broadcast fill 15 of the
                          16 registers (2 rows: 1.02-1.05x slower; 4 spilled: 1.6x slower) */
#define PAIRS (CHUNK / 2)  /* k pairs a chunk holds */
#define PASS_ROWS 128  /* rows a pass over the weights serves at most (see qlinear_batch_in_region) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* With AVX-512 VNNI a tile takes WIDE_ROWS rows of 2 or 4 lane blocks: one vpdpwssd multiplies 2 k
   of 16 output features (two blocks) and adds them into its sums, where AVX2 needs a multiply-add
   and an add for 8; its 32 registers hold 4 blocks x 6 rows of sums and float sums. */
#define SLAB_BLOCKS 4  /* lane blocks a slab (and a unit of work) holds */
#define WIDE_ROWS 6
#define SLAB 16        /* chunks of 32 k unpacked at a time: each tile's float sums are added into y once
                          a slab (8: 0.9-0.97x as fast at 32 rows on Zen 5) */
#else
#define SLAB_BLOCKS TILE_BLOCKS
#define SLAB 8
#endif

typedef struct {
    const int16_t *x; const float *dx; const float *xsum;  /* x [rows, in] int16, dx [rows, chunks], xsum [rows, chunks, 2] */
    int64_t in, chunks, rows;
    const Part *p; int64_t groups, supers;                  /* groups and super-blocks per output row */
    float *y; int64_t y_stride;
} Batch;

/* Each cache line of [start, start + bytes) asked for into L1, in asm: gcc 12 counts a function
   whose only effect is __builtin_prefetch as const and drops its calls (no prefetch was left). */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)start + line)));
}

/* The quants the next slab will unpack: a range of `bytes` per lane block. The tiles ask for
   them a share before each tile rather than all at once, so that a few lines at a time are in
   flight (all at once, the loads of the unpacking that follows still waited on them). */
typedef struct {
    const uint8_t *start[SLAB_BLOCKS];
    int64_t bytes;
    int ranges;
} Ahead;

/* Lane blocks b .. b+nb-1's quants of chunks c0 .. c0+n-1 (none past the part). */
static Ahead ahead_of(const Batch *a, int64_t b, int nb, int64_t c0, int64_t n) {
    const Part *p = a->p;
    const int64_t bytes = p->bits * 32;
    Ahead ahead = {{0}, n * bytes, 0};
    if (b >= p->blocks) return ahead;
    if (b + nb > p->blocks) nb = (int)(p->blocks - b);
    for (int i = 0; i < nb; i++) ahead.start[i] = p->q + ((b + i) * a->chunks + c0) * bytes;
    ahead.ranges = nb;
    return ahead;
}

/* Share `part` of `parts` of each range, whole cache lines. */
static inline void ask_ahead(const Ahead *ahead, int64_t part, int64_t parts) {
    const int64_t lines = (ahead->bytes + 63) / 64, first = lines * part / parts, last = lines * (part + 1) / parts;
    for (int i = 0; i < ahead->ranges; i++) prefetch_bytes(ahead->start[i] + first * 64, (last - first) * 64);
}

/* The factors (kernels.h's group_factor: scales or offsets) of lane block b's groups g0 .. g0+count-1,
   a vector of LANES each, at out, out + step, ...: the pointers walked, each super-block's f16
   factor converted once. (Computed a group at a time from b and g, with their index arithmetic,
   they took ~5% of a 32-row product.) */
static inline void group_factors(const Batch *a, const half_bits *per_super, const int8_t *per_group, int64_t b,
                                 int64_t g0, int64_t count, float *out, int64_t step) {
    const int sg_shift = __builtin_ctzll(a->p->sg);
    const half_bits *super = per_super + b * a->supers * LANES;
    const int8_t *group = per_group ? per_group + (b * a->groups + g0) * LANES : NULL;
    int64_t s = -1;
    __m256 d = _mm256_setzero_ps();
    for (int64_t k = 0; k < count; k++) {
        if ((g0 + k) >> sg_shift != s) {
            s = (g0 + k) >> sg_shift;
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + s * LANES)));
        }
        __m256 f = d;
        if (group) f = _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(group + k * LANES)))));
        _mm256_store_ps(out + k * step, f);
    }
}

/* One quad of chunk c of lane block b (k = 32c + 4t + i, i < 4, for each of the 8 lanes: lane l
   at bytes 4l .. 4l+3) as signed bytes, from qmatmul.c's packing of BITS-bit quants (with TABLE,
   4-bit indices of `table`'s 16 values, in both 128-bit lanes); BITS, TABLE and t are constants
   at each call (a format's test and shifts out of the loop). */
static inline __attribute__((always_inline)) __m256i quad(const Part *p, int64_t chunks, int64_t b, int64_t c,
                                                          const int t, const int BITS, const int TABLE, __m256i table) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (BITS == 8) return _mm256_loadu_si256((const __m256i *)((const int8_t *)p->q + ((b * chunks + c) * 8 + t) * 32));
    const uint8_t *at = p->q + (b * chunks + c) * BITS * 32;
    if (BITS == 2 || BITS == 3) {  /* quad t = 2s + r: bits 2s, 2s + 1 of row r (and with 3 bits its top bit at bit t of row 2) */
        const __m256i crumbs = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(at + (t & 1) * 32)), 2 * (t >> 1)),
                                                _mm256_set1_epi8(3));
        if (BITS == 2) return crumbs;
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(at + 64));
        const __m256i top = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(plane, t - 2) : _mm256_slli_epi16(plane, 2 - t), _mm256_set1_epi8(4));
        return _mm256_sub_epi8(_mm256_or_si256(crumbs, top), _mm256_set1_epi8((char)p->shift));
    }
    const __m256i w = _mm256_loadu_si256((const __m256i *)(at + (t & 3) * 32));
    __m256i u = t < 4 ? _mm256_and_si256(w, low4) : _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    if (TABLE) u = _mm256_shuffle_epi8(table, u);
    if (BITS == 5) {  /* the top bit of quad t */
        u = _mm256_or_si256(u, fifth_bit(_mm256_loadu_si256((const __m256i *)(at + 128)), t));
        u = _mm256_sub_epi8(u, _mm256_set1_epi8((char)p->shift));
    }
    if (BITS == 6) {  /* the top 2 bits of quad t & 3 of half t / 4 */
        u = _mm256_or_si256(u, top_bits(_mm256_loadu_si256((const __m256i *)(at + (4 + t / 4) * 32)), t & 3));
        u = _mm256_sub_epi8(u, _mm256_set1_epi8((char)p->shift));
    }
    return u;
}

/* Slab [c0, c0 + n) of lane blocks b .. b+nb-1 into w: pair j of chunk c, block i at
   w + ((c - c0) * PAIRS + j) * nb * 16 + i * 16, lanes 0-7 each (k = 32c + 2j, 32c + 2j + 1). */
static inline __attribute__((always_inline)) void unpack_bits(const Batch *a, int64_t b, int nb, int64_t c0, int64_t n,
                                                              int16_t *w, const int BITS, const int TABLE) {
    /* per 128-bit half (lanes 0-3, 4-7): the bytes of k 0,1 of each lane, then of k 2,3; the
       unpacks then widen each half's first 8 bytes (k 0,1 of its lanes) into one vector of all 8
       lanes' pairs, and its last 8 (k 2,3) into another: 3 instructions where a cross-lane permute,
       two sign extensions and an extract took 5 */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i table = TABLE ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a->p->table))
                                : _mm256_setzero_si256();
    for (int64_t c = c0; c < c0 + n; c++)
        for (int i = 0; i < nb; i++) {
            _Pragma("GCC unroll 8")
            for (int t = 0; t < 8; t++) {
                const __m256i q = _mm256_shuffle_epi8(quad(a->p, a->chunks, b + i, c, t, BITS, TABLE, table), pick);
                /* the high bytes: 0 for the 2- and 4-bit quants (0..3, 0..15), the sign of the others */
                const __m256i high = BITS == 2 || (BITS == 4 && !TABLE) ? _mm256_setzero_si256()
                                                                        : _mm256_cmpgt_epi8(_mm256_setzero_si256(), q);
                int16_t *out = w + ((c - c0) * PAIRS + 2 * t) * nb * 16 + i * 16;
                _mm256_store_si256((__m256i *)out, _mm256_unpacklo_epi8(q, high));
                _mm256_store_si256((__m256i *)(out + nb * 16), _mm256_unpackhi_epi8(q, high));
            }
        }
}

#if defined(WIDE_ROWS) && defined(__AVX512VBMI__)  /* the byte permute: Ice Lake, Zen 4 and later, not Cascade Lake */
#define UNPACK_PAIRS
/* Blocks b and b + 1's integer factors sc of group g as a k pair's int16 multipliers: lane l's
   at 2l, 2l + 1 (block b) and 16 + 2l, 17 + 2l (block b + 1). */
static inline __m512i pair_factors(const Batch *a, int64_t b, int64_t g) {
    static const uint16_t twice[32] __attribute__((aligned(64))) = {
        0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
    const int8_t *sc = a->p->sc + (b * a->groups + g) * LANES;
    const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)sc),
                                            _mm_loadl_epi64((const __m128i *)(sc + a->groups * LANES)));
    return _mm512_permutexvar_epi16(_mm512_load_si512((const void *)twice), _mm512_castsi256_si512(_mm256_cvtepi8_epi16(both)));
}

/* The multipliers of chunk c's k 0-15 (halves[0]) and 16-31 (halves[1]) for blocks b, b + 1. */
static inline void chunk_factors(const Batch *a, int64_t b, int64_t c, __m512i halves[2]) {
    const int64_t gs = a->p->gs;
    halves[0] = pair_factors(a, b, c * CHUNK / gs);
    halves[1] = gs == CHUNK ? halves[0] : pair_factors(a, b, (c * CHUNK + 16) / gs);
}

/* unpack_bits for an even nb with AVX-512: a quad of two neighbouring blocks at once, one byte
   permute putting both blocks' k 0, 1 in the low half and k 2, 3 in the high half, then widened to
   int16 (two stores where unpack_bits takes four, with half the shuffles). FOLD: each group's
   integer factor sc multiplied into its weights (a Part's span). */
static inline __attribute__((always_inline)) void unpack_pairs_bits(const Batch *a, int64_t b, int nb, int64_t c0, int64_t n,
                                                                    int16_t *w, const int BITS, const int FOLD,
                                                                    const int TABLE) {
    /* byte 4l + i of the first block's quad at index 4l + i, the second's at 64 + 4l + i */
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29,
        64, 65, 68, 69, 72, 73, 76, 77, 80, 81, 84, 85, 88, 89, 92, 93,
        2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31,
        66, 67, 70, 71, 74, 75, 78, 79, 82, 83, 86, 87, 90, 91, 94, 95};
    const __m512i pick = _mm512_load_si512((const void *)order);
    if (BITS == 4) {
        /* quads t and t + 4 are one load's low and high nibbles: permuted once, then split (and
           with TABLE looked up in the table, in each 128-bit lane) */
        const __m512i low4 = _mm512_set1_epi8(15);
        const __m512i table = TABLE ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)a->p->table))
                                    : _mm512_setzero_si512();
        for (int64_t c = c0; c < c0 + n; c++)
            for (int i = 0; i < nb; i += 2) {
                const int64_t bytes = 4 * 32;  /* a chunk of a block: 4 quads of 32 bytes */
                const uint8_t *at = a->p->q + ((b + i) * a->chunks + c) * bytes, *next = at + a->chunks * bytes;
                __m512i factors[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                if (FOLD) chunk_factors(a, b + i, c, factors);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < 4; t++) {
                    const __m512i both = _mm512_permutex2var_epi8(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(at + t * 32))), pick,
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(next + t * 32))));
                    __m512i nibbles[2] = {_mm512_and_si512(both, low4), _mm512_and_si512(_mm512_srli_epi16(both, 4), low4)};
                    for (int h = 0; h < 2; h++) {
                        int16_t *out = w + ((c - c0) * PAIRS + 2 * (t + 4 * h)) * nb * 16 + i * 16;
                        __m512i k01, k23;
                        if (TABLE) {  /* signed values */
                            nibbles[h] = _mm512_shuffle_epi8(table, nibbles[h]);
                            k01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(nibbles[h]));
                            k23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(nibbles[h], 1));
                        } else {
                            k01 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(nibbles[h]));
                            k23 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(nibbles[h], 1));
                        }
                        if (FOLD) {  /* k 16h .. 16h + 15 of the chunk */
                            const __m512i f = factors[h];
                            k01 = _mm512_mullo_epi16(k01, f), k23 = _mm512_mullo_epi16(k23, f);
                        }
                        _mm512_store_si512((void *)out, k01);
                        _mm512_store_si512((void *)(out + nb * 16), k23);
                    }
                }
            }
        return;
    }
    for (int64_t c = c0; c < c0 + n; c++)
        for (int i = 0; i < nb; i += 2) {
            __m512i factors[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            if (FOLD) chunk_factors(a, b + i, c, factors);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < 8; t++) {
                const __m512i both = _mm512_permutex2var_epi8(
                    _mm512_castsi256_si512(quad(a->p, a->chunks, b + i, c, t, BITS, 0, _mm256_setzero_si256())), pick,
                    _mm512_castsi256_si512(quad(a->p, a->chunks, b + i + 1, c, t, BITS, 0, _mm256_setzero_si256())));
                int16_t *out = w + ((c - c0) * PAIRS + 2 * t) * nb * 16 + i * 16;
                /* 3-, 5-, 6- and 8-bit quants: signed (2-bit ones 0..3) */
                __m512i k01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(both));
                __m512i k23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(both, 1));
                if (FOLD) k01 = _mm512_mullo_epi16(k01, factors[t / 4]), k23 = _mm512_mullo_epi16(k23, factors[t / 4]);
                _mm512_store_si512((void *)out, k01);
                _mm512_store_si512((void *)(out + nb * 16), k23);
            }
        }
}

static inline __attribute__((always_inline)) void unpack_pairs(const Batch *a, int64_t b, int nb, int64_t c0, int64_t n,
                                                               int16_t *w, const int FOLD) {
    if (a->p->table) unpack_pairs_bits(a, b, nb, c0, n, w, 4, FOLD, 1);
    else if (a->p->bits == 2) unpack_pairs_bits(a, b, nb, c0, n, w, 2, FOLD, 0);
    else if (a->p->bits == 3) unpack_pairs_bits(a, b, nb, c0, n, w, 3, FOLD, 0);
    else if (a->p->bits == 4) unpack_pairs_bits(a, b, nb, c0, n, w, 4, FOLD, 0);
    else if (a->p->bits == 5) unpack_pairs_bits(a, b, nb, c0, n, w, 5, FOLD, 0);
    else if (a->p->bits == 6) unpack_pairs_bits(a, b, nb, c0, n, w, 6, FOLD, 0);
    else unpack_pairs_bits(a, b, nb, c0, n, w, 8, FOLD, 0);
}
#endif

/* fold: as unpack_pairs_bits' FOLD (only where it serves: an even nb with VBMI) */
static void unpack(const Batch *a, int64_t b, int nb, int64_t c0, int64_t n, int16_t *w, int fold) {
#ifdef UNPACK_PAIRS
    if (nb % 2 == 0) {
        if (fold) unpack_pairs(a, b, nb, c0, n, w, 1);
        else unpack_pairs(a, b, nb, c0, n, w, 0);
        return;
    }
#endif
    (void)fold;
    if (a->p->table) unpack_bits(a, b, nb, c0, n, w, 4, 1);
    else if (a->p->bits == 2) unpack_bits(a, b, nb, c0, n, w, 2, 0);
    else if (a->p->bits == 3) unpack_bits(a, b, nb, c0, n, w, 3, 0);
    else if (a->p->bits == 4) unpack_bits(a, b, nb, c0, n, w, 4, 0);
    else if (a->p->bits == 5) unpack_bits(a, b, nb, c0, n, w, 5, 0);
    else if (a->p->bits == 6) unpack_bits(a, b, nb, c0, n, w, 6, 0);
    else unpack_bits(a, b, nb, c0, n, w, 8, 0);
}

/* Rows r0 .. r0+MTT-1 of lane blocks b .. b+NBT-1 over the unpacked slab: y += their products.
   NBT, MTT, GS are constants at each call; the sums stay in registers for the slab. */
static inline __attribute__((always_inline)) void tile(const Batch *a, const int16_t *w, const float *scales,
                                                       const float *offsets, int64_t b, int64_t c0, int64_t n,
                                                       int64_t r0, const int NBT, const int MTT, const int GS) {
    const int16_t *x0 = a->x + r0 * a->in;  /* the tile's first row; row r at x0 + r * a->in */
    __m256 sum[TILE_BLOCKS][TILE_ROWS];
    for (int i = 0; i < NBT; i++)
        for (int r = 0; r < MTT; r++) sum[i][r] = _mm256_setzero_ps();
    for (int64_t c = c0; c < c0 + n; c++) {
        for (int h = 0; h < CHUNK / GS; h++) {
            __m256i acc[TILE_BLOCKS][TILE_ROWS];
            for (int i = 0; i < NBT; i++)
                for (int r = 0; r < MTT; r++) acc[i][r] = _mm256_setzero_si256();
            /* The group's k pairs unrolled whole, off one pointer into the slab and one into the
               first row (the second a constant stride on): each pair is then its loads, broadcasts,
               multiply-adds and adds, no address arithmetic. The empty asm on each sum keeps gcc
               from reassociating the adds into a tree that spilled every product to the stack.
               Against the loop unrolled by 4 that indexed x[r] + c * CHUNK + 2j per row: 1.15-1.2x faster
               (one decode step's matmuls of the 1B Q4_K_M and the SmolLM2 Q4_1, alternated, Zen 3). */
            const int16_t *wg = w + ((c - c0) * PAIRS + h * GS / 2) * NBT * 16, *xg = x0 + c * CHUNK + h * GS;
            _Pragma("GCC unroll 16")
            for (int j = 0; j < GS / 2; j++) {
                const int16_t *wj = wg + j * NBT * 16;
                __m256i wv[TILE_BLOCKS];
                for (int i = 0; i < NBT; i++) {
                    wv[i] = _mm256_load_si256((const __m256i *)(wj + i * 16));
                    __asm__("" : "+x"(wv[i]));  /* one load per k pair, not one per row */
                }
                for (int r = 0; r < MTT; r++) {
                    int32_t pair;
                    memcpy(&pair, xg + r * a->in + 2 * j, 4);
                    const __m256i xb = _mm256_set1_epi32(pair);
                    for (int i = 0; i < NBT; i++) {
                        acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(wv[i], xb));
                        __asm__("" : "+x"(acc[i][r]));
                    }
                }
            }
            for (int i = 0; i < NBT; i++) {
                const __m256 scale = _mm256_load_ps(scales + (((c - c0) * 2 + h) * NBT + i) * LANES);
                for (int r = 0; r < MTT; r++)
                    sum[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]),
                                                _mm256_mul_ps(scale, _mm256_set1_ps(a->dx[(r0 + r) * a->chunks + c])), sum[i][r]);
            }
        }
        if (offsets)
            for (int h = 0; h < CHUNK / GS; h++)
                for (int i = 0; i < NBT; i++) {
                    const __m256 offset = _mm256_load_ps(offsets + (((c - c0) * 2 + h) * NBT + i) * LANES);
                    for (int r = 0; r < MTT; r++) {
                        const float *xs = a->xsum + ((r0 + r) * a->chunks + c) * 2;
                        sum[i][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(GS == 16 ? xs[h] : xs[0] + xs[1]), sum[i][r]);
                    }
                }
    }
    for (int i = 0; i < NBT; i++)
        for (int r = 0; r < MTT; r++) {
            float *y = a->y + (r0 + r) * a->y_stride + (b + i) * LANES;
            _mm256_storeu_ps(y, c0 == 0 ? sum[i][r] : _mm256_add_ps(_mm256_loadu_ps(y), sum[i][r]));
        }
}

static inline __attribute__((always_inline)) void tiles(const Batch *a, const int16_t *w, const float *scales,
                                                        const float *offsets, int64_t b, int64_t c0, int64_t n,
                                                        const Ahead *ahead, const int NBT, const int GS) {
    ask_ahead(ahead, 0, 1);
    int64_t r = 0;
    for (; r + TILE_ROWS <= a->rows; r += TILE_ROWS) tile(a, w, scales, offsets, b, c0, n, r, NBT, TILE_ROWS, GS);
    if (a->rows - r == 2) tile(a, w, scales, offsets, b, c0, n, r, NBT, 2, GS);
    else if (a->rows - r == 1) tile(a, w, scales, offsets, b, c0, n, r, NBT, 1, GS);
}

#ifdef WIDE_ROWS
/* As tile, for rows r0 .. r0+MTT-1 of the slab's nb = 2 ZB lane blocks: a pair of blocks' k pair
   is one 512-bit load, and its scales and offsets, and its outputs, 16 consecutive floats. */
static inline __attribute__((always_inline)) void tile_wide(const Batch *a, const int16_t *w, const float *scales,
                                                            const float *offsets, int64_t b, int64_t c0, int64_t n,
                                                            int64_t r0, const int ZB, const int MTT, const int GS,
                                                            const int SPAN) {
    const int nb = 2 * ZB;
    const int16_t *x0 = a->x + r0 * a->in;
    __m512 sum[2][WIDE_ROWS];
    for (int i = 0; i < ZB; i++)
        for (int r = 0; r < MTT; r++) sum[i][r] = _mm512_setzero_ps();
    for (int64_t c = c0; c < c0 + n; c += SPAN) {
        for (int h = 0; h < CHUNK / GS; h++) {
            __m512i acc[2][WIDE_ROWS];
            for (int i = 0; i < ZB; i++)
                for (int r = 0; r < MTT; r++) acc[i][r] = _mm512_setzero_si512();
            /* SPAN chunks (GS 32) summed in int32: their factor and dx are the same (int32_span) */
            for (int s = 0; s < SPAN; s++) {
                const int16_t *wg = w + ((c + s - c0) * PAIRS + h * GS / 2) * nb * 16, *xg = x0 + (c + s) * CHUNK + h * GS;
                _Pragma("GCC unroll 16")
                for (int j = 0; j < GS / 2; j++) {
                    __m512i wv[2];
                    for (int i = 0; i < ZB; i++) wv[i] = _mm512_load_si512((const void *)(wg + j * nb * 16 + i * 32));
                    for (int r = 0; r < MTT; r++) {
                        int32_t pair;
                        memcpy(&pair, xg + r * a->in + 2 * j, 4);
                        const __m512i xb = _mm512_set1_epi32(pair);
                        for (int i = 0; i < ZB; i++) acc[i][r] = _mm512_dpwssd_epi32(acc[i][r], wv[i], xb);
                    }
                }
            }
            for (int i = 0; i < ZB; i++) {
                const __m512 scale = _mm512_loadu_ps(scales + (((c - c0) * 2 + h) * nb + 2 * i) * LANES);
                for (int r = 0; r < MTT; r++)
                    sum[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][r]),
                                                _mm512_mul_ps(scale, _mm512_set1_ps(a->dx[(r0 + r) * a->chunks + c])), sum[i][r]);
            }
        }
        if (offsets) {
            /* the offsets' groups are the part's (16 or 32 wide) even where its scales are folded */
            const int halves = a->p->gs == 16;
            for (int s = 0; s < SPAN; s++)
                for (int h = 0; h <= halves; h++)
                    for (int i = 0; i < ZB; i++) {
                        const __m512 offset = _mm512_loadu_ps(offsets + (((c + s - c0) * 2 + h) * nb + 2 * i) * LANES);
                        for (int r = 0; r < MTT; r++) {
                            const float *xs = a->xsum + ((r0 + r) * a->chunks + c + s) * 2;
                            sum[i][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(halves ? xs[h] : xs[0] + xs[1]), sum[i][r]);
                        }
                    }
        }
    }
    for (int i = 0; i < ZB; i++)
        for (int r = 0; r < MTT; r++) {
            float *y = a->y + (r0 + r) * a->y_stride + (b + 2 * i) * LANES;
            _mm512_storeu_ps(y, c0 == 0 ? sum[i][r] : _mm512_add_ps(_mm512_loadu_ps(y), sum[i][r]));
        }
}

/* All rows in tiles of at most WIDE_ROWS, as even as they divide (32 rows: 6, 6, 5, 5, 5, 5). */
static inline __attribute__((always_inline)) void tiles_wide(const Batch *a, const int16_t *w, const float *scales,
                                                             const float *offsets, int64_t b, int64_t c0, int64_t n,
                                                             const Ahead *ahead, const int ZB, const int GS, const int SPAN) {
    const int64_t count = (a->rows + WIDE_ROWS - 1) / WIDE_ROWS;
    for (int64_t t = 0, r = 0; t < count; t++) {
        ask_ahead(ahead, t, count);
        const int64_t rows = a->rows * (t + 1) / count - a->rows * t / count;
        switch (rows) {
            #define ROWS(M) case M: tile_wide(a, w, scales, offsets, b, c0, n, r, ZB, M, GS, SPAN); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
            #undef ROWS
        }
        r += rows;
    }
}
#endif

/* Lane blocks b .. b+nb-1's scales and offsets, every group of their rows (none past the part). */
static void prefetch_factors(const Batch *a, int64_t b, int nb) {
    const Part *p = a->p;
    const int64_t g = a->groups * LANES, su = a->supers * LANES;
    if (b >= p->blocks) return;
    if (b + nb > p->blocks) nb = (int)(p->blocks - b);
    if (p->sc) prefetch_bytes(p->sc + b * g, nb * g);
    if (p->mn) prefetch_bytes(p->mn + b * g, nb * g);
    prefetch_bytes(p->d + b * su, nb * su * 2);
    if (p->dm) prefetch_bytes(p->dm + b * su, nb * su * 2);
}

/* Lane blocks b .. b+nb-1 (nb <= SLAB_BLOCKS), all rows, slab by slab. */
static void blocks(const Batch *a, int64_t b, int nb) {
    prefetch_factors(a, b, nb);
    int16_t w[SLAB * PAIRS * SLAB_BLOCKS * 16] __attribute__((aligned(64)));
    float scales[SLAB * 2 * SLAB_BLOCKS * LANES] __attribute__((aligned(64)));
    float offsets[SLAB * 2 * SLAB_BLOCKS * LANES] __attribute__((aligned(64)));
    const Part *p = a->p;
    const int gs = (int)p->gs, per_chunk = CHUNK / gs;  /* groups a chunk holds */
#ifdef UNPACK_PAIRS
    const int fold = p->span > 0 && nb % 2 == 0;
#else
    const int fold = 0;
#endif
    for (int64_t c0 = 0; c0 < a->chunks; c0 += SLAB) {
        const int64_t n = a->chunks - c0 < SLAB ? a->chunks - c0 : SLAB;
        unpack(a, b, nb, c0, n, w, fold);
        /* after the last slab, the next blocks: units are handed out 8 blocks at a time, so this
           thread most often takes them */
        Ahead ahead;
        if (c0 + SLAB < a->chunks) {
            ahead = ahead_of(a, b, nb, c0 + SLAB, a->chunks - c0 - SLAB < SLAB ? a->chunks - c0 - SLAB : SLAB);
        } else {
            ahead = ahead_of(a, b + nb, nb, 0, a->chunks < SLAB ? a->chunks : SLAB);
            prefetch_factors(a, b + nb, nb);
        }
        /* the scale and the offset of chunk c's group h at (((c - c0) * 2 + h) * nb + i) * LANES
           in scales and offsets */
        for (int i = 0; i < nb; i++) {
            /* folded: each group's scale is its super-block's d (sc is in the weights) */
            group_factors(a, p->d, fold ? NULL : p->sc, b + i, c0 * per_chunk, n * per_chunk, scales + i * LANES, 2 / per_chunk * nb * LANES);
            if (p->dm) group_factors(a, p->dm, p->mn, b + i, c0 * per_chunk, n * per_chunk, offsets + i * LANES, 2 / per_chunk * nb * LANES);
        }
        const float *o = p->dm ? offsets : NULL;
#ifdef WIDE_ROWS
        if (fold) {
            /* a folded chunk is one group (GS 32) however the file groups it */
            #define SPANS(ZB) switch (p->span) { \
                case 4: tiles_wide(a, w, scales, o, b, c0, n, &ahead, ZB, 32, 4); break; \
                case 2: tiles_wide(a, w, scales, o, b, c0, n, &ahead, ZB, 32, 2); break; \
                default: tiles_wide(a, w, scales, o, b, c0, n, &ahead, ZB, 32, 1); }
            if (nb == 4) { SPANS(2) } else { SPANS(1) }
            #undef SPANS
            continue;
        }
        if (nb == 4) { if (gs == 16) tiles_wide(a, w, scales, o, b, c0, n, &ahead, 2, 16, 1); else tiles_wide(a, w, scales, o, b, c0, n, &ahead, 2, 32, 1); continue; }
        if (nb == 2) { if (gs == 16) tiles_wide(a, w, scales, o, b, c0, n, &ahead, 1, 16, 1); else tiles_wide(a, w, scales, o, b, c0, n, &ahead, 1, 32, 1); continue; }
#endif
        if (nb == 2) { if (gs == 16) tiles(a, w, scales, o, b, c0, n, &ahead, 2, 16); else tiles(a, w, scales, o, b, c0, n, &ahead, 2, 32); }
        else         { if (gs == 16) tiles(a, w, scales, o, b, c0, n, &ahead, 1, 16); else tiles(a, w, scales, o, b, c0, n, &ahead, 1, 32); }
    }
}

/* Lane blocks b .. b+count-1 (count <= SLAB_BLOCKS) in slabs the tiles take whole: 4 (with
   AVX-512), 2 or 1 blocks. */
static void unit(const Batch *a, int64_t b, int64_t count) {
    while (count > 0) {
        const int nb = count >= SLAB_BLOCKS ? SLAB_BLOCKS : count >= 2 ? 2 : 1;
        blocks(a, b, nb);
        b += nb, count -= nb;
    }
}

/* Each row of x [rows, in] (stride x_stride) as int16, for parts that sum spans (`spans`) per
   SPAN_VALUES values, else per 32: xq = round(x / dx) (to nearest even, as lrintf), dx = max|x| /
   X_LIMIT (/ 32767 per 32), kept once per chunk; xsum the float sums of each 16 (for the offsets). */
static void quantize_rows(const float *x, int64_t rows, int64_t x_stride, int64_t in, int spans,
                          int16_t *xq, float *dx, float *xsum) {
    const int64_t chunks = in / CHUNK, span = spans ? SPAN_VALUES / CHUNK : 1;
    const float limit = span > 1 ? (float)X_LIMIT : 32767.0f;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    #pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
    for (int64_t s = 0; s < chunks / span; s++) {
        const float *v = x + r * x_stride + s * span * CHUNK;
        __m256 amax = _mm256_setzero_ps();
        for (int64_t i = 0; i < span * CHUNK; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
        float lanes[8], largest = 0.0f;
        _mm256_storeu_ps(lanes, amax);
        for (int i = 0; i < 8; i++) largest = lanes[i] > largest ? lanes[i] : largest;
        const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? limit / largest : 0.0f);
        for (int64_t c = s * span; c < (s + 1) * span; c++) {
            const float *w = x + r * x_stride + c * CHUNK;
            __m256 part[4];
            for (int i = 0; i < 4; i++) part[i] = _mm256_loadu_ps(w + 8 * i);
            for (int i = 0; i < 4; i += 2) {
                const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse)),
                                                          _mm256_cvtps_epi32(_mm256_mul_ps(part[i + 1], inverse)));
                _mm256_storeu_si256((__m256i *)(xq + r * in + c * CHUNK + 8 * i), _mm256_permute4x64_epi64(packed, 0xD8));
            }
            for (int h = 0; h < 2; h++) {
                _mm256_storeu_ps(lanes, _mm256_add_ps(part[2 * h], part[2 * h + 1]));
                float total = 0.0f;
                for (int i = 0; i < 8; i++) total += lanes[i];
                xsum[(r * chunks + c) * 2 + h] = total;
            }
            dx[r * chunks + c] = largest / limit;
        }
    }
}

int qlinear_batch_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, const Scratch *scratch,
                            const Part *parts, int64_t num_parts, float *y, int64_t y_stride) {
    int16_t *xq = (int16_t *)scratch->xq;  /* two levels' room: rows x in int16 */
    /* the coarser rounding only where a part gains from it (matrix.py gives spans only to rows
       that divide into SPAN_VALUES): a Q4_1 SmolLM2 per 128 agreed on 99.84% of tokens, per 32 100% */
    int spans = 0;
    for (int64_t k = 0; k < num_parts; k++) spans |= parts[k].span > 0;
    quantize_rows(x, rows, x_stride, in, spans, xq, scratch->dx, scratch->xsum);
    /* A pass over the weights serves at most PASS_ROWS rows (split evenly): a prefill's thousand
       rows read their x from memory once per lane-block pair, and 1,376 rows took 1.2-1.4x the
       time they take in passes of 128 (A/B on Zen 3, in 2,048 and 8,192; 32-256 rows a pass
       tried: fewer rows unpack the weights more often, more spill out of L2). */
    const int64_t chunks = in / CHUNK, passes = (rows + PASS_ROWS - 1) / PASS_ROWS;
    for (int64_t pass = 0; pass < passes; pass++) {
        const int64_t r0 = rows * pass / passes, n = rows * (pass + 1) / passes - r0;
        for (int64_t k = 0; k < num_parts; k++) {
            const Part *p = &parts[k];
            const Batch a = {xq + r0 * in, scratch->dx + r0 * chunks, scratch->xsum + r0 * chunks * 2, in, chunks, n, p,
                             in / p->gs, in / p->gs / p->sg, y + r0 * y_stride + p->column, y_stride};
            const int64_t units = (p->blocks + SLAB_BLOCKS - 1) / SLAB_BLOCKS;
            /* Handed out 8 blocks at a time, not in two fixed halves: on a shared host one core
               often runs slower for a while, and the other then waited at the barrier (~10% of
               the time in libgomp at 32 rows; a decode step's matmuls 1.05-1.07x faster in two of three
               A/B runs, level in the third). */
            #pragma omp for schedule(dynamic, 8 / SLAB_BLOCKS)
            for (int64_t i = 0; i < units; i++) {
                const int64_t b = i * SLAB_BLOCKS;
                unit(&a, b, p->blocks - b < SLAB_BLOCKS ? p->blocks - b : SLAB_BLOCKS);
            }
        }
    }
    return 1;
}

#else

int qlinear_batch_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, const Scratch *scratch,
                            const Part *parts, int64_t num_parts, float *y, int64_t y_stride) {
    (void)x; (void)rows; (void)x_stride; (void)in; (void)scratch; (void)parts; (void)num_parts; (void)y; (void)y_stride;
    return 0;  /* no AVX2: qmatmul.c's loops serve every batch */
}

#endif
