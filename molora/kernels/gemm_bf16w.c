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

/* output blocks [first, last) of y (16 outputs each; row stride o) */
static void blocks_of(const float *x, const uint16_t *w, float *y, long n, long o, long k, long first, long last) {
    long i, b;
    for (b = first; b + 4 <= last; b += 4) { EVERY_ROW(4) }
    for (; b < last; b++) { EVERY_ROW(1) }
}

void molora_gemm_bf16w(const float *x, const uint16_t *w, float *y, long n, long o, long k) {
    blocks_of(x, w, y, n, o, k, 0, o / 16);
}

/* The two-core GEMM of a step of few rows (molora_gemm_bf16w_team): a lone visitor's step is bound by reading its
   weights, so the two cores each read half of them, the caller the first half of the output blocks and one helper
   thread the second. Either may compute the second half: the caller, done with its own, takes it back when the
   helper has not started it (a helper kept off its core by other work never makes the caller wait), so the call is
   never much slower than one thread. Every output is one FMA chain in either thread: the same numbers as
   molora_gemm_bf16w. One job at a time (a second caller meanwhile computes alone); the helper spins briefly, then
   sleeps until the next job. */
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#ifdef __x86_64__
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() sched_yield()
#endif

enum { IDLE, POSTED, CLAIMED, DONE };
enum { SPIN = 20000, TEAM_MAX_ROWS = 4, TEAM_MIN_BLOCKS = 16 };

static struct {
    const float *x;
    const uint16_t *w;
    float *y;
    long n, o, k, first, last;
} job;
static atomic_int job_state = IDLE, job_owner = 0, team_on = 0, helper_asleep = 0;
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t team_wake = PTHREAD_COND_INITIALIZER;

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&job_state, memory_order_acquire) != POSTED) {
            if (++spins < SPIN) { RELAX(); continue; }
            pthread_mutex_lock(&team_lock);
            atomic_store(&helper_asleep, 1);
            while (atomic_load(&job_state) != POSTED) pthread_cond_wait(&team_wake, &team_lock);
            atomic_store(&helper_asleep, 0);
            pthread_mutex_unlock(&team_lock);
        }
        int posted = POSTED;
        if (atomic_compare_exchange_strong(&job_state, &posted, CLAIMED)) {
            blocks_of(job.x, job.w, job.y, job.n, job.o, job.k, job.first, job.last);
            atomic_store_explicit(&job_state, DONE, memory_order_release);
        }
    }
    return NULL;
}

static int helper_started = 0;

/* a forked child has no helper thread (and may hold a copy of a lock the helper held): one thread there */
static void after_fork_in_child(void) {
    helper_started = 0;
    atomic_store(&team_on, 0);
    atomic_store(&helper_asleep, 0);
    atomic_store(&job_state, IDLE);
    atomic_store(&job_owner, 0);
    pthread_mutex_init(&team_lock, NULL);
    pthread_cond_init(&team_wake, NULL);
}

/* Switch the helper on (starting its thread once) or off; returns whether it is on. (Callers come through ctypes,
   which lets go of the GIL: two engines may call at once, so the start is made under the lock.) */
int molora_gemm_team(int on) {
    static int fork_handler = 0;
    pthread_mutex_lock(&team_lock);
    if (!fork_handler) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        fork_handler = 1;
    }
    if (on && !helper_started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper, NULL) == 0) {
            pthread_detach(thread);
            helper_started = 1;
        }
    }
    int now_on = on && helper_started;
    atomic_store(&team_on, now_on);
    pthread_mutex_unlock(&team_lock);
    return now_on;
}

void molora_gemm_bf16w_team(const float *x, const uint16_t *w, float *y, long n, long o, long k) {
    long blocks = o / 16, half = blocks / 2;
    int free_slot = 0;
    if (!atomic_load(&team_on) || n > TEAM_MAX_ROWS || blocks < TEAM_MIN_BLOCKS ||
        !atomic_compare_exchange_strong(&job_owner, &free_slot, 1)) {
        blocks_of(x, w, y, n, o, k, 0, blocks);
        return;
    }
    job.x = x; job.w = w; job.y = y; job.n = n; job.o = o; job.k = k; job.first = half; job.last = blocks;
    atomic_store_explicit(&job_state, POSTED, memory_order_release);
    if (atomic_load(&helper_asleep)) {
        pthread_mutex_lock(&team_lock);
        pthread_cond_signal(&team_wake);
        pthread_mutex_unlock(&team_lock);
    }
    blocks_of(x, w, y, n, o, k, 0, half);
    int posted = POSTED;
    if (atomic_compare_exchange_strong(&job_state, &posted, CLAIMED))  /* not started: take it back */
        blocks_of(x, w, y, n, o, k, half, blocks);
    else
        while (atomic_load_explicit(&job_state, memory_order_acquire) != DONE) RELAX();
    atomic_store(&job_state, IDLE);
    atomic_store(&job_owner, 0);
}
