/* One row times a weight matrix kept in oneDNN's packed layout, read where it lies (packed_rows.py
   checks, weight by weight, that the layout is this one): blocks of 64 output features, each block
   holding every input, [N/64][K/2][64][2] in bf16 (each output's two consecutive inputs side by
   side, as AVX-512 BF16's dot product takes them) and [N/64][K][64] in fp32. A block's 64 sums
   stay in four vectors while its rows stream by in order, once.

   aoti_torch_cpu_packed_rows is what a compiled step's graph calls for the op
   pagedchat::packed_rows: its name and signature are those torch's C shims give an op
   (aoti_torch_<device>_<op>, tensors as handles, the result through the last pointer). */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define BLOCK 64

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline float bits_float(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }

static inline uint16_t bf16_of(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define STREAMS 4  /* blocks read side by side by one thread: one sequential stream each */

/* `n` (1..STREAMS) consecutive blocks, each `stride` elements apart, read side by side, and of
   each its vectors j0 .. j1 - 1 (16 output features a vector) into out. Four streams a thread
   read SmolLM2's matrices ~15% faster than one on a 2-core EPYC whose memory was busy with other
   work, and as fast when it was not. Always inlined, with n, j0 and j1 constants at each call,
   so that the sums stay in registers. */
static inline __attribute__((always_inline)) void blocks_bf16(const uint16_t *x, const uint16_t *w, int64_t stride,
                                                              int64_t pairs, int n, int j0, int j1, float *out) {
#if defined(__AVX512BF16__)
    __m512 acc[STREAMS][4];
    for (int s = 0; s < STREAMS; s++) for (int j = 0; j < 4; j++) acc[s][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        uint32_t pair; memcpy(&pair, x + 2 * p, 4);
        __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int s = 0; s < STREAMS; s++) {
            if (s == n) break;
            const uint16_t *row = w + s * stride + p * 2 * BLOCK;
            for (int j = j0; j < j1; j++)
                acc[s][j] = _mm512_dpbf16_ps(acc[s][j], xs, (__m512bh)_mm512_loadu_si512(row + 32 * j));
        }
    }
    for (int s = 0; s < n; s++) for (int j = j0; j < j1; j++) _mm512_storeu_ps(out + s * BLOCK + 16 * j, acc[s][j]);
#else
    /* A pair's even input is its low half: shifted up, it is that bf16 as an fp32; masked, the odd. */
    f32x16 acc[STREAMS][4] = {{{0}}};
    for (int64_t p = 0; p < pairs; p++) {
        uint32_t pair; memcpy(&pair, x + 2 * p, 4);
        float even = bits_float(pair << 16), odd = bits_float(pair & 0xffff0000u);
        for (int s = 0; s < n; s++) {
            const uint16_t *row = w + s * stride + p * 2 * BLOCK;
            for (int j = j0; j < j1; j++) {
                u32x16 u; memcpy(&u, row + 32 * j, 64);
                acc[s][j] += even * (f32x16)(u << 16) + odd * (f32x16)(u & 0xffff0000u);
            }
        }
    }
    for (int s = 0; s < n; s++) memcpy(out + s * BLOCK + 16 * j0, &acc[s][j0], (j1 - j0) * sizeof acc[s][0]);
#endif
}

static inline __attribute__((always_inline)) void blocks_f32(const float *x, const float *w, int64_t stride,
                                                             int64_t depth, int n, int j0, int j1, float *out) {
    f32x16 acc[STREAMS][4] = {{{0}}};
    for (int64_t k = 0; k < depth; k++) {
        for (int s = 0; s < STREAMS; s++) {
            if (s == n) break;
            const float *row = w + s * stride + k * BLOCK;
            for (int j = j0; j < j1; j++) {
                f32x16 v; memcpy(&v, row + 16 * j, 64);
                acc[s][j] += x[k] * v;
            }
        }
    }
    for (int s = 0; s < n; s++) memcpy(out + s * BLOCK + 16 * j0, &acc[s][j0], (j1 - j0) * sizeof acc[s][0]);
}

/* Blocks b .. b + n - 1, each block's vectors j0 .. j1 - 1, into y: all four vectors, or a half
   (0 .. 2 or 2 .. 4) of one block. */
static void some_blocks(const void *x, const void *w, void *y, int64_t stride, int64_t depth, int bf16, int64_t b,
                        int n, int j0, int j1) {
    float out[STREAMS * BLOCK];
    #define CALL(kernel, xs, ws) \
        if (j1 - j0 < 4 && j0 == 0) kernel(xs, ws, stride, depth, 1, 0, 2, out); \
        else if (j1 - j0 < 4) kernel(xs, ws, stride, depth, 1, 2, 4, out); \
        else if (n == 4) kernel(xs, ws, stride, depth, 4, 0, 4, out); \
        else if (n == 3) kernel(xs, ws, stride, depth, 3, 0, 4, out); \
        else if (n == 2) kernel(xs, ws, stride, depth, 2, 0, 4, out); \
        else kernel(xs, ws, stride, depth, 1, 0, 4, out);
    if (bf16) {
        CALL(blocks_bf16, (const uint16_t *)x, (const uint16_t *)w + b * stride)
        for (int s = 0; s < n; s++)
            for (int j = 16 * j0; j < 16 * j1; j++) ((uint16_t *)y)[(b + s) * BLOCK + j] = bf16_of(out[s * BLOCK + j]);
    } else {
        CALL(blocks_f32, (const float *)x, (const float *)w + b * stride)
        for (int s = 0; s < n; s++)
            memcpy((float *)y + (b + s) * BLOCK + 16 * j0, out + s * BLOCK + 16 * j0, 16 * (j1 - j0) * sizeof(float));
    }
    #undef CALL
}

/* y[blocks * 64] = x[depth * (bf16 ? 2 : 1)] times the packed weight; bf16 or fp32 throughout.
   The threads share the blocks' halves evenly (a 576-wide matrix is 9 blocks: by whole blocks one
   thread of two would read 5 while the other waits), a thread's whole blocks STREAMS at a time. */
void packed_rows(const void *x, const void *w, void *y, int64_t blocks, int64_t depth, int bf16) {
    int64_t stride = depth * (bf16 ? 2 : 1) * BLOCK;
    #pragma omp parallel
    {
        int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t first = 2 * blocks * t / threads, last = 2 * blocks * (t + 1) / threads;  /* halves */
        if (first < last && first % 2) some_blocks(x, w, y, stride, depth, bf16, first++ / 2, 1, 2, 4);
        if (first < last && last % 2) some_blocks(x, w, y, stride, depth, bf16, --last / 2, 1, 0, 2);
        for (int64_t b = first / 2; b < last / 2; b += STREAMS)
            some_blocks(x, w, y, stride, depth, bf16, b, last / 2 - b < STREAMS ? (int)(last / 2 - b) : STREAMS, 0, 4);
    }
}

/* torch's C shim API (torch/csrc/inductor/aoti_torch/c/shim.h), declared here rather than
   included: this file builds without torch's headers. */
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef int32_t AOTITorchError;
extern AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle, void **);
extern AOTITorchError aoti_torch_get_sizes(AtenTensorHandle, int64_t **);
extern AOTITorchError aoti_torch_get_strides(AtenTensorHandle, int64_t **);
extern AOTITorchError aoti_torch_get_dim(AtenTensorHandle, int64_t *);
extern AOTITorchError aoti_torch_get_dtype(AtenTensorHandle, int32_t *);
extern AOTITorchError aoti_torch_empty_strided(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t,
                                               AtenTensorHandle *);
extern int32_t aoti_torch_device_type_cpu(void);
extern int32_t aoti_torch_dtype_bfloat16(void);
extern int32_t aoti_torch_dtype_float32(void);

/* x [1, K] contiguous; w [N / 64, K / 2, 128] (bf16) or [N / 64, K, 64] (fp32) of x's dtype;
   returns y [1, N]. A shape or dtype that does not fit is an error (1), never a wrong read. */
AOTITorchError aoti_torch_cpu_packed_rows(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle *ret0) {
    void *xd, *wd, *yd;
    int64_t *xs, *xst, *ws, xdim, wdim;
    int32_t xdt, wdt;
    if (aoti_torch_get_dim(x, &xdim) || aoti_torch_get_dim(w, &wdim) || xdim != 2 || wdim != 3) return 1;
    if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_strides(x, &xst) || aoti_torch_get_sizes(w, &ws)) return 1;
    if (aoti_torch_get_dtype(x, &xdt) || aoti_torch_get_dtype(w, &wdt) || xdt != wdt) return 1;
    int bf16 = xdt == aoti_torch_dtype_bfloat16();
    if (!bf16 && xdt != aoti_torch_dtype_float32()) return 1;
    int64_t per = bf16 ? 2 : 1;
    if (xs[0] != 1 || xst[1] != 1 || ws[2] != BLOCK * per || xs[1] != ws[1] * per) return 1;
    int64_t size[2] = {1, ws[0] * BLOCK}, stride[2] = {ws[0] * BLOCK, 1};
    AOTITorchError error = aoti_torch_empty_strided(2, size, stride, xdt, aoti_torch_device_type_cpu(), 0, ret0);
    if (error) return error;
    if (aoti_torch_get_data_ptr(x, &xd) || aoti_torch_get_data_ptr(w, &wd) || aoti_torch_get_data_ptr(*ret0, &yd)) return 1;
    packed_rows(xd, wd, yd, ws[0], ws[1], bf16);
    return 0;
}
