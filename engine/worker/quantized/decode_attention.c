/* Attention for decoding sequences on a CPU in float32: each query head over its sequence's keys,
   read in place through the block table from the paged cache, with the softmax taken block by
   block (a running maximum and sum, the output rescaled when the maximum grows), so nothing is
   gathered and no scores are kept.

   Why: a batch of 32 decoding chats spent 31% of its step in torch's attention on the embedded
   SmolLM2 (58.6 of 190 ms; 70 of 711 on the 1B) though the arithmetic is ~2% of the step's: a
   dozen small ops a layer (gathers of each chat's own blocks, batched matmuls of 4 x 64 x 48, a
   softmax over a concatenation), each with its dispatch and its copy.

   Cache layout (LlamaModel.kv_cache_shape, as decode_layers.c reads it): a layer's K of block b,
   kv head j, offset o starts at k_cache + b * block_stride + (j * block_size + o) * head_dim; V the
   same from v_cache. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qmatmul.h"

void attend_kv_head(const float *q, int64_t rep, const float *k_cache, const float *v_cache,
                    const int32_t *block_table, int64_t context, int64_t kv_head, int64_t dim,
                    int64_t block_size, int64_t block_stride, float scale, float *out) {
    float top[rep], total[rep], scores[block_size];
    for (int64_t r = 0; r < rep; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
        memset(out + r * dim, 0, dim * sizeof(float));
    }
    for (int64_t start = 0; start < context; start += block_size) {
        const int64_t n = context - start < block_size ? context - start : block_size;
        const int64_t at = block_table[start / block_size] * block_stride + kv_head * block_size * dim;
        const float *k = k_cache + at, *v = v_cache + at;
        for (int64_t r = 0; r < rep; r++) {  /* the block's K and V stay in L1 for the kv head's query heads */
            const float *query = q + r * dim;
            float *o = out + r * dim, block_top = -INFINITY;
            for (int64_t t = 0; t < n; t++) {
                scores[t] = dot(query, k + t * dim, dim) * scale;
                block_top = fmaxf(block_top, scores[t]);
            }
            if (block_top > top[r]) {  /* the sums so far, rescaled to the new maximum */
                const float rescale = expf(top[r] - block_top);
                total[r] *= rescale;
                for (int64_t i = 0; i < dim; i++) o[i] *= rescale;
                top[r] = block_top;
            }
            for (int64_t t = 0; t < n; t++) {
                const float weight = expf(scores[t] - top[r]), *value = v + t * dim;
                total[r] += weight;
                for (int64_t i = 0; i < dim; i++) o[i] += weight * value[i];
            }
        }
    }
    for (int64_t r = 0; r < rep; r++)
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] /= total[r];
}

/* Sequence s's query heads (q + s * q_stride, heads x dim) over its contexts[s] keys through its
   block table (block_tables + s * table_stride), into out + s * out_stride; grouped query heads:
   head h reads kv head h / (heads / kv_heads). */
void decode_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride, const float *k_cache,
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
