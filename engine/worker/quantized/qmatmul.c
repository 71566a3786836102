/* y = x @ W.T on a CPU for a weight W kept in GGUF's quantized groups, as llama.cpp multiplies
   them: each row of x is quantized to int8 per 32 values (a float scale each), and a group's dot
   product is summed in integers, then scaled once in float.

   Weights. A weight is `q * scale + offset` over groups of `gs` (16 or 32) consecutive k:
     scale  = d[g / sg] * sc[g]   (sc absent: 1)
     offset = dm[g / sg] * mn[g]  (mn absent: 1; dm absent: no offset; gs 32 only)
   d, dm are f16 per "super-block" of `sg` groups and sc, mn int8 per group: the formats' own
   numbers, so the file's weights are kept exactly, and a scale is the float product llama.cpp's
   and gguf's dequantizers compute. They are laid out [blocks, groups, LANES].
   The quants are kept in blocks of LANES output features, 32 k at a time, so that one 32-byte
   load holds 4 consecutive k of each of the LANES features: the shape a byte multiply-add
   (vpmaddubsw, 4 products summed per 32-bit lane) wants, with no sum across lanes at the end.
     int8:   [blocks, in/32, 8 quads, LANES, 4]                       k = 32c + 4t + i
     4-bit:  [blocks, in/32, 4 quads, LANES, 4] bytes, low nibble k = 32c + 4t + i,
                                                 high nibble k = 32c + 16 + 4t + i

   Activations. Row r's 32 values of chunk c become xq = round(x / dx), dx = max|x| / 127 (as
   llama.cpp's q8 rows), with xsum = the float sum of the 32 values for the offsets:
   x . (q*s + o) ~= s * dx * (xq . q) + o * xsum.

   Rows are taken MT at a time so a block's weights, loaded once, serve several rows from L1. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define CHUNK 32

typedef struct {
    const int8_t *xq; const float *dx; const float *xsum; int64_t chunks;  /* chunks = in / 32 */
    const uint8_t *q; const _Float16 *d; const _Float16 *dm; const int8_t *sc; const int8_t *mn;
    int64_t sg; float *y; int64_t y_stride;
} Args;

static inline float half(const _Float16 *p) { return (float)*p; }

/* Scale (and offset) of lane block b's scale group g, per lane. */
static inline void group_scale(const Args *a, int64_t b, int64_t g, int64_t groups, float *scale, float *offset) {
    const int64_t s = (b * (groups / a->sg) + g / a->sg) * LANES, gi = (b * groups + g) * LANES;
    for (int l = 0; l < LANES; l++) {
        scale[l] = half(a->d + s + l) * (a->sc ? (float)a->sc[gi + l] : 1.0f);
        if (offset) offset[l] = a->dm ? half(a->dm + s + l) * (a->mn ? (float)a->mn[gi + l] : 1.0f) : 0.0f;
    }
}

#ifdef __AVX2__
#include <immintrin.h>

static inline __m256 load_scale(const Args *a, int64_t b, int64_t g, int64_t groups) {
    const int64_t s = (b * (groups / a->sg) + g / a->sg) * LANES;
    __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->d + s)));
    if (a->sc) {
        const __m128i sc = _mm_loadl_epi64((const __m128i *)(a->sc + (b * groups + g) * LANES));
        scale = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    }
    return scale;
}

static inline __m256 load_offset(const Args *a, int64_t b, int64_t g, int64_t groups) {
    const int64_t s = (b * (groups / a->sg) + g / a->sg) * LANES;
    __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->dm + s)));
    if (a->mn) {
        const __m128i mn = _mm_loadl_epi64((const __m128i *)(a->mn + (b * groups + g) * LANES));
        offset = _mm256_mul_ps(offset, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn)));
    }
    return offset;
}

static inline __m256i broadcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* Lane block b's outputs for rows r0 .. r0+MT-1; MT, GS, NIBBLES are constants at each call. */
static inline __attribute__((always_inline)) void block_rows(const Args *a, int64_t b, int64_t r0,
                                                             const int MT, const int GS, const int NIBBLES) {
    const int64_t groups = a->chunks * CHUNK / GS;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
    __m256 acc[4];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < a->chunks; c++) {
        const int8_t *xq[4];
        for (int r = 0; r < MT; r++) xq[r] = a->xq + (r0 + r) * a->chunks * CHUNK + c * CHUNK;
        __m256i dot[4][2];  /* [row][half of the chunk] for 16-wide groups; [row][0] for 32 */
        for (int r = 0; r < MT; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        if (NIBBLES) {
            const uint8_t *p = a->q + (b * a->chunks + c) * (CHUNK / 2) * LANES;
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int r = 0; r < MT; r++) {
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xq[r] + 4 * t)),
                                                           _mm256_maddubs_epi16(hi, broadcast4(xq[r] + 16 + 4 * t)));
                    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(pairs, ones));
                }
            }
        } else {
            const int8_t *p = (const int8_t *)a->q + (b * a->chunks + c) * CHUNK * LANES;
            for (int t = 0; t < 8; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p + t * 32));
                const __m256i w_abs = _mm256_sign_epi8(w, w);
                for (int r = 0; r < MT; r++) {
                    /* |w| * (x with w's sign): the unsigned-by-signed form vpmaddubsw takes. */
                    const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(broadcast4(xq[r] + 4 * t), w));
                    const int h = GS == 16 ? t / 4 : 0;
                    dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        const int64_t g0 = c * CHUNK / GS;
        for (int h = 0; h < CHUNK / GS; h++) {
            const __m256 scale = load_scale(a, b, g0 + h, groups);
            for (int r = 0; r < MT; r++) {
                const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(a->dx[(r0 + r) * a->chunks + c]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), s, acc[r]);
            }
        }
        if (a->dm) {
            const __m256 offset = load_offset(a, b, g0, groups);
            for (int r = 0; r < MT; r++)
                acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a->xsum[(r0 + r) * a->chunks + c]), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm256_storeu_ps(a->y + (r0 + r) * a->y_stride + b * LANES, acc[r]);
}

#else  /* the same sums, one lane at a time */

static inline __attribute__((always_inline)) void block_rows(const Args *a, int64_t b, int64_t r0,
                                                             const int MT, const int GS, const int NIBBLES) {
    const int64_t groups = a->chunks * CHUNK / GS;
    for (int r = 0; r < MT; r++) {
        float acc[LANES] = {0};
        for (int64_t c = 0; c < a->chunks; c++) {
            const int8_t *xq = a->xq + (r0 + r) * a->chunks * CHUNK + c * CHUNK;
            for (int h = 0; h < CHUNK / GS; h++) {
                float scale[LANES], offset[LANES];
                group_scale(a, b, c * CHUNK / GS + h, groups, scale, h == 0 ? offset : NULL);
                for (int l = 0; l < LANES; l++) {
                    int32_t dot = 0;
                    for (int k = h * GS; k < (h + 1) * GS; k++) {
                        const int t = k % 16 / 4, i = k % 4;
                        int q;
                        if (NIBBLES) {
                            const uint8_t v = a->q[((b * a->chunks + c) * 4 + t) * 32 + l * 4 + i];
                            q = k < 16 ? v & 15 : v >> 4;
                        } else {
                            q = ((const int8_t *)a->q)[((b * a->chunks + c) * 8 + k / 4) * 32 + l * 4 + i];
                        }
                        dot += q * xq[k];
                    }
                    acc[l] += (float)dot * scale[l] * a->dx[(r0 + r) * a->chunks + c];
                    if (h == 0 && a->dm) acc[l] += offset[l] * a->xsum[(r0 + r) * a->chunks + c];
                }
            }
        }
        memcpy(a->y + (r0 + r) * a->y_stride + b * LANES, acc, sizeof(acc));
    }
}
#endif

static inline __attribute__((always_inline)) void block(const Args *a, int64_t b, int64_t rows,
                                                        const int GS, const int NIBBLES) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) block_rows(a, b, r, 4, GS, NIBBLES);
    switch (rows - r) {
        case 3: block_rows(a, b, r, 3, GS, NIBBLES); break;
        case 2: block_rows(a, b, r, 2, GS, NIBBLES); break;
        case 1: block_rows(a, b, r, 1, GS, NIBBLES); break;
    }
}

/* Row r of x [rows, in] (row stride x_stride) as int8 per 32 values: xq [rows, in], with each
   chunk's scale dx and float sum xsum [rows, in/32]. */
void quantize_rows(const float *x, int64_t rows, int64_t x_stride, int64_t in, int8_t *xq, float *dx, float *xsum) {
    const int64_t chunks = in / CHUNK;
    #pragma omp parallel for schedule(static) if (rows * chunks >= 1024)
    for (int64_t rc = 0; rc < rows * chunks; rc++) {
        const float *v = x + rc / chunks * x_stride + rc % chunks * CHUNK;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < CHUNK; i++) { amax = fmaxf(amax, fabsf(v[i])); sum += v[i]; }
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < CHUNK; i++) xq[rc * CHUNK + i] = (int8_t)lrintf(v[i] * inverse);
        dx[rc] = amax / 127.0f;
        xsum[rc] = sum;
    }
}

/* y [rows, blocks * LANES] (row stride y_stride) from rows quantized by quantize_rows. */
void qmatmul(const int8_t *xq, const float *dx, const float *xsum, int64_t rows, int64_t in,
             const uint8_t *q, const _Float16 *d, const _Float16 *dm, const int8_t *sc, const int8_t *mn,
             int64_t gs, int64_t sg, int64_t nibbles, int64_t blocks, float *y, int64_t y_stride) {
    const Args a = {xq, dx, xsum, in / CHUNK, q, d, dm, sc, mn, sg, y, y_stride};
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        if (nibbles) block(&a, b, rows, 32, 1);
        else if (gs == 16) block(&a, b, rows, 16, 0);
        else block(&a, b, rows, 32, 0);
    }
}
