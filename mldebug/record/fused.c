/* The recorder's statistics of one CPU tensor in ONE pass over its memory.
 *
 * torch takes them in ~4.5 passes (sum, Σx², aminmax, |x| written and summed), each one
 * a kernel launch of ~5 µs on the CPU; numpy's reduceat is one thread and not
 * vectorized. This loop reads each value once and keeps 16 lanes of each statistic, so
 * the compiler turns it into vector code (the widest the CPU has: target_clones picks
 * AVX-512, AVX2 or the baseline at load time). Compiled on first use by
 * `mldebug/record/native.py`, which checks it against numpy before using it.
 *
 * Accuracy (the same contract as the torch path): float32 values are summed in float32
 * lanes for at most BLOCK values, then the lanes are added in float64; float64 in
 * float64. A square that overflows float32 is +Inf, as with torch. NaN/Inf anywhere make
 * the sum non-finite: the caller then counts the tensor again exactly (`nonfinite_row`),
 * so min and max need not handle them here.
 */
#include <math.h>
#include <stdint.h>

#define LANES 16
#define BLOCK 4096

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(MLD_NO_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* One run of values (a whole tensor, or one sample of it): t[0..2] += Σx, Σ|x|, Σx²;
 * *lo, *hi take the run's min and max. */
#define CHUNK(NAME, T, ABS)                                                             \
    static inline void NAME(const T *x, int64_t n, double t[3], T *lo, T *hi)           \
    {                                                                                   \
        T mn[LANES], mx[LANES];                                                         \
        for (int j = 0; j < LANES; j++) {                                               \
            mn[j] = *lo;                                                                \
            mx[j] = *hi;                                                                \
        }                                                                               \
        int64_t i = 0;                                                                  \
        while (i + LANES <= n) {                                                        \
            int64_t end = i + BLOCK < n ? i + BLOCK : n;                                \
            T s[LANES] = {0}, a[LANES] = {0}, q[LANES] = {0};                           \
            for (; i + LANES <= end; i += LANES) {                                      \
                for (int j = 0; j < LANES; j++) {                                       \
                    T v = x[i + j];                                                     \
                    s[j] += v;                                                          \
                    a[j] += ABS(v);                                                     \
                    q[j] += v * v;                                                      \
                    mn[j] = v < mn[j] ? v : mn[j];                                      \
                    mx[j] = v > mx[j] ? v : mx[j];                                      \
                }                                                                       \
            }                                                                           \
            double ss = 0, aa = 0, qq = 0;                                              \
            for (int j = 0; j < LANES; j++) {                                           \
                ss += s[j];                                                             \
                aa += a[j];                                                             \
                qq += q[j];                                                             \
            }                                                                           \
            t[0] += ss;                                                                 \
            t[1] += aa;                                                                 \
            t[2] += qq;                                                                 \
        }                                                                               \
        for (; i < n; i++) {                                                            \
            T v = x[i];                                                                 \
            t[0] += v;                                                                  \
            t[1] += ABS(v);                                                             \
            t[2] += (T)(v * v);                                                         \
            mn[0] = v < mn[0] ? v : mn[0];                                              \
            mx[0] = v > mx[0] ? v : mx[0];                                              \
        }                                                                               \
        for (int j = 0; j < LANES; j++) {                                               \
            *lo = mn[j] < *lo ? mn[j] : *lo;                                            \
            *hi = mx[j] > *hi ? mx[j] : *hi;                                            \
        }                                                                               \
    }

/* numpy's maximum and minimum: a NaN on either side is returned */
static inline double np_maximum(double a, double b) { return a >= b || a != a ? a : b; }
static inline double np_minimum(double a, double b) { return a <= b || a != a ? a : b; }

/* The summary (store.STAT_COLUMNS) of a finite ROW, as `stats.describe_rows` computes
 * it, operation for operation in float64: numel, mean, abs_mean, std (n - 1 in the
 * denominator; +Inf when Σx² overflowed; NaN for one value), abs_max, min, max, and the
 * three zero counts. */
static void summary(const double *row, double *out)
{
    double n = row[0], s = row[1], a = row[2], ss = row[3], lo = row[4], hi = row[5];
    double safe = n > 1.0 ? n : 1.0;
    double mean = s / safe;
    double var = (ss - s * mean) / (n - 1 > 1.0 ? n - 1 : 1.0);
    double std = sqrt(np_maximum(var, 0.0));
    if (isinf(ss))
        std = INFINITY;
    if (n <= 1)
        std = NAN;
    out[0] = n;
    out[1] = mean;
    out[2] = a / safe;
    out[3] = std;
    out[4] = np_maximum(fabs(lo), fabs(hi));
    out[5] = lo;
    out[6] = hi;
    out[7] = out[8] = out[9] = 0;
}

/* The histogram of the sample at IDX (NIDX values; the first NIDX when IDX is NULL), as
 * `stats._histograms` and `stats.bin_rows` bin a finite row, operation for operation in
 * float64 (built with -ffp-contract=off: the same roundings): range [min, max] clipped
 * to mean ± CLIP·std (CLIP < 0: no clipping); HIST[0] counts the values below it,
 * HIST[BINS + 1] those above; a value whose bin position is not finite is not counted.
 * RANGE gets lo, hi. */
static void histogram(const double *desc, double at(const void *, int64_t), const void *x,
                      const int64_t *idx, int64_t nidx, int64_t bins, double clip,
                      int64_t *hist, double *range)
{
    double lo = desc[5], hi = desc[6];
    if (clip >= 0) {
        double half = clip * (desc[3] != desc[3] ? 0.0 : desc[3]);
        double a = desc[1] - half, b = desc[1] + half;
        lo = np_maximum(lo, a);
        hi = np_minimum(hi, b);
    }
    hi = np_maximum(hi, lo);
    double width = hi - lo;
    double scale = width > 0 ? bins / width : 0.0;
    for (int64_t k = 0; k < bins + 2; k++)
        hist[k] = 0;
    for (int64_t k = 0; k < nidx; k++) {
        double t = (at(x, idx ? idx[k] : k) - lo) * scale;
        if (!isfinite(t))
            continue;
        if (t == (double)bins)
            t = (double)(bins - 1);
        t = floor(t);
        t = t < -1.0 ? -1.0 : (t > (double)bins ? (double)bins : t);
        hist[(int64_t)t + 1]++;
    }
    range[0] = lo;
    range[1] = hi;
}

static double at_f32(const void *x, int64_t i) { return ((const float *)x)[i]; }
static double at_f64(const void *x, int64_t i) { return ((const double *)x)[i]; }

/* Everything the recorder keeps of the N values at X, into OUT (OUT_WIDTH + BINS + 2
 * slots of 8 bytes): [0, 9) the row (stats.ROW: numel, Σx, Σ|x|, Σx², min, max, zero
 * counts); [9, 19) its summary (`summary`); [19, 21) the histogram's lo and hi; then
 * BINS + 2 int64 counts (`histogram`, of the values at IDX; none when NIDX is 0). With
 * CHUNK > 0 the values are N / CHUNK samples of CHUNK values each, and NORMS gets each
 * sample's L2 norm. Returns 1 when the sum is not finite: only the row and the norms are
 * written then (the caller counts the tensor again), else 0. */
#define OUT_WIDTH 21
#define ROW(NAME, CHUNKF, AT, T)                                                        \
    CLONES int NAME(const T *x, int64_t n, int64_t chunk, float *norms,                 \
                    const int64_t *idx, int64_t nidx, int64_t bins, double clip,        \
                    double *out)                                                        \
    {                                                                                   \
        double t[3] = {0, 0, 0};                                                        \
        T lo = (T)INFINITY, hi = (T)-INFINITY;                                          \
        if (chunk <= 0)                                                                 \
            chunk = n;                                                                  \
        for (int64_t o = 0, c = 0; o < n; o += chunk, c++) {                            \
            double u[3] = {0, 0, 0};                                                    \
            CHUNKF(x + o, chunk < n - o ? chunk : n - o, u, &lo, &hi);                  \
            t[0] += u[0];                                                               \
            t[1] += u[1];                                                               \
            t[2] += u[2];                                                               \
            if (norms)                                                                  \
                norms[c] = (float)sqrt(u[2]);                                           \
        }                                                                               \
        out[0] = (double)n;                                                             \
        out[1] = t[0];                                                                  \
        out[2] = t[1];                                                                  \
        out[3] = t[2];                                                                  \
        out[4] = lo;                                                                    \
        out[5] = hi;                                                                    \
        out[6] = out[7] = out[8] = 0;                                                   \
        if (!isfinite(t[0]))                                                            \
            return 1;                                                                   \
        summary(out, out + 9);                                                          \
        if (nidx > 0)                                                                   \
            histogram(out + 9, AT, x, idx, nidx, bins, clip, (int64_t *)(out + OUT_WIDTH), \
                      out + 19);                                                        \
        return 0;                                                                       \
    }

CHUNK(chunk_f32, float, fabsf)
CHUNK(chunk_f64, double, fabs)
ROW(mld_row_f32, chunk_f32, at_f32, float)
ROW(mld_row_f64, chunk_f64, at_f64, double)
