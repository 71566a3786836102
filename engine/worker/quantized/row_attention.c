/* Attention for decoding sequences on a CPU in float32: each query head over its sequence's keys,
   read in place through the block table from the paged cache, with the softmax taken block by
   block (a running maximum and sum, the output rescaled when the maximum grows), so nothing is
   gathered and no scores are kept.

   Why: a batch of 32 decoding chats spent 31% of its step in torch's attention on the embedded
   SmolLM2 (58.6 of 190 ms; 70 of 711 on the 1B) though the arithmetic is ~2% of the step's: a
   dozen small ops a layer (gathers of each chat's own blocks, batched matmuls of 4 x 64 x 48, a
   softmax over a concatenation), each with its dispatch and its copy.

   Cache layout (LlamaModel.kv_cache_shape, as native_layers.c reads it): a layer's K of block b,
   kv head j, offset o starts at k_cache + b * block_stride + (j * block_size + o) * head_dim; V the
   same from v_cache. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>

/* q . k_t for the 8 rows k_t = k + t * dim, dim a multiple of 8: one vector (8 sums, then a
   transposing reduction), where 8 separate dot products each ended in a horizontal sum. */
static inline __m256 dot8(const float *q, const float *k, int64_t dim) {
    __m256 s[8];
    for (int t = 0; t < 8; t++) s[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; t++) s[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * dim + d), s[t]);
    }
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

/* Query r's scores against the block's first n keys (k: the block's rows, block_size of them),
   scaled, into scores; returns their maximum. */
static inline float block_scores(const float *query, const float *k, int64_t n, int64_t block_size, int64_t dim,
                                 float scale, float *scores) {
    /* maxima by comparison, not fmaxf: without -ffast-math gcc calls libm's for each (its NaN
       rule), which was most of the attention's time in a 32-chat step (Zen 5) */
    float top = -INFINITY;
    int64_t t = 0;
#ifdef __AVX2__
    if (dim % 8 == 0) {  /* 8 keys at a time while the block holds 8 rows (past n: masked out) */
        __m256 tops = _mm256_set1_ps(-INFINITY);
        for (; t < n && t + 8 <= block_size; t += 8) {
            const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(n - t)), _CMP_LT_OQ);
            const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                              _mm256_mul_ps(dot8(query, k + t * dim, dim), _mm256_set1_ps(scale)), valid);
            _mm256_storeu_ps(scores + t, v);
            tops = _mm256_max_ps(tops, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, tops);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    }
#endif
    for (; t < n; t++) {
        scores[t] = dot(query, k + t * dim, dim) * scale;
        top = scores[t] > top ? scores[t] : top;
    }
    return top;
}

/* weights[t] = e^(scores[t] - top) for t < n; returns their sum. */
static inline float block_weights(const float *scores, int64_t n, float top, float *weights) {
    float total = 0.0f;
    int64_t t = 0;
#ifdef __AVX2__
    for (; t + 8 <= n; t += 8) {
        const __m256 w = exp_negative(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(weights + t, w);
        float lanes[8];
        _mm256_storeu_ps(lanes, w);
        for (int i = 0; i < 8; i++) total += lanes[i];
    }
#endif
    for (; t < n; t++) total += weights[t] = expf(scores[t] - top);
    return total;
}

/* o += the sum over t < n of weights[t] * v_t (v_t = v + t * dim). */
static inline void add_weighted(float *o, const float *v, const float *weights, int64_t n, int64_t dim) {
    int64_t i = 0;
#ifdef __AVX2__
    /* 64 of o's columns at a time in registers over the block's rows: kept in memory, each row's
       sums waited on the last row's stores (46% of the time in the plain loop) */
    for (; i + 64 <= dim; i += 64) {
        __m256 sum[8];
        for (int j = 0; j < 8; j++) sum[j] = _mm256_loadu_ps(o + i + 8 * j);
        for (int64_t t = 0; t < n; t++) {
            const __m256 weight = _mm256_set1_ps(weights[t]);
            for (int j = 0; j < 8; j++) sum[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + t * dim + i + 8 * j), sum[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + i + 8 * j, sum[j]);
    }
#endif
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = i; c < dim; c++) o[c] += weights[t] * v[t * dim + c];
}

/* The online softmax's state of `rep` query heads: top (the largest score so far), total (the sum
   of e^(score - top)) and out (the values weighted alike, [rep, dim]); set empty, or divided out. */
void attend_start(int64_t rep, int64_t dim, float *top, float *total, float *out) {
    for (int64_t r = 0; r < rep; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
        memset(out + r * dim, 0, dim * sizeof(float));
    }
}

void attend_finish(int64_t rep, int64_t dim, const float *total, float *out) {
    for (int64_t r = 0; r < rep; r++)
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] /= total[r];
}

#ifdef __AVX512F__
/* The wide path (AVX-512, head dims 64 and 128, blocks of a multiple of 16 keys): 16 keys at a
   time for all `rep` query heads, the scores in one register per head (each K row loaded from L1
   once per head), and the values summed into up to 4 heads' outputs held in registers (each V
   row loaded once for them). The narrow path above takes each query head through a block on its
   own, in 8-wide vectors, with its weights summed one by one: ~11% of the FMA rate from memory,
   ~21% from L2 (Zen 5). Here: 1.2-1.3x its speed from L2, and with the next 16 keys' K and V
   asked for ahead, 1.6-1.9x from memory (32 chats x 280 keys, one layer, 2 threads: 1.43-1.66 ->
   0.87-0.90 ms; asking 32 keys ahead: the same); a 32-chat decode step of the 1B Q4_K_M
   1.03-1.06x faster. */

/* e^x for x <= 0, 16 at a time: exp_negative on each half. */
static inline __m512 exp_negative16(__m512 x) {
    const __m256 low = exp_negative(_mm512_castps512_ps256(x));
    const __m256 high = exp_negative(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

/* a + b's two 256-bit halves interleaved by 128-bit lanes: the first step of summing 16 vectors'
   lanes at once (a transposing reduction: 45 shuffles and adds for 16 sums) */
static inline __m512 fold(__m512 a, __m512 b, const int lo, const int hi) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, lo), _mm512_shuffle_f32x4(a, b, hi));
}

/* q . k_t for the 16 keys t (rows of k, DIM floats each), key t in lane t. */
static inline __attribute__((always_inline)) __m512 scores16(const float *q, const float *k, const int DIM) {
    __m512 qv[8], p[16];  /* DIM <= 128 */
    for (int c = 0; c < DIM / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    /* slot i takes key (i % 4) * 4 + i / 4: the reduction below leaves slot i's sum in lane
       4 (i % 4) + i / 4, so each key's sum lands in its own lane */
    for (int i = 0; i < 16; i++) {
        const float *row = k + ((i % 4) * 4 + i / 4) * DIM;
        p[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
        for (int c = 1; c < DIM / 16; c++) p[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), p[i]);
    }
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = fold(p[2 * i], p[2 * i + 1], 0x44, 0xEE);   /* 128-bit lanes 0,1: slot 2i; 2,3: 2i+1 */
    for (int j = 0; j < 4; j++) b[j] = fold(a[2 * j], a[2 * j + 1], 0x88, 0xDD);   /* lane l: slot 4j + l */
    const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))));
}

/* out[r] (DIM floats, r < RG) = out[r] * rescale[r] + the sum over t < n of weights[r][t] * v_t,
   the outputs in registers over the keys. */
static inline __attribute__((always_inline)) void add_weighted16(float *out, const float *v, const float *weights,
                                                                 const float *rescale, int64_t n, const int RG, const int DIM) {
    __m512 o[4][8];  /* RG x DIM / 16 <= 16 used */
    for (int r = 0; r < RG; r++)
        for (int c = 0; c < DIM / 16; c++) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * DIM + 16 * c), _mm512_set1_ps(rescale[r]));
    for (int64_t t = 0; t < n; t++) {
        __m512 row[8];
        for (int c = 0; c < DIM / 16; c++) row[c] = _mm512_loadu_ps(v + t * DIM + 16 * c);
        for (int r = 0; r < RG; r++) {
            const __m512 w = _mm512_set1_ps(weights[r * 16 + t]);
            for (int c = 0; c < DIM / 16; c++) o[r][c] = _mm512_fmadd_ps(w, row[c], o[r][c]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int c = 0; c < DIM / 16; c++) _mm512_storeu_ps(out + r * DIM + 16 * c, o[r][c]);
}

static inline __attribute__((always_inline)) void attend_blocks16(
        const float *q, int64_t rep, const float *k_cache, const float *v_cache, const int32_t *block_table,
        int64_t first_block, int64_t context, int64_t kv_head, int64_t block_size, int64_t block_stride, float scale,
        float *top, float *total, float *out, const int DIM) {
    float weights[rep * 16], rescale[rep];
    /* the output registers of RG heads: 16 vectors of sums */
    const int RG = DIM == 64 ? 4 : 2;
    for (int64_t start = first_block * block_size; start < context; start += 16) {
        const int64_t n = context - start < 16 ? context - start : 16;
        const int64_t at = block_table[start / block_size] * block_stride + (kv_head * block_size + start % block_size) * DIM;
        const float *k = k_cache + at, *v = v_cache + at;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        if (start + 16 < context) {  /* the next 16 keys' rows, asked for while these are summed */
            const int64_t next = start + 16;
            const int64_t to = block_table[next / block_size] * block_stride + (kv_head * block_size + next % block_size) * DIM;
            for (int64_t line = 0; line < 16 * DIM * 4; line += 64) {
                __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)(k_cache + to) + line)));
                __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)(v_cache + to) + line)));
            }
        }
        for (int64_t r = 0; r < rep; r++) {
            /* keys past n (the block's unwritten rows) score -inf: weight 0, and their V rows are not read */
            const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, scores16(q + r * DIM, k, DIM), _mm512_set1_ps(scale));
            const float block_top = _mm512_reduce_max_ps(s);
            rescale[r] = 1.0f;
            if (block_top > top[r]) {  /* the sums so far, rescaled to the new maximum */
                rescale[r] = expf(top[r] - block_top);
                total[r] *= rescale[r];
                top[r] = block_top;
            }
            const __m512 w = exp_negative16(_mm512_sub_ps(s, _mm512_set1_ps(top[r])));
            total[r] += _mm512_reduce_add_ps(w);
            _mm512_storeu_ps(weights + r * 16, w);
        }
        int64_t r = 0;
        for (; r + RG <= rep; r += RG) add_weighted16(out + r * DIM, v, weights + r * 16, rescale + r, n, RG, DIM);
        for (; r < rep; r++) add_weighted16(out + r * DIM, v, weights + r * 16, rescale + r, n, 1, DIM);
    }
}
#endif

void attend_blocks(const float *q, int64_t rep, const float *k_cache, const float *v_cache,
                   const int32_t *block_table, int64_t first_block, int64_t context, int64_t kv_head, int64_t dim,
                   int64_t block_size, int64_t block_stride, float scale, float *top, float *total, float *out) {
#ifdef __AVX512F__
    if (block_size % 16 == 0 && (dim == 64 || dim == 128)) {
        if (dim == 64) attend_blocks16(q, rep, k_cache, v_cache, block_table, first_block, context, kv_head, block_size,
                                       block_stride, scale, top, total, out, 64);
        else attend_blocks16(q, rep, k_cache, v_cache, block_table, first_block, context, kv_head, block_size,
                             block_stride, scale, top, total, out, 128);
        return;
    }
#endif
    float scores[block_size + 8], weights[block_size + 8];
    for (int64_t start = first_block * block_size; start < context; start += block_size) {
        const int64_t n = context - start < block_size ? context - start : block_size;
        const int64_t at = block_table[start / block_size] * block_stride + kv_head * block_size * dim;
        const float *k = k_cache + at, *v = v_cache + at;
        for (int64_t r = 0; r < rep; r++) {  /* the block's K and V stay in L1 for the kv head's query heads */
            float *o = out + r * dim;
            const float block_top = block_scores(q + r * dim, k, n, block_size, dim, scale, scores);
            if (block_top > top[r]) {  /* the sums so far, rescaled to the new maximum */
                const float rescale = expf(top[r] - block_top);
                total[r] *= rescale;
                for (int64_t i = 0; i < dim; i++) o[i] *= rescale;
                top[r] = block_top;
            }
            total[r] += block_weights(scores, n, top[r], weights);
            add_weighted(o, v, weights, n, dim);
        }
    }
}

void attend_kv_head(const float *q, int64_t rep, const float *k_cache, const float *v_cache,
                    const int32_t *block_table, int64_t context, int64_t kv_head, int64_t dim,
                    int64_t block_size, int64_t block_stride, float scale, float *out) {
    float top[rep], total[rep];
    attend_start(rep, dim, top, total, out);
    attend_blocks(q, rep, k_cache, v_cache, block_table, 0, context, kv_head, dim, block_size, block_stride, scale,
                  top, total, out);
    attend_finish(rep, dim, total, out);
}

/* Sequence s's query heads (q + s * q_stride, heads x dim) over its contexts[s] keys through its
   block table (block_tables + s * table_stride), into out + s * out_stride; grouped query heads:
   head h reads kv head h / (heads / kv_heads). The engine's layers (native_layers.c) call the
   functions above themselves, inside their own parallel region; this entry, with its own region,
   is how tests/test_row_attention_c.py holds the kernel to kernels/reference.py. */
void row_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride, const float *k_cache,
                      const float *v_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *contexts,
                      int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      int64_t block_stride, float scale) {
    const int64_t rep = heads / kv_heads;
    #pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t s = 0; s < seqs; s++)
        for (int64_t j = 0; j < kv_heads; j++)
            attend_kv_head(q + s * q_stride + j * rep * dim, rep, k_cache, v_cache, block_tables + s * table_stride,
                           contexts[s], j, dim, block_size, block_stride, scale, out + s * out_stride + j * rep * dim);
}
