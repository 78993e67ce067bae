/* One-pass deviation statistics of three outputs (flashprobe.probe.native).
 *
 * For every element it reads the primary p, the baseline b and (when given) the float64 golden g
 * once, and accumulates for each pair (p, b), (p, g), (b, g) the seven rows of
 * flashprobe.probe.stats.pair_sums: max |d|, sum |d|, sum d^2, sum r^2, non-finite count, count
 * and max |r| (d = first - reference in float64, r = the reference), over the positions where d is
 * finite. The differences are exact float64 differences of the inputs' values, as in the tensor
 * path.
 *
 * Determinism: the elements are taken in flat (row-major) index order i, whatever the tensors'
 * strides; each chunk of `chunk` elements sums into L independent lanes (element i into lane
 * i mod L), the lanes are added in order, and the chunks are folded in order by fp_fold. No
 * reassociation happens anywhere (compiled without -ffast-math and with -ffp-contract=off), so the
 * result depends only on the values, the shape and the chunk size: not on the strides, the vector
 * width the compiler chose, the thread count, or the order chunks were computed in.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define L 8     /* lanes: one vector of L float64 per statistic (any vector width runs it) */
#define AHEAD 8 /* rows prefetched ahead when rows are walked one by one */
#define ROWS 7  /* max_abs, sum_abs, sum_sq_diff, sum_sq_ref, nonfinite, count, max_ref */

typedef double vd __attribute__((vector_size(L * sizeof(double))));
typedef int64_t vi __attribute__((vector_size(L * sizeof(int64_t))));
typedef float vf __attribute__((vector_size(L * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(L * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(L * sizeof(uint16_t))));

/* Lane-wise select, |x| and max ("a > b ? a : b", as the order of a scalar loop would give). */
static inline vd select(vi m, vd a, vd b) { return (vd)((m & (vi)a) | (~m & (vi)b)); }
static inline vd vabs(vd x) { return (vd)((vi)x & INT64_MAX); }
static inline vd vmax(vd a, vd b) { return select(a > b, a, b); }

/* L consecutive elements as float64. */
static inline vd load_f32(const float *x) {
    vf v;
    memcpy(&v, x, sizeof v);
    return __builtin_convertvector(v, vd);
}
static inline vd load_f64(const double *x) {
    vd v;
    memcpy(&v, x, sizeof v);
    return v;
}
static inline vd load_bf16(const uint16_t *x) {
    vh h;
    memcpy(&h, x, sizeof h);
    vu bits = __builtin_convertvector(h, vu) << 16; /* bfloat16 is the top half of a float32 */
    return __builtin_convertvector((vf)bits, vd);
}
/* One element as float64. */
static inline double one_f32(const float *x) { return (double)*x; }
static inline double one_f64(const double *x) { return *x; }
static inline double one_bf16(const uint16_t *x) {
    uint32_t bits = (uint32_t)*x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

/* The running statistics of one pair, lane by lane. */
typedef struct {
    vd mx, sa, sq, sr, mr, nf;
} acc_t;

/* Add the differences a - r of one group to a pair: over the lanes where it is finite, |d| to the
 * maximum and sums, r to the reference sums; 1 to the non-finite count where it is not. */
static inline void step(acc_t *A, vd a, vd r) {
    vd d = a - r, ad = vabs(d);
    vi ok = ad <= DBL_MAX; /* false for NaN and +-inf */
    vd dm = (vd)((vi)ad & ok), rm = (vd)((vi)vabs(r) & ok);
    A->mx = vmax(dm, A->mx);
    A->sa += dm;
    A->sq += dm * dm;
    A->sr += rm * rm;
    A->mr = vmax(rm, A->mr);
    A->nf += (vd)(~ok & (vi)((vd){0} + 1.0));
}

/* step() for values that are all finite, without the masks; the reference sums are added by
 * step_ref(), once per reference (the golden pairs share theirs). A non-finite value makes the
 * sums non-finite, and the chunk is then taken again with step(); when every value is finite the
 * result is step()'s, bit for bit. */
static inline void step_diff(acc_t *A, vd a, vd r) {
    vd ad = vabs(a - r);
    A->mx = vmax(ad, A->mx);
    A->sa += ad;
    A->sq += ad * ad;
}
static inline void step_ref(acc_t *A, vd r) {
    vd ar = vabs(r);
    A->sr += ar * ar;
    A->mr = vmax(ar, A->mr);
}

/* Whether every sum of the pairs is finite (then every value was). */
static int all_finite(const acc_t *A, int P) {
    for (int j = 0; j < P; j++) {
        double v[3][L];
        memcpy(v[0], &A[j].sa, sizeof v[0]);
        memcpy(v[1], &A[j].sq, sizeof v[1]);
        memcpy(v[2], &A[j].sr, sizeof v[2]);
        for (int k = 0; k < 3; k++)
            for (int l = 0; l < L; l++)
                if (!(fabs(v[k][l]) <= DBL_MAX)) return 0;
    }
    return 1;
}

/* The (ROWS, P) statistics of the elements with flat (row-major) index in [start, end) into out.
 * The tensors are 4-D, sizes z[4], strides sp/sb/sg[4]. Rows (the last dimension) are walked in
 * segments; element i goes to lane (i - start) mod L whatever the strides, so a strided tensor
 * gives the bits its contiguous copy gives. Whole groups of a segment are read as vectors (in
 * place when the last-dimension strides are all 1); the elements of a group that spans two rows
 * are gathered into a pending group, and the last pending group is padded with zeros, which change
 * no statistic (the count is end - start - non-finite). */
#define CHUNK_FN(NAME, T, LOAD, ONE, GOLD, MASKED)                                                 \
    static int NAME(const T *p, const T *b, const double *g, const int64_t *z, const int64_t *sp, \
                     const int64_t *sb, const int64_t *sg, int64_t start, int64_t end,             \
                     double *out) {                                                                \
        acc_t A[3];                                                                                \
        memset(A, 0, sizeof A);                                                                    \
        double qp[L], qb[L], qg[L]; /* the pending group */                                        \
        int fill = 0;                                                                              \
        const int64_t D = z[3], rows = z[0] * z[1] * z[2];                                         \
        const int64_t ps = sp[3], bs = sb[3], gs = GOLD ? sg[3] : 1;                               \
        const int unit = ps == 1 && bs == 1 && gs == 1;                                            \
        for (int64_t i = start; i < end;) {                                                        \
            int64_t row = i / D, j = i - row * D, seg = D - j < end - i ? D - j : end - i;         \
            int64_t i2 = row % z[2], r1 = row / z[2], i1 = r1 % z[1], i0 = r1 / z[1];              \
            const T *pr = p + i0 * sp[0] + i1 * sp[1] + i2 * sp[2] + j * ps;                      \
            const T *br = b + i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + j * bs;                      \
            const double *gr = GOLD ? g + i0 * sg[0] + i1 * sg[1] + i2 * sg[2] + j * gs : 0;      \
            if (D >= 16 && row + AHEAD < rows) { /* short rows: fetch the row AHEAD rows on */     \
                int64_t ra = row + AHEAD, a2 = ra % z[2], q1 = ra / z[2], a1 = q1 % z[1];          \
                int64_t a0 = q1 / z[1];                                                            \
                const char *pa = (const char *)(p + a0 * sp[0] + a1 * sp[1] + a2 * sp[2]);         \
                const char *ba = (const char *)(b + a0 * sb[0] + a1 * sb[1] + a2 * sb[2]);         \
                for (int64_t o = 0; o < D * (int64_t)sizeof(T); o += 64) {                         \
                    __builtin_prefetch(pa + o);                                                    \
                    __builtin_prefetch(ba + o);                                                    \
                }                                                                                  \
                if (GOLD) {                                                                        \
                    const char *ga = (const char *)(g + a0 * sg[0] + a1 * sg[1] + a2 * sg[2]);     \
                    for (int64_t o = 0; o < D * 8; o += 64) __builtin_prefetch(ga + o);            \
                }                                                                                  \
            }                                                                                      \
            int64_t t = 0;                                                                         \
            for (; fill && t < seg; t++) { /* complete the pending group */                        \
                qp[fill] = ONE(pr + t * ps);                                                       \
                qb[fill] = ONE(br + t * bs);                                                       \
                if (GOLD) qg[fill] = gr[t * gs];                                                   \
                if (++fill == L) {                                                                 \
                    GROUP(GOLD, MASKED, load_f64(qp), load_f64(qb), load_f64(qg));                         \
                    fill = 0;                                                                      \
                }                                                                                  \
            }                                                                                      \
            if (unit) {                                                                            \
                for (; t + L <= seg; t += L)                                                       \
                    GROUP(GOLD, MASKED, LOAD(pr + t), LOAD(br + t), load_f64(gr + t));                     \
            } else {                                                                               \
                for (; t + L <= seg; t += L) {                                                     \
                    for (int l = 0; l < L; l++) {                                                  \
                        qp[l] = ONE(pr + (t + l) * ps);                                            \
                        qb[l] = ONE(br + (t + l) * bs);                                            \
                        if (GOLD) qg[l] = gr[(t + l) * gs];                                        \
                    }                                                                              \
                    GROUP(GOLD, MASKED, load_f64(qp), load_f64(qb), load_f64(qg));                         \
                }                                                                                  \
            }                                                                                      \
            for (; t < seg; t++, fill++) { /* the rest starts a pending group */                   \
                qp[fill] = ONE(pr + t * ps);                                                       \
                qb[fill] = ONE(br + t * bs);                                                       \
                if (GOLD) qg[fill] = gr[t * gs];                                                   \
            }                                                                                      \
            i += t;                                                                                \
        }                                                                                          \
        if (fill) {                                                                                \
            for (int l = fill; l < L; l++) qp[l] = qb[l] = qg[l] = 0.0;                           \
            GROUP(GOLD, MASKED, load_f64(qp), load_f64(qb), load_f64(qg));                                 \
        }                                                                                          \
        if (!MASKED) {                                                                             \
            if (!all_finite(A, GOLD ? 2 : 1)) return 0;                                            \
            if (GOLD) { /* the pair (b, g) has the golden reference of (p, g) */                   \
                A[2].sr = A[1].sr;                                                                 \
                A[2].mr = A[1].mr;                                                                 \
            }                                                                                      \
        }                                                                                          \
        finish(A, GOLD ? 3 : 1, end - start, out);                                                 \
        return 1;                                                                                  \
    }

/* One group: the pair (p, b) and, with GOLD, (p, g) and (b, g). */
#define GROUP(GOLD, MASKED, P, B, G)                                                               \
    do {                                                                                           \
        vd pv_ = P, bv_ = B;                                                                       \
        if (MASKED) {                                                                              \
            step(&A[0], pv_, bv_);                                                                 \
            if (GOLD) {                                                                            \
                vd gv_ = G;                                                                        \
                step(&A[1], pv_, gv_);                                                             \
                step(&A[2], bv_, gv_);                                                             \
            }                                                                                      \
        } else {                                                                                   \
            step_diff(&A[0], pv_, bv_);                                                            \
            step_ref(&A[0], bv_);                                                                  \
            if (GOLD) {                                                                            \
                vd gv_ = G;                                                                        \
                step_diff(&A[1], pv_, gv_);                                                        \
                step_diff(&A[2], bv_, gv_);                                                        \
                step_ref(&A[1], gv_);                                                              \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Lanes added in order into the (ROWS, P) rows of out (row-major); n elements in all. */
static void finish(const acc_t *A, int P, int64_t n, double *out) {
    for (int j = 0; j < P; j++) {
        double mx[L], sa[L], sq[L], sr[L], mr[L], nf[L];
        memcpy(mx, &A[j].mx, sizeof mx);
        memcpy(sa, &A[j].sa, sizeof sa);
        memcpy(sq, &A[j].sq, sizeof sq);
        memcpy(sr, &A[j].sr, sizeof sr);
        memcpy(mr, &A[j].mr, sizeof mr);
        memcpy(nf, &A[j].nf, sizeof nf);
        double row[ROWS] = {0, 0, 0, 0, 0, 0, 0};
        for (int l = 0; l < L; l++) {
            row[0] = mx[l] > row[0] ? mx[l] : row[0];
            row[1] += sa[l];
            row[2] += sq[l];
            row[3] += sr[l];
            row[4] += nf[l];
            row[6] = mr[l] > row[6] ? mr[l] : row[6];
        }
        row[5] = (double)n - row[4];
        for (int k = 0; k < ROWS; k++) out[k * P + j] = row[k];
    }
}

/* Chunks [c0, c1) of the n = size[0]*size[1]*size[2]*size[3] elements (chunk elements each, the
 * last one shorter) into partials, (c1 - c0, ROWS, P) row-major. The tensors are 4-D with the
 * sizes in size[4] and their strides in st[0..3] (p), st[4..7] (b), st[8..11] (g); g may be NULL
 * (then P = 1). */
#define RANGE_FN(NAME, T, LOAD, ONE)                                                               \
    CHUNK_FN(NAME##_gold_fast, T, LOAD, ONE, 1, 0)                                                 \
    CHUNK_FN(NAME##_gold, T, LOAD, ONE, 1, 1)                                                      \
    CHUNK_FN(NAME##_plain_fast, T, LOAD, ONE, 0, 0)                                                \
    CHUNK_FN(NAME##_plain, T, LOAD, ONE, 0, 1)                                                     \
    void NAME(const T *p, const T *b, const double *g, const int64_t *size, const int64_t *st,    \
              int64_t chunk, int64_t c0, int64_t c1, double *partials) {                           \
        const int64_t P = g ? 3 : 1, n = size[0] * size[1] * size[2] * size[3];                    \
        for (int64_t c = c0; c < c1; c++) {                                                        \
            int64_t start = c * chunk, end = n - start < chunk ? n : start + chunk;                \
            double *out = partials + (c - c0) * ROWS * P;                                          \
            const int64_t *sp = st, *sb = st + 4, *sg = st + 8;                                    \
            if (g && !NAME##_gold_fast(p, b, g, size, sp, sb, sg, start, end, out))                \
                NAME##_gold(p, b, g, size, sp, sb, sg, start, end, out);                           \
            if (!g && !NAME##_plain_fast(p, b, g, size, sp, sb, sg, start, end, out))              \
                NAME##_plain(p, b, g, size, sp, sb, sg, start, end, out);                          \
        }                                                                                          \
    }

RANGE_FN(fp_pair_sums_f32, float, load_f32, one_f32)
RANGE_FN(fp_pair_sums_f64, double, load_f64, one_f64)
RANGE_FN(fp_pair_sums_bf16, uint16_t, load_bf16, one_bf16)

/* Fold k partials (k, ROWS, P) in order into out (ROWS, P): maxima of rows 0 and 6, sums of the
 * others. */
void fp_fold(const double *partials, int64_t k, int64_t P, double *out) {
    for (int64_t e = 0; e < ROWS * P; e++) out[e] = partials[e];
    for (int64_t c = 1; c < k; c++) {
        const double *part = partials + c * ROWS * P;
        for (int64_t e = 0; e < ROWS * P; e++) {
            int64_t row = e / P;
            if (row == 0 || row == ROWS - 1)
                out[e] = part[e] > out[e] ? part[e] : out[e];
            else
                out[e] += part[e];
        }
    }
}

/* Version of this interface, checked by the loader. */
int64_t fp_abi_version(void) { return 2; }
