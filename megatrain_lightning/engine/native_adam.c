/* Adam(W) of fp32 master weights and moments from bf16 gradients, in one pass over memory.
 *
 * Compiled at first use by native_adam.py (cc -O3 -march=native -ffp-contract=off -fno-math-errno -fopenmp)
 * and called through ctypes. Why it exists: torch's fused CPU AdamW takes gradients of the parameter's
 * dtype only, so bf16 gradients had to be widened into scratch first, one more pass per chunk. Here each
 * element's gradient is widened in a register: 26 bytes of host memory traffic per parameter instead of
 * 28 (fp32 gradients) or 28 + scratch (widen, then torch's kernel).
 *
 * The arithmetic is torch's fused kernel's (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), operation for
 * operation in fp32, with the coefficients computed in double as there: its vectorised path, which covers
 * all but the last numel % V elements of each parameter (V = torch's float vector width). Those few
 * (a "tail", under 16 per parameter) take torch's scalar loop, whose arithmetic depends on how the
 * compiler that built torch vectorised and contracted it; the caller hands them to torch's own kernel.
 * Whether torch's build fused a multiply and an add of the vectorised path into one FMA is a property of
 * that build too, so the candidate spellings of each such line are compiled as variants (flags), and
 * native_adam.py keeps the one that reproduces the installed torch bit for bit, or none.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define V_FMA 1        /* vector path: exp_avg_sq = fma(c2 * g, g, exp_avg_sq * beta2) */
#define V_FMA_SQ 2     /* vector path: exp_avg_sq = fma(exp_avg_sq, beta2, c2 * g * g) */
#define WD_FMA 4       /* Adam (L2) decay: g = fma(p, wd, g) */

typedef struct {
    int64_t start;    /* first element of this piece in the flat buffers */
    int64_t end;      /* one past its last */
    int64_t tail;     /* where its parameter's tail begins (the caller updates [tail, end) with torch) */
    double step;      /* the parameter's step count, already incremented */
} piece_t;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int32_t decoupled, maximize;
} hyper_t;

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef struct {
    float ss_neg, bc2s, eps, c1, c1m1, c2, beta2, decay, wd, sign;
    int small;
} coef_t;

static coef_t coefficients(const hyper_t *h, double step) {
    /* as torch: in double, then each narrowed to float where it is used */
    double bc1 = 1 - pow(h->beta1, step);
    double bc2 = 1 - pow(h->beta2, step);
    double step_size = h->lr / bc1;
    double c1 = 1 - h->beta1, c2 = 1 - h->beta2;
    coef_t c;
    c.ss_neg = (float)(-step_size);
    c.bc2s = (float)sqrt(bc2);
    c.eps = (float)h->eps;
    c.c1 = (float)c1;
    c.c1m1 = (float)c1 - 1.0f;
    c.small = fabsf((float)c1) < 0.5f;
    c.c2 = (float)c2;
    c.beta2 = (float)h->beta2;
    c.decay = (h->weight_decay != 0.0 && h->decoupled) ? (float)(1 - h->lr * h->weight_decay) : 1.0f;
    c.sign = h->maximize ? -1.0f : 1.0f;
    c.wd = (float)h->weight_decay;
    return c;
}

/* torch's vectorised path, one element per iteration. The compiler vectorises this loop: the variant and
 * the kind of decay are compile-time constants in each instantiation (no control flow in the loop), and
 * -ffp-contract=off leaves the fmaf calls as the only fused multiply-adds, as in torch's source or build.
 * Multiplying by sign (1 or -1) and by decay (1 when there is no decoupled decay) is exact, so the
 * maximize and AdamW branches need no instantiations of their own. */
static inline __attribute__((always_inline)) void vector_body(
        float *restrict p, float *restrict m, float *restrict v, const uint16_t *restrict g16, int64_t n,
        const coef_t c, const int vmode, const int l2mode) {
    const float base_sel = c.small ? 1.0f : 0.0f;
    const float coeff = c.small ? c.c1 : c.c1m1;
    for (int64_t i = 0; i < n; i++) {
        float g = widen(g16[i]) * c.sign;
        float pv = p[i] * c.decay;
        if (l2mode == 1) g = g + pv * c.wd;
        if (l2mode == 2) g = fmaf(pv, c.wd, g);
        float mv = m[i];
        float base = base_sel != 0.0f ? mv : g;
        mv = fmaf(coeff, g - mv, base);
        float c2g = c.c2 * g;
        float sq;
        if (vmode == 1) sq = fmaf(c2g, g, v[i] * c.beta2);
        else if (vmode == 2) sq = fmaf(v[i], c.beta2, c2g * g);
        else sq = v[i] * c.beta2 + c2g * g;
        m[i] = mv;
        v[i] = sq;
        float denom = sqrtf(sq) / c.bc2s + c.eps;
        p[i] = pv + (c.ss_neg * mv) / denom;
    }
}

#define BODY(VM, L2) vector_body(p, m, v, g16, n, c, VM, L2); return
static void vector_run(float *p, float *m, float *v, const uint16_t *g16, int64_t n, const coef_t c,
                       const hyper_t *h, int flags) {
    const int vmode = (flags & V_FMA) ? 1 : (flags & V_FMA_SQ) ? 2 : 0;
    const int l2 = (h->weight_decay != 0.0 && !h->decoupled) ? ((flags & WD_FMA) ? 2 : 1) : 0;
    switch (vmode * 3 + l2) {
        case 0: BODY(0, 0); case 1: BODY(0, 1); case 2: BODY(0, 2);
        case 3: BODY(1, 0); case 4: BODY(1, 1); case 5: BODY(1, 2);
        case 6: BODY(2, 0); case 7: BODY(2, 1); default: BODY(2, 2);
    }
}
#undef BODY

/* The elements [a, b) of the pieces (sorted, disjoint), tails left out. */
static void run_range(float *p, float *m, float *v, const uint16_t *g, const piece_t *pieces, int64_t npieces,
                      int64_t a, int64_t b, const hyper_t *h, int flags) {
    int64_t lo = 0, hi = npieces;  /* first piece whose end > a */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (pieces[mid].end <= a) lo = mid + 1; else hi = mid;
    }
    for (int64_t k = lo; k < npieces && pieces[k].start < b; k++) {
        const piece_t *pc = &pieces[k];
        int64_t s = pc->start > a ? pc->start : a;
        int64_t e = pc->end < b ? pc->end : b;
        if (s >= e) continue;
        coef_t c = coefficients(h, pc->step);
        if (pc->tail < e) e = pc->tail;
        if (e > s) vector_run(p + s, m + s, v + s, g + s, e - s, c, h, flags);
    }
}

/* The update of the pieces' elements but their tails, split over `threads` OpenMP threads into contiguous
 * runs of at least 4096 elements (the arithmetic of an element depends on nothing but its own values, so
 * the split does not change the result). Called with the GIL released (ctypes); returns when done. */
void megatrain_adam_bf16_grad(float *p, float *m, float *v, const uint16_t *g, const piece_t *pieces,
                              int64_t npieces, const hyper_t *h, int flags, int threads) {
    if (npieces <= 0) return;
    int64_t lo = pieces[0].start, hi = pieces[npieces - 1].end;
    if (threads < 1) threads = 1;
    int64_t per = ((hi - lo) / threads + 15) / 16 * 16;
    if (per < 4096) per = 4096;
    int64_t parts = (hi - lo + per - 1) / per;
    if (parts < 1) parts = 1;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (parts > 1)
    for (int64_t i = 0; i < parts; i++) {
        int64_t a = lo + i * per;
        int64_t b = a + per < hi ? a + per : hi;
        run_range(p, m, v, g, pieces, npieces, a, b, h, flags);
    }
}
