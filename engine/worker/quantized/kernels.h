/* What the C files share among themselves: vector helpers and the functions one calls in another.
   What they share with Python is native_abi.h. */
#ifndef PAGEDCHAT_KERNELS_H
#define PAGEDCHAT_KERNELS_H

#include <stdint.h>

#include "native_abi.h"

#ifdef __F16C__
#include <immintrin.h>
#else
#include <string.h>
#endif

/* An f16 factor's value, one at a time (the vector loops convert 8 with _mm256_cvtph_ps): F16C's
   conversion where the CPU has it, else from the bits' fields, exactly (a normal number's exponent
   rebiased from 15 to 127; a subnormal is its mantissa times 2^-24; infinities and NaNs keep their
   mantissa). */
static inline float half_to_float(half_bits h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
#endif
}

#ifdef __AVX2__
#include <immintrin.h>

/* A scale (d, sc) or an offset (dm, mn) of lane block b's group g, per lane: the f16 factor of
   its super-block (2^sg_shift groups; `supers` of them per output row) times the int8 factor of
   the group (when there is one; `groups` per row). */
static inline __m256 group_factor(const half_bits *per_super, const int8_t *per_group, int64_t b, int64_t g,
                                  int sg_shift, int64_t supers, int64_t groups) {
    /* a shift, not a division: a 64-bit divide per group was the 4-bit loop's largest cost */
    const int64_t s = (b * supers + (g >> sg_shift)) * LANES;
    __m256 factor = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(per_super + s)));
    if (per_group) {
        const __m128i small = _mm_loadl_epi64((const __m128i *)(per_group + (b * groups + g) * LANES));
        factor = _mm256_mul_ps(factor, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(small)));
    }
    return factor;
}

/* e^x for x <= 0, 8 at a time: Cephes' expf (x = n ln 2 + r, a degree-5 polynomial in r, 2^n
   built in the exponent bits), within ~2 ulp; below -87 (e^-87 ~ 1.6e-38) it gives 0. */
static inline __m256 exp_negative(__m256 x) {
    const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(_mm256_mul_ps(y, two_n), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

/* The top 2 bits of quad t's 6-bit quants, from where the layout keeps them (bits 2t, 2t + 1 of
   each byte) to bits 4 and 5 (16-bit shifts move bits across bytes: the mask drops those). */
static inline __m256i top_bits(__m256i packed, int t) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (t) {
        case 0: return _mm256_and_si256(_mm256_slli_epi16(packed, 4), mask);
        case 1: return _mm256_and_si256(_mm256_slli_epi16(packed, 2), mask);
        case 2: return _mm256_and_si256(packed, mask);
        default: return _mm256_and_si256(_mm256_srli_epi16(packed, 2), mask);
    }
}

/* The top bit of quad T's 5-bit quants, from where the layout keeps it (bit T of each byte of the
   plane) to bit 4 (as top_bits, the mask drops what a 16-bit shift moves across bytes). */
static inline __m256i fifth_bit(__m256i plane, int T) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(T <= 4 ? _mm256_slli_epi16(plane, 4 - T) : _mm256_srli_epi16(plane, T - 4), bit4);
}
#endif

void qlinear_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t levels,
                       const Scratch *scratch, const Part *parts, int64_t num_parts, float *y, int64_t y_stride);

/* Eight running sums, so that the compiler can keep them in one vector register (a single float
   sum is a chain of dependent adds it may not reorder). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float sums[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) sums[j] += a[i + j] * b[i + j];
    float total = 0.0f;
    for (; i < n; i++) total += a[i] * b[i];
    for (int j = 0; j < 8; j++) total += sums[j];
    return total;
}

/* row_attention.c: `rep` query heads (q [rep, dim]) that share kv head `kv_head` attend over the
   first `context` keys of a sequence, read through its block table from the paged cache; out
   [rep, dim]. */
void attend_kv_head(const float *q, int64_t rep, const float *k_cache, const float *v_cache,
                    const int32_t *block_table, int64_t context, int64_t kv_head, int64_t dim,
                    int64_t block_size, int64_t block_stride, float scale, float *out);
/* The same in parts, the softmax's running state (top, total [rep]; out) kept by the caller between
   them: attend_start empties it, attend_blocks takes the keys from block `first_block` up to
   `context`, attend_finish divides out the total. */
void attend_start(int64_t rep, int64_t dim, float *top, float *total, float *out);
void attend_blocks(const float *q, int64_t rep, const float *k_cache, const float *v_cache,
                   const int32_t *block_table, int64_t first_block, int64_t context, int64_t kv_head, int64_t dim,
                   int64_t block_size, int64_t block_stride, float scale, float *top, float *total, float *out);
void attend_finish(int64_t rep, int64_t dim, const float *total, float *out);

/* qmatmul_batch.c: the same product for a batch of rows, x carried in int16 (two levels' precision);
   returns 0, doing nothing, where it has no loops for this CPU. */
int qlinear_batch_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, const Scratch *scratch,
                            const Part *parts, int64_t num_parts, float *y, int64_t y_stride);

#endif
