/* The CPU engine's whole decode step for a Llama-family model, in one call (kernels/cpu_decode.py loads it):
   embedding, every block (RMSNorm, q/k/v, rotary, the KV write, attention over the row's own columns, o, the
   gated MLP, each projection with its routed LoRA delta), the final norm and the head, for n rows of one token.

   Why C: the embedded model's step is ~6.3M multiply-adds a row, far less than a millisecond, while its eager torch
   form is ~575 small tensor ops whose dispatch costs most of the step on a 2-core CPU (benchmarks/RESULTS.md, C1).

   Row by row: every number of a row is computed by the same operations in the same order whatever the other rows
   are (the GEMMs are molora_gemm_bf16w's one FMA chain per output; everything else loops over one row), so a
   request's tokens equal its solo run (the engine's exact rows). Sums differ from torch's by float32 rounding.

   Layouts (float32 unless said; all contiguous):
     dims   [layers, d, heads, kv_heads, head_dim, ffn, vocab, slots, rank, max_len, qk_norm]
     reals  [eps, scaling]
     global tensors: embed [vocab, d], final norm [d], head (bf16 copy [vpad/16, d, 16], vpad = vocab rounded up
       to 16), cos and sin_signed [max_len, head_dim] (rotate_half's signs folded into sin)
     per layer, LAYER_TENSORS pointers: input norm [d], post-attention norm [d], q_norm and k_norm [head_dim] (or
       NULL), then for each projection group qkv (3 members), o (1), gate_up (2), down (1): the base weight's bf16
       copy [O/16, in, 16], A [P, S, r, in], B [S, O, r], scale [P, S]; then K and V [cache rows, kv_heads,
       max_len, head_dim]
   The step: rows[n] (batch rows: each is also the row's cache row and its row of `logits` [*, vocab]), and per
   batch row ids, positions and LoRA slots (-1: none), all int64. Learned (MoLoRA) routing, with gate_sets > 0:
   each row's LoRA choices at each block are its gates' decision (`decide`), made here from the block input (see
   GateSet; deciding in Python at each block was half a learned step: 4.1 against 1.4 ms for vocabulary routing,
   benchmarks/cpu_speed.py). The decisions go to decided_slots / decided_weights [width, layers, k] (rows not computed: untouched);
   a row no gate set routes keeps its slot in column 0 with weight 1 (0 for -1), -1 / 0 in the other columns.
   Returns 0; 1 when its scratch could not be allocated (nothing was written). Vectors of 16 lanes: AVX-512F or
   portable loops (vec16.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

void molora_gemm_bf16w_team(const float *x, const uint16_t *w, float *y, long n, long o, long k);

/* One learned gate set (routing/routers.py LearnedGates, as LearnedGroup.decide applies it at one position per
   row), in the order the sets apply: a later set's decision replaces an earlier one's on the rows it gates. Per
   batch row r (all arrays [width, ...] are indexed by r; bools are bytes):
     gated[r]         the set decides this row (its positions' modality, and the row a member of the router)
     held[r]          take the decision kept for the row's picture, held_slots / held_weights [r, layer, top_k],
                      instead of the gates' (held NULL: none kept)
     the gates' decision at a block: logits = weights[layer] [experts, (1 + decays) d] @ the block input (with
     decays: the input and the row's `decays` routing states, each RMS-normalised without a weight,
     concatenated), its top_k logits (largest first, equal ones by lowest expert: decision.top_k_first, as the
     eager and compiled decide), their softmax, and each expert's slot
     expert_slots[e] (-1: the base model)
     routing state (decays > 0): made at block 0 from the embedding e, per decay j,
                      state_out[r, j] = fresh[j] e + keep[j] state_in[r, j] where updates[r], else state_in[r, j]
                      (fresh = 1 - lambda, keep = exp(log lambda): decision.state_update at one position) */
typedef struct {
    long experts, top_k, decays;
    const long *expert_slots;
    const float *const *weights;
    const uint8_t *gated, *updates, *held;
    const float *keep, *fresh, *state_in;
    float *state_out;
    const long *held_slots;
    const float *held_weights;
} GateSet;

enum { GLOBAL_TENSORS = 5, GROUP_TENSORS = 4, GROUPS = 4, LAYER_TENSORS = 4 + GROUPS * GROUP_TENSORS + 2 };
enum { D_LAYERS, D_MODEL, D_HEADS, D_KV_HEADS, D_HEAD, D_FFN, D_VOCAB, D_SLOTS, D_RANK, D_MAX_LEN, D_QK_NORM,
       D_COUNT };

static float dot(const float *a, const float *b, long n) {
    v16 acc = v16_zero();
    long i = 0;
    for (; i + 16 <= n; i += 16) acc = v16_fma(v16_load(a + i), v16_load(b + i), acc);
    float sum = v16_sum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* exp of 16 floats (Cephes' expf: n = round(x / ln 2), r = x - n ln 2 in two parts, a degree-7 polynomial in r,
   times 2^n; within ~2 ulp of expf, 0 below -104, inf above 88.7): glibc's scalar expf was a fifth of a row's step */
static inline v16 exp16(v16 x) {
    x = v16_max(v16_set1(-104.0f), x);  /* (this order keeps a NaN) */
    v16 n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f)));
    v16 r = v16_fnma(n, v16_set1(0.693359375f), x);
    r = v16_fnma(n, v16_set1(-2.12194440e-4f), r);
    v16 p = v16_set1(1.9875691500e-4f);
    p = v16_fma(p, r, v16_set1(1.3981999507e-3f));
    p = v16_fma(p, r, v16_set1(8.3334519073e-3f));
    p = v16_fma(p, r, v16_set1(4.1665795894e-2f));
    p = v16_fma(p, r, v16_set1(1.6666665459e-1f));
    p = v16_fma(p, r, v16_set1(5.0000001201e-1f));
    p = v16_fma(p, v16_mul(r, r), v16_add(r, v16_set1(1.0f)));
    return v16_scale2(p, n);
}

/* out[j] = dot(rows + j * stride, x, n) for j < 16, n a multiple of 16 */
static inline v16 dots16(const float *rows, long stride, const float *x, long n) {
    v16 v[16];
    for (int j = 0; j < 16; j++) {
        const float *row = rows + j * stride;
        v16 acc = v16_mul(v16_load(row), v16_load(x));
        for (long i = 16; i < n; i += 16) acc = v16_fma(v16_load(row + i), v16_load(x + i), acc);
        v[SUM16_PLACE[j]] = acc;
    }
    return sum16(v);
}

/* out[j] = dot(rows + j * stride, x, n) for j < count (16 at a time where n is a multiple of 16) */
static void dots(const float *rows, long stride, const float *x, long n, long count, float *out) {
    long j = 0;
    if (n % 16 == 0)
        for (; j + 16 <= count; j += 16) v16_store(out + j, dots16(rows + j * stride, stride, x, n));
    for (; j < count; j++) out[j] = dot(rows + j * stride, x, n);
}

/* y += a * x */
static void axpy(float *y, float a, const float *x, long n) {
    v16 av = v16_set1(a);
    long i = 0;
    for (; i + 16 <= n; i += 16) v16_store(y + i, v16_fma(av, v16_load(x + i), v16_load(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* out = x * rsqrt(mean(x^2) + eps) * weight, as transformers' RMSNorm in float32; weight NULL: none (a piece of a
   gate's input, decision.gate_logits) */
static void rms_norm(const float *x, const float *weight, float *out, long n, float eps) {
    float scale = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    if (weight == NULL)
        for (long i = 0; i < n; i++) out[i] = x[i] * scale;
    else
        for (long i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

/* row r's routing states under set g from its embedding e [d] (GateSet) */
static void step_state(const GateSet *g, long r, const float *e, long d) {
    for (long j = 0; j < g->decays; j++) {
        const float *in = g->state_in + (r * g->decays + j) * d;
        float *out = g->state_out + (r * g->decays + j) * d;
        if (!g->updates[r]) {
            memcpy(out, in, sizeof(float) * d);
            continue;
        }
        for (long c = 0; c < d; c++) out[c] = g->fresh[j] * e[c] + g->keep[j] * in[c];
    }
}

/* set g's gates on row r's input x [d] at block `layer`: slot / weight [top_k]. Scratch: input [(1 + decays) d],
   logits [experts] */
static void gate_top_k(const GateSet *g, long layer, long r, const float *x, long d, float *input, float *logits,
                       long *slot, float *weight) {
    long width = (1 + g->decays) * d;
    const float *gate_in = x;
    if (g->decays > 0) {
        rms_norm(x, NULL, input, d, 1e-6f);
        for (long j = 0; j < g->decays; j++)
            rms_norm(g->state_out + (r * g->decays + j) * d, NULL, input + (1 + j) * d, d, 1e-6f);
        gate_in = input;
    }
    dots(g->weights[layer], width, gate_in, width, g->experts, logits);
    long chosen[g->top_k];
    float total = 0.0f;
    for (long c = 0; c < g->top_k; c++) {  /* k rounds of argmax: equal logits by lowest expert (decision.top_k_first) */
        long best = -1;
        for (long e = 0; e < g->experts; e++) {
            int taken = 0;
            for (long prior = 0; prior < c; prior++) taken |= chosen[prior] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[c] = best;
        slot[c] = g->expert_slots[best];
        weight[c] = expf(logits[best] - logits[chosen[0]]);
        total += weight[c];
    }
    for (long c = 0; c < g->top_k; c++) weight[c] /= total;
}

/* A step's learned decisions: its gate sets, where the decisions go ([width, layers, k]) and the gates' scratch. */
typedef struct {
    const GateSet *sets;
    long count, layers, k;
    long *slots;
    float *weights, *input, *logits;
} Decisions;

/* row r's LoRA choices at block `layer` from its block input x [d]: its static slot (column 0, weight 1; -1 / 0
   for the other columns), replaced by each gate set that gates the row; into slot / weight [k] and the decisions */
static void decide(const Decisions *dec, long layer, long r, long static_slot, const float *x, long d, long *slot,
                   float *weight) {
    for (long c = 0; c < dec->k; c++) {
        slot[c] = c == 0 ? static_slot : -1;
        weight[c] = c == 0 && static_slot >= 0 ? 1.0f : 0.0f;
    }
    for (long s = 0; s < dec->count; s++) {
        const GateSet *g = dec->sets + s;
        if (!g->gated[r]) continue;
        if (g->held != NULL && g->held[r]) {
            long at = (r * dec->layers + layer) * g->top_k;
            memcpy(slot, g->held_slots + at, sizeof(long) * g->top_k);
            memcpy(weight, g->held_weights + at, sizeof(float) * g->top_k);
        } else {
            gate_top_k(g, layer, r, x, d, dec->input, dec->logits, slot, weight);
        }
        for (long c = g->top_k; c < dec->k; c++) {
            slot[c] = -1;
            weight[c] = 0.0f;
        }
    }
    long at = (r * dec->layers + layer) * dec->k;
    memcpy(dec->slots + at, slot, sizeof(long) * dec->k);
    memcpy(dec->weights + at, weight, sizeof(float) * dec->k);
}

/* x * cos + rotate_half(x) * sin == x * cos + roll(x, D/2) * sin_signed */
static void rotate(float *x, const float *cos, const float *sin_signed, long dim) {
    float rotated[dim];
    long half = dim / 2;
    for (long i = 0; i < dim; i++) rotated[i] = x[i] * cos[i] + x[(i + half) % dim] * sin_signed[i];
    memcpy(x, rotated, sizeof(float) * dim);
}

typedef struct {
    const uint16_t *weight;
    const float *A, *B, *scale;
    long members, in, out;
} Group;

/* y [n, out] = x [n, in] @ W^T + each row's LoRA delta: row i's choices c < k (slot s = choice_slot[i k + c],
   none when s < 0, weight w = choice_weight[i k + c]) add w * scale[p, s] * B[s, member p's outputs] @ (A[p, s] @ x)
   to member p's outputs (widths[p] of them, in order). The choices of one slot are taken together, so each piece of
   A and B is read once for all of them; a row's own operations, and the order of its choices (by slot), stay the
   same whatever else shares the call. Scratch: members [n k], t [n k rank]. */
static void routed_linear(const Group *g, const long *widths, const float *x, float *y, long n,
                          const long *choice_slot, const float *choice_weight, long k, long slots, long rank,
                          long *members, float *t) {
    molora_gemm_bf16w_team(x, g->weight, y, n, g->out, g->in);
    for (long s = 0; s < slots; s++) {
        long count = 0;
        for (long e = 0; e < n * k; e++)
            if (choice_slot[e] == s) members[count++] = e;
        if (count == 0) continue;
        long first = 0;
        for (long p = 0; p < g->members; p++) {
            const float *A = g->A + (p * slots + s) * rank * g->in;
            float scale = g->scale[p * slots + s];
            for (long j = 0; j < rank; j++)
                for (long m = 0; m < count; m++)
                    t[m * rank + j] = scale * dot(A + j * g->in, x + members[m] / k * g->in, g->in);
            const float *B = g->B + (s * g->out + first) * rank;
            long o = 0;
            if (rank % 16 == 0)
                for (; o + 16 <= widths[p]; o += 16)
                    for (long m = 0; m < count; m++) {
                        float *out = y + members[m] / k * g->out + first + o;
                        v16 delta = dots16(B + o * rank, rank, t + m * rank, rank);
                        v16_store(out, v16_fma(v16_set1(choice_weight[members[m]]), delta, v16_load(out)));
                    }
            for (; o < widths[p]; o++)
                for (long m = 0; m < count; m++)
                    y[members[m] / k * g->out + first + o] += choice_weight[members[m]] *
                                                              dot(B + o * rank, t + m * rank, rank);
            first += widths[p];
        }
    }
}

/* out[16 v ..] = sum over c <= last of (scores[c] / total) values[c, 16 v ..] for v < VECS (a constant from 1 to 8:
   the accumulators stay in registers), in the order and with the operations of axpy on a zeroed out */
static inline __attribute__((always_inline)) void weigh(const float *scores, float total, const float *values,
                                                        long last, long dim, float *out, const int VECS) {
    v16 acc[8];
    for (int v = 0; v < VECS; v++) acc[v] = v16_zero();
    for (long c = 0; c <= last; c++) {
        v16 a = v16_set1(scores[c] / total);
        for (int v = 0; v < VECS; v++) acc[v] = v16_fma(a, v16_load(values + c * dim + v * 16), acc[v]);
    }
    for (int v = 0; v < VECS; v++) v16_store(out + v * 16, acc[v]);
}

/* one query head's attention over columns 0..last of its KV head: out [dim] */
static void attend(const float *q, const float *keys, const float *values, long last, long dim, float scaling,
                   float *scores, float *out) {
    float top = -INFINITY;
    dots(keys, dim, q, dim, last + 1, scores);
    for (long c = 0; c <= last; c++) {
        scores[c] *= scaling;
        if (scores[c] > top) top = scores[c];
    }
    v16 sums = v16_zero(), shift = v16_set1(top);
    long c = 0;
    for (; c + 16 <= last + 1; c += 16) {
        v16 e = exp16(v16_sub(v16_load(scores + c), shift));
        v16_store(scores + c, e);
        sums = v16_add(sums, e);
    }
    if (c <= last) {
        long tail = last + 1 - c;
        v16 e = exp16(v16_sub(v16_load_first(scores + c, tail), shift));
        v16_store_first(scores + c, tail, e);
        sums = v16_add(sums, v16_first(tail, e));
    }
    float total = v16_sum(sums);
    if (dim % 16 != 0) {
        memset(out, 0, sizeof(float) * dim);
        for (long c = 0; c <= last; c++) axpy(out, scores[c] / total, values + c * dim, dim);
        return;
    }
    for (long first = 0; first < dim; first += 128) {  /* up to 8 vectors of the head at a time */
        const float *part = values + first;
        float *into = out + first;
        switch ((dim - first) / 16 < 8 ? (dim - first) / 16 : 8) {
            case 1: weigh(scores, total, part, last, dim, into, 1); break;
            case 2: weigh(scores, total, part, last, dim, into, 2); break;
            case 3: weigh(scores, total, part, last, dim, into, 3); break;
            case 4: weigh(scores, total, part, last, dim, into, 4); break;
            case 5: weigh(scores, total, part, last, dim, into, 5); break;
            case 6: weigh(scores, total, part, last, dim, into, 6); break;
            case 7: weigh(scores, total, part, last, dim, into, 7); break;
            default: weigh(scores, total, part, last, dim, into, 8); break;
        }
    }
}

int molora_decode_step(const long *dims, const float *reals, void *const *tensors, long n, const long *rows,
                       const long *ids, const long *positions, const long *slots, float *logits, long k,
                       long gate_sets, const GateSet *sets, long *decided_slots, float *decided_weights) {
    const long layers = dims[D_LAYERS], d = dims[D_MODEL], heads = dims[D_HEADS], kv_heads = dims[D_KV_HEADS];
    const long dim = dims[D_HEAD], ffn = dims[D_FFN], vocab = dims[D_VOCAB], num_slots = dims[D_SLOTS];
    const long rank = dims[D_RANK], max_len = dims[D_MAX_LEN];
    const long vpad = (vocab + 15) / 16 * 16, group_size = heads / kv_heads;
    const long q_out = heads * dim, kv_out = kv_heads * dim, qkv_out = q_out + 2 * kv_out;
    const float eps = reals[0], scaling = reals[1];

    const float *embed = tensors[0], *final_norm = tensors[1];
    const uint16_t *head = tensors[2];
    const float *cos_table = tensors[3], *sin_table = tensors[4];

    /* each row's LoRA choices: its slot with weight 1 (k = 1), or its gates' top-k at each block */
    if (gate_sets == 0) k = 1;
    long gate_in = 0, experts = 0;
    for (long s = 0; s < gate_sets; s++) {
        if ((1 + sets[s].decays) * d > gate_in) gate_in = (1 + sets[s].decays) * d;
        if (sets[s].experts > experts) experts = sets[s].experts;
    }
    /* scratch, one block: x [n, d], h [n, d], qkv [n, qkv_out], attn [n, q_out], proj [n, d], gu [n, 2 ffn],
       act [n, ffn], out [n, vpad], scores [max_len], choice_weight [n k], shrunk [n k rank], the gates' input
       [gate_in] and logits [experts]; and choice_slot, members [n k] (longs) */
    long floats = n * (3 * d + qkv_out + q_out + 3 * ffn + vpad) + max_len + n * k * (1 + rank) + gate_in + experts;
    float *scratch = malloc(sizeof(float) * floats);
    long *longs = malloc(sizeof(long) * 2 * n * k);
    if (scratch == NULL || longs == NULL) {
        free(scratch);
        free(longs);
        return 1;
    }
    float *x = scratch, *h = x + n * d, *qkv = h + n * d, *attn = qkv + n * qkv_out, *proj = attn + n * q_out;
    float *gu = proj + n * d, *act = gu + n * 2 * ffn, *out = act + n * ffn, *scores = out + n * vpad;
    float *choice_weight = scores + max_len, *shrunk = choice_weight + n * k;
    long *choice_slot = longs, *members = longs + n * k;
    const Decisions decisions = {sets, gate_sets, layers, k, decided_slots, decided_weights, shrunk + n * k * rank,
                                 shrunk + n * k * rank + gate_in};
    for (long i = 0; i < n; i++) {
        long r = rows[i];
        choice_slot[i * k] = slots[r];
        choice_weight[i * k] = 1.0f;
        memcpy(x + i * d, embed + ids[r] * d, sizeof(float) * d);
        for (long s = 0; s < gate_sets; s++) step_state(sets + s, r, x + i * d, d);
    }
    const long qkv_widths[3] = {q_out, kv_out, kv_out}, o_widths[1] = {d}, gu_widths[2] = {ffn, ffn};
    const long down_widths[1] = {d};

    for (long layer = 0; layer < layers; layer++) {
        void *const *t = tensors + GLOBAL_TENSORS + layer * LAYER_TENSORS;
        const float *in_norm = t[0], *post_norm = t[1], *q_norm = t[2], *k_norm = t[3];
        Group groups[GROUPS];
        const long group_in[GROUPS] = {d, q_out, d, ffn}, group_out[GROUPS] = {qkv_out, d, 2 * ffn, d};
        const long group_members[GROUPS] = {3, 1, 2, 1};
        for (int g = 0; g < GROUPS; g++) {
            void *const *gt = t + 4 + g * GROUP_TENSORS;
            groups[g] = (Group){gt[0], gt[1], gt[2], gt[3], group_members[g], group_in[g], group_out[g]};
        }
        float *keys = t[4 + GROUPS * GROUP_TENSORS], *values = t[5 + GROUPS * GROUP_TENSORS];
        if (gate_sets > 0)  /* the learned gates decide on the block input */
            for (long i = 0; i < n; i++)
                decide(&decisions, layer, rows[i], slots[rows[i]], x + i * d, d, choice_slot + i * k,
                       choice_weight + i * k);

        for (long i = 0; i < n; i++) rms_norm(x + i * d, in_norm, h + i * d, d, eps);
        routed_linear(&groups[0], qkv_widths, h, qkv, n, choice_slot, choice_weight, k, num_slots, rank,
                      members, shrunk);
        for (long i = 0; i < n; i++) {
            long r = rows[i], pos = positions[r];
            float *q = qkv + i * qkv_out, *k = q + q_out, *v = k + kv_out;
            const float *cos = cos_table + pos * dim, *sin = sin_table + pos * dim;
            for (long a = 0; a < heads; a++) {
                if (q_norm != NULL) rms_norm(q + a * dim, q_norm, q + a * dim, dim, eps);
                rotate(q + a * dim, cos, sin, dim);
            }
            for (long j = 0; j < kv_heads; j++) {
                if (k_norm != NULL) rms_norm(k + j * dim, k_norm, k + j * dim, dim, eps);
                rotate(k + j * dim, cos, sin, dim);
                long at = ((r * kv_heads + j) * max_len + pos) * dim;
                memcpy(keys + at, k + j * dim, sizeof(float) * dim);
                memcpy(values + at, v + j * dim, sizeof(float) * dim);
            }
            for (long a = 0; a < heads; a++) {
                long j = a / group_size, base = (r * kv_heads + j) * max_len * dim;
                attend(q + a * dim, keys + base, values + base, pos, dim, scaling, scores, attn + i * q_out + a * dim);
            }
        }
        routed_linear(&groups[1], o_widths, attn, proj, n, choice_slot, choice_weight, k, num_slots, rank,
                      members, shrunk);
        for (long i = 0; i < n; i++) {
            for (long c = 0; c < d; c++) x[i * d + c] += proj[i * d + c];
            rms_norm(x + i * d, post_norm, h + i * d, d, eps);
        }
        routed_linear(&groups[2], gu_widths, h, gu, n, choice_slot, choice_weight, k, num_slots, rank,
                      members, shrunk);
        for (long i = 0; i < n; i++)  /* silu(gate) * up, 16 at a time (ffn is a multiple of 16) */
            for (long c = 0; c < ffn; c += 16) {
                v16 gate = v16_load(gu + i * 2 * ffn + c), up = v16_load(gu + i * 2 * ffn + ffn + c);
                v16 sigmoid = v16_div(v16_set1(1.0f), v16_add(v16_set1(1.0f), exp16(v16_sub(v16_zero(), gate))));
                v16_store(act + i * ffn + c, v16_mul(v16_mul(gate, sigmoid), up));
            }
        routed_linear(&groups[3], down_widths, act, proj, n, choice_slot, choice_weight, k, num_slots, rank,
                      members, shrunk);
        for (long i = 0; i < n; i++)
            for (long c = 0; c < d; c++) x[i * d + c] += proj[i * d + c];
    }
    for (long i = 0; i < n; i++) rms_norm(x + i * d, final_norm, h + i * d, d, eps);
    molora_gemm_bf16w_team(h, head, out, n, vpad, d);
    for (long i = 0; i < n; i++) memcpy(logits + rows[i] * vocab, out + i * vpad, sizeof(float) * vocab);
    free(scratch);
    free(longs);
    return 0;
}
