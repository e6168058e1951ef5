/* The CPU engine's exact-row decode GEMM on bfloat16 weights (kernels/cpu_bf16.py compiles and loads it):

       y [n, o] = x [n, k] @ W [o, k]^T      x, y float32, contiguous; o a multiple of 16

   with W given as bfloat16 bits in blocks of 16 outputs, w [o / 16, k, 16] (w[b, j, v] = W[16 b + v, j]).

   A decode step of a small model on a 2-core CPU is bound by reading its weights; a bfloat16 copy of weights whose
   values are bfloat16 (the embedded model's checkpoint) holds the same values in half the bytes. Each weight is
   widened to float32 in registers and every product and sum is float32.

   Each output is one chain of fused multiply-adds over k in order, in its own lane of a 16-output vector: the same
   operations whatever the other rows of x are, so a row's numbers never depend on its neighbours (the engine's
   exact rows). Blocks of 4 rows x 64 outputs keep 16 accumulators in registers and read each weight once per 4 rows.
   AVX-512F where the compiler targets it, else the same lanes as plain loops the compiler vectorises (vec16.h). */
#include "vec16.h"

/* y[i .. i+ROWS, 16 b .. 16 (b+VECS)] (ROWS, VECS constants from 1 to 4: the loops unroll) */
static inline __attribute__((always_inline)) void block(const float *x, const uint16_t *w, float *y, long o,
                                                         long k, long i, long b, const int ROWS, const int VECS) {
    v16 acc[4][4];
    for (int a = 0; a < ROWS; a++)
        for (int v = 0; v < VECS; v++) acc[a][v] = v16_zero();
    const uint16_t *first = w + b * k * 16;
    for (long j = 0; j < k; j++) {
        v16 wv[4];
        for (int v = 0; v < VECS; v++) wv[v] = v16_bf16(first + (v * k + j) * 16);
        for (int a = 0; a < ROWS; a++) {
            v16 xv = v16_set1(x[(i + a) * k + j]);
            for (int v = 0; v < VECS; v++) acc[a][v] = v16_fma(xv, wv[v], acc[a][v]);
        }
    }
    for (int a = 0; a < ROWS; a++)
        for (int v = 0; v < VECS; v++) v16_store(y + (i + a) * o + (b + v) * 16, acc[a][v]);
}

#define EVERY_ROW(VECS)                                                          \
    for (i = 0; i + 4 <= n; i += 4) block(x, w, y, o, k, i, b, 4, VECS);         \
    switch (n - i) {                                                             \
        case 3: block(x, w, y, o, k, i, b, 3, VECS); break;                      \
        case 2: block(x, w, y, o, k, i, b, 2, VECS); break;                      \
        case 1: block(x, w, y, o, k, i, b, 1, VECS); break;                      \
    }

void molora_gemm_bf16w(const float *x, const uint16_t *w, float *y, long n, long o, long k) {
    long i, b, blocks = o / 16;
    for (b = 0; b + 4 <= blocks; b += 4) { EVERY_ROW(4) }
    for (; b < blocks; b++) { EVERY_ROW(1) }
}
