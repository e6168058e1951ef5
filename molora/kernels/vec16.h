/* 16 float32 lanes for the CPU engine's C code (gemm_bf16w.c, decode_step.c): one AVX-512 register where the
   compiler targets AVX-512F, else a plain array of 16 floats whose lane loops the compiler vectorises for the
   machine (AVX2, NEON). Lanes never mix except in v16_sum and sum16 (fixed trees), so a computation's numbers
   depend only on its own inputs and the build, never on what else shares a call (the engine's exact rows). */
#ifndef MOLORA_VEC16_H
#define MOLORA_VEC16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* sum16 gives lane j the horizontal sum of v[SUM16_PLACE[j]] (the AVX-512 form is a transposing tree of shuffles:
   15 adds for 16 sums, where 16 separate reductions take ~8 ops each) */
static const int SUM16_PLACE[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

#ifdef __AVX512F__
#include <immintrin.h>

typedef __m512 v16;

static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v16_set1(float a) { return _mm512_set1_ps(a); }
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c */
static inline v16 v16_fnma(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }               /* b where either is NaN */
static inline v16 v16_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v16 v16_scale2(v16 p, v16 n) { return _mm512_scalef_ps(p, n); }         /* p * 2^n, n whole */
static inline float v16_sum(v16 a) { return _mm512_reduce_add_ps(a); }
/* the first `count` (< 16) lanes of p, zeros after; and the first `count` lanes stored */
static inline v16 v16_load_first(const float *p, long count) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
}
static inline void v16_store_first(float *p, long count, v16 a) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), a);
}
static inline v16 v16_first(long count, v16 a) { return _mm512_maskz_mov_ps((__mmask16)((1u << count) - 1), a); }
/* 16 bfloat16 as float32: a bfloat16 is the upper half of a float32 */
static inline v16 v16_bf16(const uint16_t *w) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline v16 sum16(const v16 v[16]) {
    v16 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44), _mm512_shuffle_ps(x[i], x[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

#else /* portable: the same lane arithmetic as plain loops */

typedef struct { float l[16]; } v16;

#define V16_LANES(expr)                              \
    v16 r;                                           \
    for (int i = 0; i < 16; i++) r.l[i] = (expr);    \
    return r

static inline v16 v16_load(const float *p) { v16 r; memcpy(r.l, p, sizeof r.l); return r; }
static inline void v16_store(float *p, v16 a) { memcpy(p, a.l, sizeof a.l); }
static inline v16 v16_set1(float a) { V16_LANES(a); }
static inline v16 v16_zero(void) { V16_LANES(0.0f); }
static inline v16 v16_add(v16 a, v16 b) { V16_LANES(a.l[i] + b.l[i]); }
static inline v16 v16_sub(v16 a, v16 b) { V16_LANES(a.l[i] - b.l[i]); }
static inline v16 v16_mul(v16 a, v16 b) { V16_LANES(a.l[i] * b.l[i]); }
static inline v16 v16_div(v16 a, v16 b) { V16_LANES(a.l[i] / b.l[i]); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { V16_LANES(fmaf(a.l[i], b.l[i], c.l[i])); }
static inline v16 v16_fnma(v16 a, v16 b, v16 c) { V16_LANES(fmaf(-a.l[i], b.l[i], c.l[i])); }
static inline v16 v16_max(v16 a, v16 b) { V16_LANES(a.l[i] > b.l[i] ? a.l[i] : b.l[i]); }
static inline v16 v16_round(v16 a) { V16_LANES(rintf(a.l[i])); }
static inline v16 v16_scale2(v16 p, v16 n) { V16_LANES(ldexpf(p.l[i], (int)fminf(fmaxf(n.l[i], -300.0f), 300.0f))); }
static inline float v16_sum(v16 a) {
    float s[8];
    for (int i = 0; i < 8; i++) s[i] = a.l[i] + a.l[i + 8];
    for (int i = 0; i < 4; i++) s[i] += s[i + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}
static inline v16 v16_load_first(const float *p, long count) {
    v16 r = v16_zero();
    memcpy(r.l, p, sizeof(float) * count);
    return r;
}
static inline void v16_store_first(float *p, long count, v16 a) { memcpy(p, a.l, sizeof(float) * count); }
static inline v16 v16_first(long count, v16 a) { V16_LANES(i < count ? a.l[i] : 0.0f); }
static inline v16 v16_bf16(const uint16_t *w) {
    v16 r;
    for (int i = 0; i < 16; i++) {
        uint32_t bits = (uint32_t)w[i] << 16;
        memcpy(&r.l[i], &bits, sizeof bits);
    }
    return r;
}
static inline v16 sum16(const v16 v[16]) {
    v16 r;
    for (int j = 0; j < 16; j++) r.l[j] = v16_sum(v[SUM16_PLACE[j]]);
    return r;
}

#endif
#endif
