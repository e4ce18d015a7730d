/* The host's Adam/AdamW update of an offloaded shard, in one pass over memory (host_step.py).

   Each element: the gradient is read in its own dtype (fp32, bf16 or fp16) and scaled by the
   unscale/clip factor; the update is torch's fused CPU Adam/AdamW kernel's, operation for
   operation in fp32 (its vectorized path as its compiler contracted it: fused multiply-adds in the
   first moment's lerp, the second moment's sum and Adam's L2 term; none elsewhere, so this file is
   compiled with -ffp-contract=off and says each fma itself);
   the new value is also written in the destination's dtype (fp32, bf16 or fp16, rounded to
   nearest even, as torch's casts round). Memory sees each element once.

   Every element's arithmetic is independent of the others, so a slice gives the same bits as the
   whole, at any split over threads. The last (n mod 16) elements of a shard are left to torch's
   own kernel by the caller: there torch takes its scalar path, whose rounding is its compiler's. */
#ifdef __F16C__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, NONE = -1 };

typedef struct {
    float factor, minus_step_size, wd, decay, w, w_minus_one, beta2, c2, bc2_sqrt, eps;
    int scale, maximize, l2, decays, lerp_small; /* (one flag a select: gcc vectorizes no `a && b` there) */
} params;

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* c10::BFloat16's round to nearest even; NaN -> 0x7FC0 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* One element. Every choice is a select on a loop-invariant flag, not a branch with a memory access
   in it, so the loops below vectorize (gcc -O3 if-converts them); the parameters come by value, so
   no store can alias them. amsgrad is a constant in each loop (its max is a third state tensor). */
static inline float step_one(float g, float *restrict p, float *restrict m, float *restrict v,
                             float *restrict vmax, const params k, const int amsgrad) {
    g = k.scale ? g * k.factor : g;
    g = k.maximize ? g * -1.0f : g;
    float pv = *p;
    g = k.l2 ? fmaf(pv, k.wd, g) : g;             /* Adam's L2 term */
    pv = k.decays ? pv * k.decay : pv;            /* AdamW's decoupled decay */
    float mv = *m;
    mv = k.lerp_small ? fmaf(k.w, g - mv, mv) : fmaf(k.w_minus_one, g - mv, g);
    float vv = fmaf(k.c2 * g, g, *v * k.beta2);
    *m = mv;
    *v = vv;
    float second = vv;
    if (amsgrad) {
        float mx = *vmax;
        mx = (mx != mx || vv != vv) ? NAN : (mx > vv ? mx : vv);
        *vmax = mx;
        second = mx;
    }
    float denom = sqrtf(second) / k.bc2_sqrt + k.eps;
    pv = pv + k.minus_step_size * mv / denom;
    *p = pv;
    return pv;
}

/* One loop per (gradient dtype, destination dtype, amsgrad) over fp32 and bf16, so each is
   straight-line vector code. fp16 goes through them a block at a time (below). SETUP may fix some
   of the flags as constants (the common loops, below). */
#define LOOP(NAME, AMS, SETUP, GT, LOAD, OT, STORE)                                                   \
    static void NAME(float *restrict p, float *restrict m, float *restrict v, float *restrict vmax,  \
                     const void *g_, void *out_, int64_t n, const params k) {                       \
        const GT *restrict g = (const GT *)g_;                                                      \
        OT *restrict out = (OT *)out_;                                                               \
        (void)out, (void)vmax;                                                                       \
        params c = k;                                                                                \
        SETUP;                                                                                       \
        for (int64_t i = 0; i < n; i++) {                                                            \
            float pv = step_one(LOAD, p + i, m + i, v + i, AMS ? vmax + i : 0, c, AMS);              \
            STORE;                                                                                   \
        }                                                                                            \
    }
#define LOOPS_FOR(A, AMS, SETUP)                                                                     \
    LOOP(f32_none##A, AMS, SETUP, float, g[i], float, (void)pv)                                      \
    LOOP(f32_f32##A, AMS, SETUP, float, g[i], float, out[i] = pv)                                    \
    LOOP(f32_bf16##A, AMS, SETUP, float, g[i], uint16_t, out[i] = to_bf16(pv))                       \
    LOOP(bf16_none##A, AMS, SETUP, uint16_t, from_bf16(g[i]), float, (void)pv)                       \
    LOOP(bf16_f32##A, AMS, SETUP, uint16_t, from_bf16(g[i]), float, out[i] = pv)                     \
    LOOP(bf16_bf16##A, AMS, SETUP, uint16_t, from_bf16(g[i]), uint16_t, out[i] = to_bf16(pv))
/* The common case with its flags as constants, folded away after inlining so no select is left: no
   amsgrad, not maximize, no L2 term, the usual betas (the small lerp weight), the factor always
   applied (x 1.0 changes no value), AdamW's decay on or off. The same arithmetic as the others. */
#define COMMON(DECAYS) (c.scale = 1, c.maximize = 0, c.l2 = 0, c.decays = DECAYS, c.lerp_small = 1)
LOOPS_FOR(, 0, (void)0)
LOOPS_FOR(_ams, 1, (void)0)
LOOPS_FOR(_common, 0, COMMON(0))
LOOPS_FOR(_common_decays, 0, COMMON(1))

typedef void (*loop_fn)(float *, float *, float *, float *, const void *, void *, int64_t, const params);
static const loop_fn LOOPS[2][2][3] = {
    {{f32_none, f32_f32, f32_bf16}, {bf16_none, bf16_f32, bf16_bf16}},
    {{f32_none_ams, f32_f32_ams, f32_bf16_ams}, {bf16_none_ams, bf16_f32_ams, bf16_bf16_ams}}};
static const loop_fn COMMON_LOOPS[2][2][3] = { /* [decays] */
    {{f32_none_common, f32_f32_common, f32_bf16_common},
     {bf16_none_common, bf16_f32_common, bf16_bf16_common}},
    {{f32_none_common_decays, f32_f32_common_decays, f32_bf16_common_decays},
     {bf16_none_common_decays, bf16_f32_common_decays, bf16_bf16_common_decays}}};

/* fp16, converted a block at a time through buffers that stay in L1 (gcc does not vectorize
   _Float16 conversions; F16C does them eight at a time, rounding to nearest even as torch's do). */
enum { BLOCK = 512 };

static void from_f16(float *restrict o, const _Float16 *restrict h, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++)
        o[i] = (float)h[i];
}

static void to_f16(_Float16 *restrict o, const float *restrict f, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        o[i] = (_Float16)f[i];
}

static void in_blocks(int ams, float *p, float *m, float *v, float *vmax, const void *g, int g_dtype,
                      void *out, int out_dtype, int64_t n, const params k) {
    float g32[BLOCK], o32[BLOCK];
    const size_t g_size = g_dtype == F32 ? 4 : 2, o_size = out_dtype == F32 ? 4 : 2;
    for (int64_t a = 0; a < n; a += BLOCK) {
        const int64_t len = n - a < BLOCK ? n - a : BLOCK;
        const void *gb = (const char *)g + g_size * a;
        if (g_dtype == F16)
            from_f16(g32, (const _Float16 *)gb, len), gb = g32;
        void *ob = out_dtype == F16 ? (void *)o32 : out_dtype == NONE ? 0 : (char *)out + o_size * a;
        const int gd = g_dtype == F16 ? F32 : g_dtype, od = out_dtype == F16 ? F32 : out_dtype;
        LOOPS[ams][gd][od + 1](p + a, m + a, v + a, ams ? vmax + a : 0, gb, ob, len, k);
        if (out_dtype == F16)
            to_f16((_Float16 *)out + a, o32, len);
    }
}

static void dispatch(const int ams, const params k, float *p, float *m, float *v, float *vmax, const void *g,
                     int g_dtype, void *out, int out_dtype, int64_t n) {
    if (g_dtype == F16 || out_dtype == F16)
        in_blocks(ams, p, m, v, vmax, g, g_dtype, out, out_dtype, n, k);
    else if (!ams && !k.maximize && !k.l2 && k.lerp_small)
        COMMON_LOOPS[k.decays][g_dtype][out_dtype + 1](p, m, v, vmax, g, out, n, k);
    else
        LOOPS[ams][g_dtype][out_dtype + 1](p, m, v, vmax, g, out, n, k);
}

/* The scalars are given as torch computes them, in double (lr / bias_correction1, ...), and
   rounded to fp32 here, as torch's kernel rounds them. Elements go in slices of `slice` (0: one
   piece) over `threads` OpenMP threads where built with OpenMP: the same runtime as torch's
   (libgomp.so.1, loaded with torch), so its idle threads and ours take turns instead of spinning
   against each other. Any split gives the same bits (each element is on its own). Returns 0, or -1
   for an unknown dtype. */
int zeroshard_adam_step(float *p, float *m, float *v, float *vmax, const void *g, int g_dtype, void *out,
                        int out_dtype, int64_t n, double factor, int adamw, int maximize, int amsgrad,
                        double lr, double weight_decay, double beta1, double beta2, double eps,
                        double step_size, double bc2_sqrt, int64_t slice, int threads) {
    if (g_dtype < F32 || g_dtype > F16 || out_dtype < NONE || out_dtype > F16)
        return -1;
    params k;
    k.factor = (float)factor;
    k.scale = factor != 1.0;
    k.minus_step_size = (float)(-step_size);
    k.wd = (float)weight_decay;
    k.decay = (float)(1 - lr * weight_decay);
    k.w = (float)(1 - beta1);
    k.w_minus_one = k.w - 1.0f;
    k.lerp_small = fabsf(k.w) < 0.5f;
    k.beta2 = (float)beta2;
    k.c2 = (float)(1 - beta2);
    k.bc2_sqrt = (float)bc2_sqrt;
    k.eps = (float)eps;
    k.maximize = maximize;
    k.l2 = weight_decay != 0.0 && !adamw;
    k.decays = weight_decay != 0.0 && adamw;
    const int ams = amsgrad != 0;
    const int64_t step = slice > 0 ? slice : (n > 0 ? n : 1), pieces = (n + step - 1) / step;
    const size_t g_size = g_dtype == F32 ? 4 : 2, o_size = out_dtype == F32 ? 4 : 2;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1) if (pieces > 1)
#endif
    for (int64_t s = 0; s < pieces; s++) {
        const int64_t a = s * step, len = n - a < step ? n - a : step;
        dispatch(ams, k, p + a, m + a, v + a, ams ? vmax + a : 0, (const char *)g + g_size * a, g_dtype,
                 out_dtype == NONE ? 0 : (char *)out + o_size * a, out_dtype, len);
    }
    return 0;
}
