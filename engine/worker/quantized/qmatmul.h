/* What qmatmul.c offers the other native loops (decode_layers.c). */
#include <stdint.h>

/* One quantized matrix of a linear layer (laid out as qmatmul.c describes): its part of the
   output starts at column `column`. */
typedef struct {
    const uint8_t *q; const _Float16 *d; const _Float16 *dm; const int8_t *sc; const int8_t *mn;
    int64_t gs, sg, nibbles, blocks, column;
} Part;

#define LANES 8   /* output features a block of quants holds; a part may write this far past its columns */
#define CHUNK 32  /* activations are quantized per this many values */

void qlinear_in_region(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t levels,
                       int8_t *xq, float *dx, float *xsum, const Part *parts, int64_t num_parts,
                       float *y, int64_t y_stride);
