/* RMSNorm forward and backward on CPUs (asyncrl.model.cpu_norm), fp32 and bf16.
 *
 * Each row of D values is read once by the forward and once by the backward. torch's composition
 * (upcast, square, mean, rsqrt, multiply, cast, scale; then the backward of each) makes about a
 * dozen passes over the activations, most of them writing a fresh tensor.
 *
 * Arithmetic is fp32; a bf16 value is rounded (to nearest even) wherever torch's composition
 * rounds one in bf16:
 *   forward   y = round(w * round(x * rstd)),  rstd = 1 / sqrt(mean(x^2) + eps)  (kept per row)
 *   backward  gn = round(g * w);  dx = round(rstd * (gn - xh * mean(gn * xh))),  xh = x * rstd
 *             dw = sum over rows of g * round(xh)  (in fp64 per thread, then summed in thread order)
 * Rows are split statically over torch's OpenMP threads, so results depend only on the thread count;
 * a call of fewer than PARALLEL_MIN values runs on the calling thread alone (as torch's elementwise
 * ops do below their grain size), since waking the other threads costs more than such a call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#define PARALLEL_MIN 32768

typedef uint16_t bf16;

static inline float bf16_load(bf16 v) {
    union { uint32_t u; float f; } c = { (uint32_t)v << 16 };
    return c.f;
}

static inline bf16 bf16_store(float f) {
    union { float f; uint32_t u; } c = { f };
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

static inline float f32_load(float v) { return v; }
static inline float f32_store(float f) { return f; }
static inline float f32_round(float f) { return f; }

#define RMS_NORM(S, T)                                                                              \
    void asyncrl_rms_norm_fwd_##S(const T *x, const T *w, T *y, float *rstd, int64_t rows,         \
                                  int64_t d, float eps) {                                           \
        _Pragma("omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN)")                  \
        for (int64_t i = 0; i < rows; i++) {                                                        \
            const T *xi = x + i * d;                                                                \
            T *yi = y + i * d;                                                                      \
            float ss = 0.f;                                                                         \
            _Pragma("omp simd reduction(+:ss)")                                                     \
            for (int64_t j = 0; j < d; j++) {                                                       \
                float v = S##_load(xi[j]);                                                          \
                ss += v * v;                                                                        \
            }                                                                                       \
            float r = 1.f / sqrtf(ss / (float)d + eps);                                             \
            rstd[i] = r;                                                                            \
            _Pragma("omp simd")                                                                     \
            for (int64_t j = 0; j < d; j++)                                                         \
                yi[j] = S##_store(S##_load(w[j]) * S##_round(S##_load(xi[j]) * r));                 \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* dw_part: threads x d doubles, zeroed by the caller; summed into dw[d] here. */               \
    void asyncrl_rms_norm_bwd_##S(const T *g, const T *x, const T *w, const float *rstd, T *dx,    \
                                  double *dw_part, float *dw, int64_t threads, int64_t rows,        \
                                  int64_t d) {                                                      \
        _Pragma("omp parallel num_threads(threads) if (rows * d >= PARALLEL_MIN)")                  \
        {                                                                                           \
            double *acc = dw_part + (int64_t)omp_get_thread_num() * d;                              \
            _Pragma("omp for schedule(static)")                                                     \
            for (int64_t i = 0; i < rows; i++) {                                                    \
                const T *gi = g + i * d, *xi = x + i * d;                                           \
                T *dxi = dx + i * d;                                                                \
                float r = rstd[i], dot = 0.f;                                                       \
                _Pragma("omp simd reduction(+:dot)")                                                \
                for (int64_t j = 0; j < d; j++) {                                                   \
                    float xh = S##_load(xi[j]) * r, gj = S##_load(gi[j]);                           \
                    acc[j] += (double)(gj * S##_round(xh));                                         \
                    dot += S##_round(gj * S##_load(w[j])) * xh;                                     \
                }                                                                                   \
                dot /= (float)d;                                                                    \
                _Pragma("omp simd")                                                                 \
                for (int64_t j = 0; j < d; j++) {                                                   \
                    float xh = S##_load(xi[j]) * r;                                                 \
                    float gn = S##_round(S##_load(gi[j]) * S##_load(w[j]));                         \
                    dxi[j] = S##_store(r * (gn - xh * dot));                                        \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t j = 0; j < d; j++) {                                                           \
            double s = 0.0;                                                                         \
            for (int64_t t = 0; t < threads; t++) s += dw_part[t * d + j];                          \
            dw[j] = (float)s;                                                                       \
        }                                                                                           \
    }

RMS_NORM(f32, float)
RMS_NORM(bf16, bf16)
