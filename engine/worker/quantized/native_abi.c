/* The library's own account of native_abi.h as this compiler laid it out: every shared structure's
   size and each field's offset and size, and the shared constants' values. The loader
   (native_abi.py) compares them with its ctypes declarations before it calls anything, so a field
   added, removed or moved on one side only refuses the library rather than corrupting memory.
   A structure's fields are listed in the header's order, each once; a field missing here leaves a
   gap in the structure the loader reports. */
#include <stddef.h>
#include <stdint.h>

#include "native_abi.h"

typedef struct {
    const char *structure, *field;  /* field NULL: the row gives the structure's size */
    int64_t offset, size;
} FieldRow;

typedef struct {
    const char *name;
    int64_t value;
} ConstantRow;

#define SIZE(S) {#S, NULL, 0, sizeof(S)}
#define FIELD(S, F) {#S, #F, offsetof(S, F), sizeof(((S *)0)->F)}

static const FieldRow fields[] = {
    SIZE(Part), FIELD(Part, q), FIELD(Part, d), FIELD(Part, dm), FIELD(Part, sc), FIELD(Part, mn), FIELD(Part, table),
    FIELD(Part, gs), FIELD(Part, sg), FIELD(Part, bits), FIELD(Part, shift), FIELD(Part, blocks),
    FIELD(Part, column), FIELD(Part, span),

    SIZE(Scratch), FIELD(Scratch, xq), FIELD(Scratch, dx), FIELD(Scratch, xsum), FIELD(Scratch, xqsum),

    SIZE(Layer), FIELD(Layer, input_norm), FIELD(Layer, post_norm), FIELD(Layer, qkv), FIELD(Layer, qkv_parts),
    FIELD(Layer, qkv_bias), FIELD(Layer, o), FIELD(Layer, o_parts), FIELD(Layer, gate_up),
    FIELD(Layer, gate_up_parts), FIELD(Layer, down), FIELD(Layer, down_parts), FIELD(Layer, k_cache),
    FIELD(Layer, v_cache),

    SIZE(Step), FIELD(Step, hidden), FIELD(Step, heads), FIELD(Step, kv_heads), FIELD(Step, head_dim),
    FIELD(Step, ffn), FIELD(Step, levels), FIELD(Step, eps), FIELD(Step, scale), FIELD(Step, block_size),
    FIELD(Step, block_stride), FIELD(Step, rows), FIELD(Step, cos_sin), FIELD(Step, slots),
    FIELD(Step, block_tables), FIELD(Step, table_stride), FIELD(Step, contexts), FIELD(Step, shared_blocks),
    FIELD(Step, softmax), FIELD(Step, scratch), FIELD(Step, x), FIELD(Step, qkv), FIELD(Step, attn),
    FIELD(Step, delta), FIELD(Step, gate_up), FIELD(Step, x_stride), FIELD(Step, qkv_stride),
    FIELD(Step, attn_stride), FIELD(Step, delta_stride), FIELD(Step, gate_up_stride), FIELD(Step, final_norm),
    FIELD(Step, head), FIELD(Step, head_parts), FIELD(Step, logits), FIELD(Step, logits_stride),
};

static const ConstantRow constants[] = {
    {"LANES", LANES}, {"CHUNK", CHUNK}, {"SPAN_VALUES", SPAN_VALUES}, {"X_LIMIT", X_LIMIT},
    {"BATCH_ROWS", BATCH_ROWS},
};

/* The field rows (*rows) and how many there are. */
int64_t native_layout(const FieldRow **rows) {
    *rows = fields;
    return (int64_t)(sizeof(fields) / sizeof(fields[0]));
}

/* The constant rows (*rows) and how many there are. */
int64_t native_constants(const ConstantRow **rows) {
    *rows = constants;
    return (int64_t)(sizeof(constants) / sizeof(constants[0]));
}
