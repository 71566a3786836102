/* A batch of tokens, a row each with its own context (one new token for each of `rows` sequences:
   a lone chat's step, a busy server's batch of decodes; or a few tokens of a prompt, every row
   its K/V stored before any row attends) through every decoder layer of a Llama-family model whose
   weight matrices are kept quantized (qmatmul.c), in float32, in one call and one parallel region.
   Eager torch spent as long between the weight matmuls as in them for a lone chat (~10 small ops
   a layer at a few microseconds of dispatch each, and a Python call per matmul), and ~19% of a
   32-chat step of the embedded SmolLM2 (rotary, the cache store, residuals, silu-and-mul, norms).

   Per layer, as engine/worker/models/llama.py's forward computes it, for each row:
     x  = rms_norm(h) * input_norm;  qkv = x @ Wqkv.T (+ bias)
     q, k rotated (rotate-half, cos and signed sin of the token's position); k, v stored in the
     paged cache at the token's slot; each query head attends over its sequence's keys
     (grouped: head i reads kv head i / (heads / kv_heads)) through its block table
     h += attn @ Wo.T;  x = rms_norm(h) * post_norm;  [g, u] = x @ Wgu.T;  h += (silu(g) * u) @ Wd.T
   The sums run in another order than torch's, so results agree to float32 rounding, not bits.

   The attention is row_attention.c's, which describes the cache's layout. Layer and Step, which
   Python fills in, are native_abi.h's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

static void rms_norm(const float *h, const float *weight, int64_t n, float eps, float *out) {
    const float inverse = 1.0f / sqrtf(dot(h, h, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = h[i] * inverse * weight[i];
}

/* Each of `rows` rows of x (row stride x_stride) normalised into out [rows, n]: eager torch's
   fp32 rms_norm is ~8 small ops (~170 us for 32 rows of 576 on a 2-core EPYC, 61 calls a step of
   the embedded SmolLM2); as this one call each, the 32 chats' step spent ~13 ms less. */
void rms_norm_rows(const float *x, int64_t rows, int64_t x_stride, const float *weight, int64_t n, float eps, float *out) {
    #pragma omp parallel for schedule(static) if (rows * n > 1 << 18)
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * x_stride, weight, n, eps, out + r * n);
}

/* gu [2 * n]: its first half becomes silu(gate) * up, up its second half. Eight at a time (libm's
   expf one value at a time took ~2% of a 32-chat step of the 1B), from e^-|g| whichever g's sign:
   sigmoid(g) = 1 / (1 + e^-g) = e^g / (1 + e^g). */
static void silu_and_mul(float *gu, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i);
        const __m256 t = exp_negative(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(g, magnitude)));
        const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, t, g), _mm256_add_ps(one, t));  /* t where g < 0 */
        _mm256_storeu_ps(gu + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(gu + n + i)));
    }
#endif
    for (; i < n; i++) gu[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[n + i];
}

static void rotate(float *x, const float *cos_sin, int64_t dim) {
    float swapped[dim];
    const int64_t half = dim / 2;
    memcpy(swapped, x + half, half * sizeof(float));
    memcpy(swapped + half, x, half * sizeof(float));
    for (int64_t i = 0; i < dim; i++) x[i] = x[i] * cos_sin[i] + swapped[i] * cos_sin[dim + i];
}

/* Each row's query heads over its sequence's keys into s->attn. A lone token's heads one at a
   time (9 query heads share 2 threads better than 3 kv heads); a batch's by kv head, its query
   heads together (the block read once for the group). The blocks every sequence starts with (a
   shared system prompt: 13 of each chat's 17 blocks in the 32-chat benchmark) are read once for 16
   rows at a time rather than once per row, each row's softmax carried over into its own blocks:
   read per row, a layer's K and V came to ~35 MB for the 1B's 32 chats, from memory (the weights
   streamed between two layers' attention evict them). The embedded Q4_1's 32-chat decode ran
   1.04-1.2x faster this way in two alternations; the 1B's, whose step is 86% weight matmuls, level. */
static void attend_in_region(const Layer *l, const Step *s) {
    const int64_t rows = s->rows, dim = s->head_dim, group = s->heads / s->kv_heads;
    if (rows == 1 || s->shared_blocks == 0) {
        const int64_t rep = rows == 1 ? 1 : group, units = s->heads / rep;
        #pragma omp for collapse(2) schedule(dynamic)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t u = 0; u < units; u++)
                attend_kv_head(s->qkv + r * s->qkv_stride + u * rep * dim, rep, l->k_cache, l->v_cache,
                               s->block_tables + r * s->table_stride, s->contexts[r], u * rep / group, dim,
                               s->block_size, s->block_stride, s->scale, s->attn + r * s->attn_stride + u * rep * dim);
        return;
    }
    #define Q(r, j) (s->qkv + (r) * s->qkv_stride + (j) * group * dim)
    #define TOP(r, j) (s->softmax + (r) * 2 * s->heads + (j) * group)
    #define TOTAL(r, j) (TOP(r, j) + s->heads)
    #define OUT(r, j) (s->attn + (r) * s->attn_stride + (j) * group * dim)
    const int64_t band = 16, bands = (rows + band - 1) / band;
    #pragma omp for collapse(2) schedule(dynamic)
    for (int64_t j = 0; j < s->kv_heads; j++)
        for (int64_t g = 0; g < bands; g++) {
            const int64_t r0 = g * band, r1 = r0 + band < rows ? r0 + band : rows;
            for (int64_t r = r0; r < r1; r++) attend_start(group, dim, TOP(r, j), TOTAL(r, j), OUT(r, j));
            for (int64_t b = 0; b < s->shared_blocks; b++)
                for (int64_t r = r0; r < r1; r++)
                    attend_blocks(Q(r, j), group, l->k_cache, l->v_cache, s->block_tables + r * s->table_stride, b,
                                  (b + 1) * s->block_size, j, dim, s->block_size, s->block_stride, s->scale,
                                  TOP(r, j), TOTAL(r, j), OUT(r, j));
        }
    #pragma omp for collapse(2) schedule(dynamic)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < s->kv_heads; j++) {
            attend_blocks(Q(r, j), group, l->k_cache, l->v_cache, s->block_tables + r * s->table_stride,
                          s->shared_blocks, s->contexts[r], j, dim, s->block_size, s->block_stride, s->scale,
                          TOP(r, j), TOTAL(r, j), OUT(r, j));
            attend_finish(group, dim, TOTAL(r, j), OUT(r, j));
        }
    #undef Q
    #undef TOP
    #undef TOTAL
    #undef OUT
}

/* Inside the parallel region: every thread runs this, the rows, matmuls and heads shared among
   them; each `omp for` and `omp single` ends at a barrier. */
static void layer_in_region(float *h, const Layer *l, const Step *s) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim, rows = s->rows;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_norm(h + r * s->hidden, l->input_norm, s->hidden, s->eps, s->x + r * s->x_stride);
    qlinear_in_region(s->x, rows, s->x_stride, s->hidden, s->levels, &s->scratch, l->qkv, l->qkv_parts,
                      s->qkv, s->qkv_stride);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *qkv = s->qkv + r * s->qkv_stride;
        if (l->qkv_bias)
            for (int64_t i = 0; i < q_size + 2 * kv_size; i++) qkv[i] += l->qkv_bias[i];
        for (int64_t head = 0; head < s->heads + s->kv_heads; head++)  /* q's heads, then k's */
            rotate(qkv + head * s->head_dim, s->cos_sin + r * 2 * s->head_dim, s->head_dim);
        const int64_t block = s->slots[r] / s->block_size, offset = s->slots[r] % s->block_size;
        for (int64_t j = 0; j < s->kv_heads; j++) {
            const int64_t at = block * s->block_stride + (j * s->block_size + offset) * s->head_dim;
            memcpy(l->k_cache + at, qkv + q_size + j * s->head_dim, s->head_dim * sizeof(float));
            memcpy(l->v_cache + at, qkv + q_size + kv_size + j * s->head_dim, s->head_dim * sizeof(float));
        }
    }
    attend_in_region(l, s);
    qlinear_in_region(s->attn, rows, s->attn_stride, q_size, s->levels, &s->scratch, l->o, l->o_parts,
                      s->delta, s->delta_stride);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * s->hidden;
        const float *delta = s->delta + r * s->delta_stride;
        for (int64_t i = 0; i < s->hidden; i++) hr[i] += delta[i];
        rms_norm(hr, l->post_norm, s->hidden, s->eps, s->x + r * s->x_stride);
    }
    qlinear_in_region(s->x, rows, s->x_stride, s->hidden, s->levels, &s->scratch, l->gate_up,
                      l->gate_up_parts, s->gate_up, s->gate_up_stride);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_and_mul(s->gate_up + r * s->gate_up_stride, s->ffn);
    qlinear_in_region(s->gate_up, rows, s->gate_up_stride, s->ffn, s->levels, &s->scratch, l->down, l->down_parts,
                      s->delta, s->delta_stride);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < s->hidden; i++) h[r * s->hidden + i] += s->delta[r * s->delta_stride + i];
}

/* h [rows, hidden], the tokens' embeddings, becomes their hidden states after the last layer
   (before the final norm); every layer's K and V of the tokens are written into the cache; with
   s->head, s->logits gets each row's logits (a lone chat's head, the largest matrix of a small
   model, then streams inside the same region, not after a Python call and a region of its own). */
void layers_step(float *h, const Layer *layers, int64_t num_layers, Step *s) {
    /* the shared blocks: alike in every row's table and full in every row's context */
    int64_t shared = 0, fewest = s->contexts[0];
    for (int64_t r = 1; r < s->rows; r++) fewest = s->contexts[r] < fewest ? s->contexts[r] : fewest;
    for (; (shared + 1) * s->block_size <= fewest; shared++) {
        int64_t r = 1;
        while (r < s->rows && s->block_tables[r * s->table_stride + shared] == s->block_tables[shared]) r++;
        if (r < s->rows) break;
    }
    s->shared_blocks = s->rows > 1 ? shared : 0;
    #pragma omp parallel
    {
        for (int64_t i = 0; i < num_layers; i++) layer_in_region(h, &layers[i], s);
        if (s->head) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < s->rows; r++)
                rms_norm(h + r * s->hidden, s->final_norm, s->hidden, s->eps, s->x + r * s->x_stride);
            qlinear_in_region(s->x, s->rows, s->x_stride, s->hidden, s->levels, &s->scratch, s->head, s->head_parts,
                              s->logits, s->logits_stride);
        }
    }
}
