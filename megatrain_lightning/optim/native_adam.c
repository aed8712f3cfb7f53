/* Host Adam(W) in one pass over memory: fp32 master weights and moments from bf16 gradients
 * (megatrain_adam_bf16_grad), and the compact state's bf16/int16 halves and bf16 moments
 * (megatrain_adam_compact, below).
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

/* The length of each thread's contiguous run over n elements: a multiple of 16, at least 4096. */
static int64_t run_length(int64_t n, int threads) {
    int64_t per = (n / (threads < 1 ? 1 : threads) + 15) / 16 * 16;
    return per < 4096 ? 4096 : per;
}

/* The update of the pieces' elements but their tails, split over `threads` OpenMP threads into contiguous
 * runs of at least 4096 elements (the arithmetic of an element depends on nothing but its own values, so
 * the split does not change the result). Called with the GIL released (ctypes); returns when done. */
void megatrain_adam_bf16_grad(float *p, float *m, float *v, const uint16_t *g, const piece_t *pieces,
                              int64_t npieces, const hyper_t *h, int flags, int threads) {
    if (npieces <= 0) return;
    int64_t lo = pieces[0].start, hi = pieces[npieces - 1].end;
    int64_t per = run_length(hi - lo, threads), parts = (hi - lo + per - 1) / per;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static, 1) if (parts > 1)
    for (int64_t i = 0; i < parts; i++) {
        int64_t a = lo + i * per;
        int64_t b = a + per < hi ? a + per : hi;
        run_range(p, m, v, g, pieces, npieces, a, b, h, flags);
    }
}

/* ------------------------------------------------------------------------------------- compact state
 * host_state="compact": the fp32 master as a bf16 high half and an int16 low half, bf16 moments rounded
 * stochastically (host_adam.compact_adam_step says why). The same update as host_adam's chunked path,
 * bit for bit, in one pass: per element, join the halves, widen the moments and the gradient, torch's
 * vectorised arithmetic, split the weight, round the moments with the element's dither. 16 or 18 bytes
 * of host memory per parameter (bf16 or fp32 gradient) instead of the chunked path's 14 passes.
 */
typedef struct {
    int64_t start, end, tail;  /* [start, tail) here; [tail, end) by the caller, through torch's tail loop */
    double step;               /* already incremented; also the dither's offset */
    const void *grad;          /* the span's gradient: element 0 is the store's element `start` */
    int32_t grad_bf16;         /* bf16 (1) or fp32 (0) */
} span_t;

/* fp32 bits -> bf16 bits, round to nearest even (c10::BFloat16's rounding); a NaN stays a NaN. */
static inline uint16_t to_bf16_rne(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

static inline __attribute__((always_inline)) void compact_body(
        uint16_t *restrict hi, int16_t *restrict lo, uint16_t *restrict m16, uint16_t *restrict v16,
        const void *restrict grad, const int32_t *restrict dm, const int32_t *restrict dv, int64_t n,
        const coef_t c, const int vmode, const int l2mode, const int has_lo, const int g_bf16) {
    const float base_sel = c.small ? 1.0f : 0.0f;
    const float coeff = c.small ? c.c1 : c.c1m1;
    for (int64_t i = 0; i < n; i++) {
        uint32_t wb = (uint32_t)hi[i] << 16;
        if (has_lo) wb += (uint32_t)(int32_t)lo[i];  /* the sign-extended low half undoes hi's round-up */
        float g = g_bf16 ? widen(((const uint16_t *)grad)[i]) : ((const float *)grad)[i];
        g = g * c.sign;
        float pv = float_of(wb) * c.decay;
        if (l2mode == 1) g = g + pv * c.wd;
        if (l2mode == 2) g = fmaf(pv, c.wd, g);
        float mv = widen(m16[i]);
        float base = base_sel != 0.0f ? mv : g;
        mv = fmaf(coeff, g - mv, base);
        float c2g = c.c2 * g;
        float vv = widen(v16[i]);
        float sq;
        if (vmode == 1) sq = fmaf(c2g, g, vv * c.beta2);
        else if (vmode == 2) sq = fmaf(vv, c.beta2, c2g * g);
        else sq = vv * c.beta2 + c2g * g;
        float denom = sqrtf(sq) / c.bc2s + c.eps;
        pv = pv + (c.ss_neg * mv) / denom;
        uint32_t pb = bits_of(pv);
        if (has_lo) {
            lo[i] = (int16_t)(uint16_t)(pb & 0xFFFFu);
            hi[i] = (uint16_t)((pb + 0x8000u) >> 16);  /* ties away from zero: join undoes it exactly */
        } else {
            hi[i] = to_bf16_rne(pb);
        }
        /* stochastic rounding: add 16 random bits, clear the low 16 (exactly representable after) */
        m16[i] = to_bf16_rne((bits_of(mv) + (uint32_t)dm[i]) & 0xFFFF0000u);
        v16[i] = to_bf16_rne((bits_of(sq) + (uint32_t)dv[i]) & 0xFFFF0000u);
    }
}

#define CBODY(VM, L2, LO, GB) compact_body(hi, lo, m16, v16, grad, dm, dv, n, c, VM, L2, LO, GB); return
static void compact_run(uint16_t *hi, int16_t *lo, uint16_t *m16, uint16_t *v16, const void *grad,
                        const int32_t *dm, const int32_t *dv, int64_t n, const coef_t c, const hyper_t *h,
                        int flags, int g_bf16) {
    const int vmode = (flags & V_FMA) ? 1 : (flags & V_FMA_SQ) ? 2 : 0;
    const int l2 = (h->weight_decay != 0.0 && !h->decoupled) ? ((flags & WD_FMA) ? 2 : 1) : 0;
    const int key = ((vmode * 3 + l2) * 2 + (lo != NULL)) * 2 + g_bf16;
    switch (key) {
#define CASES(VM, L2) \
        case ((VM * 3 + L2) * 2 + 0) * 2 + 0: CBODY(VM, L2, 0, 0); \
        case ((VM * 3 + L2) * 2 + 0) * 2 + 1: CBODY(VM, L2, 0, 1); \
        case ((VM * 3 + L2) * 2 + 1) * 2 + 0: CBODY(VM, L2, 1, 0); \
        case ((VM * 3 + L2) * 2 + 1) * 2 + 1: CBODY(VM, L2, 1, 1);
        CASES(0, 0) CASES(0, 1) CASES(0, 2) CASES(1, 0) CASES(1, 1) CASES(1, 2) CASES(2, 0) CASES(2, 1) CASES(2, 2)
#undef CASES
        default: return;
    }
}
#undef CBODY

/* The elements [a, b) of the spans, tails left out; the dither of store element e at step s is
 * dither[(e + s * dstep) % period] (the first moment) and dither[(e + s * dstep + dshift) % period]. */
static void compact_range(uint16_t *hi, int16_t *lo, uint16_t *m16, uint16_t *v16, const span_t *spans,
                          int64_t nspans, int64_t a, int64_t b, const hyper_t *h, int flags,
                          const int32_t *dither, int64_t period, int64_t dstep, int64_t dshift) {
    int64_t first = 0, last = nspans;
    while (first < last) {
        int64_t mid = (first + last) / 2;
        if (spans[mid].end <= a) first = mid + 1; else last = mid;
    }
    for (int64_t k = first; k < nspans && spans[k].start < b; k++) {
        const span_t *sp = &spans[k];
        int64_t s = sp->start > a ? sp->start : a;
        int64_t e = sp->end < b ? sp->end : b;
        if (sp->tail < e) e = sp->tail;
        if (s >= e) continue;
        coef_t c = coefficients(h, sp->step);
        int64_t stepi = (int64_t)sp->step;
        int64_t im = (s + stepi * dstep) % period, iv = (im + dshift) % period;
        size_t gsize = sp->grad_bf16 ? 2 : 4;
        while (s < e) {  /* segments in which neither dither index wraps around */
            int64_t len = e - s;
            if (period - im < len) len = period - im;
            if (period - iv < len) len = period - iv;
            const char *g = (const char *)sp->grad + (size_t)(s - sp->start) * gsize;
            compact_run(hi + s, lo ? lo + s : NULL, m16 + s, v16 + s, g, dither + im, dither + iv, len, c, h,
                        flags, sp->grad_bf16);
            s += len;
            im = (im + len) % period;
            iv = (iv + len) % period;
        }
    }
}

void megatrain_adam_compact(uint16_t *hi, int16_t *lo, uint16_t *m16, uint16_t *v16, const span_t *spans,
                            int64_t nspans, const hyper_t *h, int flags, int threads, const int32_t *dither,
                            int64_t period, int64_t dstep, int64_t dshift) {
    if (nspans <= 0) return;
    int64_t first = spans[0].start, end = spans[nspans - 1].end;
    int64_t per = run_length(end - first, threads), parts = (end - first + per - 1) / per;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static, 1) if (parts > 1)
    for (int64_t i = 0; i < parts; i++) {
        int64_t a = first + i * per;
        int64_t b = a + per < end ? a + per : end;
        compact_range(hi, lo, m16, v16, spans, nspans, a, b, h, flags, dither, period, dstep, dshift);
    }
}
