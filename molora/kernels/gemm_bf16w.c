/* The CPU engine's exact-row decode GEMM on bfloat16 weights (kernels/cpu_bf16.py compiles and loads it):

       y [n, o] = x [n, k] @ w [o, k]^T      x, y float32 (contiguous); w bfloat16 bits; k a multiple of 16

   A decode step of a small model on a 2-core CPU is bound by reading its weights; a bfloat16 copy of weights whose
   values are bfloat16 (the embedded model's checkpoint) holds the same values in half the bytes. Each weight is
   widened to float32 in registers and every product and sum is float32.

   Each (row, output) pair has its own 16 float32 lanes: fused multiply-adds over k in steps of 16, then the lanes
   summed by _mm512_reduce_add_ps. Those are the same operations whatever the other rows of x are, so a row's numbers
   never depend on its neighbours (the engine's exact rows). Blocks of 4 rows x 4 outputs keep 16 accumulators in
   registers and read each weight once per 4 rows. Needs AVX-512F: elsewhere it does not compile, and the engine keeps
   oneDNN's float32 GEMM. */
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load_weights(const uint16_t *w) {
    /* a bfloat16 is the upper half of a float32 */
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* y[i .. i+ROWS, j .. j+OUTS] (ROWS, OUTS constants from 1 to 4: the loops unroll) */
static inline __attribute__((always_inline)) void block(const float *x, const uint16_t *w, float *y, long o,
                                                         long k, long i, long j, const int ROWS, const int OUTS) {
    __m512 acc[4][4];
    for (int a = 0; a < ROWS; a++)
        for (int b = 0; b < OUTS; b++) acc[a][b] = _mm512_setzero_ps();
    for (long at = 0; at < k; at += 16) {
        __m512 wv[4];
        for (int b = 0; b < OUTS; b++) wv[b] = load_weights(w + (j + b) * k + at);
        for (int a = 0; a < ROWS; a++) {
            __m512 xv = _mm512_loadu_ps(x + (i + a) * k + at);
            for (int b = 0; b < OUTS; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < ROWS; a++)
        for (int b = 0; b < OUTS; b++) y[(i + a) * o + j + b] = _mm512_reduce_add_ps(acc[a][b]);
}

#define EVERY_ROW(OUTS)                                                          \
    for (i = 0; i + 4 <= n; i += 4) block(x, w, y, o, k, i, j, 4, OUTS);         \
    switch (n - i) {                                                             \
        case 3: block(x, w, y, o, k, i, j, 3, OUTS); break;                      \
        case 2: block(x, w, y, o, k, i, j, 2, OUTS); break;                      \
        case 1: block(x, w, y, o, k, i, j, 1, OUTS); break;                      \
    }

void molora_gemm_bf16w(const float *x, const uint16_t *w, float *y, long n, long o, long k) {
    long i, j;
    for (j = 0; j + 4 <= o; j += 4) { EVERY_ROW(4) }
    for (; j < o; j++) { EVERY_ROW(1) }
}
