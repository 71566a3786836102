/* What the native library shares with Python: the structures Python fills in and passes by
   address, and the constants Python's layout of the weights and activations counts on. ctypes
   declares the structures again (native_abi.py), and the loader compares them, field by field,
   with the offsets native_abi.c reports from this header: a field moved on one side only refuses
   the library instead of reading the wrong bytes. Python reads the constants from this file's text
   (native_abi.py says why); the library reports the values it was built with, which must agree.
   What the C files share only among themselves is kernels.h. */
#ifndef PAGEDCHAT_NATIVE_ABI_H
#define PAGEDCHAT_NATIVE_ABI_H

#include <stdint.h>

/* An f16 factor of the formats (d, dm), as its IEEE half-precision bits rather than _Float16,
   which GCC before 12 on x86 and some clang builds lack: the vector loops convert 8 at a time
   with F16C (_mm256_cvtph_ps), which reads bits anyway, and the one-lane loops one at a time
   (kernels.h's half_to_float), so no compiler needs the type. */
typedef uint16_t half_bits;

#define LANES 8  /* output features a block of quants holds; a part may write this far past its columns */
#define CHUNK 32  /* activations are quantized per this many values */
/* qmatmul_batch.c's activations share one int16 scale per SPAN_VALUES values (where a part's rows
   divide into them), rounded to at most X_LIMIT in magnitude: matrix.py's int32_span bounds the
   spans' int32 sums by it */
#define SPAN_VALUES 128
#define X_LIMIT 16383

#ifndef BATCH_ROWS
/* From this many rows (with two levels) qmatmul_batch.c's loops take a product, and x goes in as
   int16 rather than two int8 levels (a rounding Python's callers see): their tiles reuse each
   unpacked weight chunk across the rows, which pays from about 8 rows, while the int8 loops stay
   ahead at a few rows (benchmarks/quantized_matrix.py measures both). */
#define BATCH_ROWS 8
#endif

/* One quantized matrix of a linear layer (laid out as qmatmul.c describes): its quants' width
   (2, 3, 4, 5, 6 or 8 bits) and 3-, 5- or 6-bit shift, the 16 int8 values its 4-bit quants index
   (`table`; NULL: a quant is its own value), where its part of the output starts, `column`, and
   `span`: how many chunks' products qmatmul_batch.c may sum in int32 with the groups' integer
   factors sc multiplied into the weights (0: keep them apart; matrix.py works it out from the
   quants). */
typedef struct {
    const uint8_t *q; const half_bits *d; const half_bits *dm; const int8_t *sc; const int8_t *mn;
    const int8_t *table;
    int64_t gs, sg, bits, shift, blocks, column, span;
} Part;

/* Room for a row's activations as the loops quantize them, for rows x `in` values in `levels`
   levels: xq [levels, rows, in] int8, dx [levels, rows, in / 32], xsum [rows, in / 16],
   xqsum [levels, rows, in / 16] int32. */
typedef struct {
    int8_t *xq; float *dx; float *xsum; int32_t *xqsum;
} Scratch;

/* native_layers.c: one decoder layer's weights and its part of the paged cache. */
typedef struct {
    const float *input_norm, *post_norm;          /* [hidden] */
    const Part *qkv; int64_t qkv_parts; const float *qkv_bias;  /* bias [q + 2 kv] or NULL */
    const Part *o; int64_t o_parts;
    const Part *gate_up; int64_t gate_up_parts;   /* gate's ffn columns, then up's */
    const Part *down; int64_t down_parts;
    float *k_cache, *v_cache;                     /* this layer's K and V in block 0 */
} Layer;

/* native_layers.c: a step's shapes, its tokens and the room its layers work in. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, levels;
    float eps, scale;
    int64_t block_size, block_stride;
    int64_t rows;                  /* tokens (a sequence's several are rows with the same table) */
    const float *cos_sin;          /* [rows, 2, head_dim]: cos, then signed sin ([-sin, sin] by halves) */
    const int64_t *slots;          /* [rows]: each token's cache slot, block * block_size + offset */
    const int32_t *block_tables;   /* [rows, table_stride]: each sequence's blocks */
    int64_t table_stride;
    const int32_t *contexts;       /* [rows]: each sequence's keys, its token's included */
    int64_t shared_blocks;         /* set by layers_step: the leading blocks every sequence holds alike */
    float *softmax;                /* [rows, 2 * heads]: each query head's running maximum, then its sum */
    Scratch scratch;               /* for rows x the widest row: max(hidden, q heads' size, ffn) */
    /* [rows, stride] each, the stride its width plus LANES floats of room for a part's padding */
    float *x, *qkv, *attn, *delta, *gate_up;
    int64_t x_stride, qkv_stride, attn_stride, delta_stride, gate_up_stride;
    /* Where the output head is quantized too: the final norm's weight [hidden], the head's parts
       and the logits [rows, logits_stride] it writes; head NULL: the caller takes h from here. */
    const float *final_norm; const Part *head; int64_t head_parts;
    float *logits; int64_t logits_stride;
} Step;

#endif
