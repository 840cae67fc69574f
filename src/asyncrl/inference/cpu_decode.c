/* Decode attention on a CPU: one query token per sequence over that sequence's keys and values,
 * read in place from the engine's dense decode rows (asyncrl/inference/decode_kv.py) or from the
 * blocks it gathered from the paged pool, each sequence only up to its own length. Built and
 * loaded by asyncrl/inference/cpu_decode.py.
 *
 * Per (sequence s, kv head g): the r query heads of the group share every key and value they
 * read; scores are fp32, the softmax is fp32 and exact (max subtracted), the output is accumulated
 * in fp32. Keys and values are fp32 or bf16 (bf16 is widened by a shift: exact).
 *
 * Layout: q, k, v and out are of one dtype. q is [S, G, r, d] with element strides (row, head,
 * query head) and d contiguous, so it is read where the model's projection left it; each query is
 * widened and multiplied by the softmax scale in fp32 (as q.float() * scale would be). out is a
 * contiguous [S, G, r, d], rounded once from the fp32 output (bf16: to nearest even, as torch's
 * cast is). k and v are [S, G, positions, d] with element strides (row, head, position) and d
 * contiguous. lens[s] is sequence s's number of positions (>= 1).
 *
 * The (sequence, kv head) pairs are shared out between OpenMP threads. Built with -fopenmp and
 * loaded after torch, the library binds to the OpenMP runtime torch already loaded (same soname),
 * so it runs on torch's own thread pool, with torch's thread count for the calling thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static inline float from_f32(float x) { return x; }

static inline float from_bf16(uint16_t h) {
  union { uint32_t u; float f; } x;
  x.u = ((uint32_t)h) << 16;
  return x.f;
}

static inline float to_f32(float x) { return x; }

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN, as in torch's cast */
static inline uint16_t to_bf16(float f) {
  union { uint32_t u; float f; } x;
  x.f = f;
  if (f != f) return 0x7FC0;
  return (uint16_t)((x.u + 0x7FFF + ((x.u >> 16) & 1)) >> 16);
}

/* One (sequence, kv head): n positions of keys kg and values vg (position stride k_pos, v_pos), the
 * group's r queries from q (query-head stride q_head) -> out [r, d]; qs [r, d] (the scaled
 * queries), scores [r, n] and acc [r, d] are scratch. Inlined into calls with d a constant (the
 * common head dims), so its loops are unrolled for them. */
#define ATTEND(NAME, T, LOAD, STORE)                                                               \
  static inline __attribute__((always_inline)) void NAME(                                          \
      const T *q, int64_t q_head, float scale, const T *kg, const T *vg, int64_t n, int64_t r,     \
      int64_t d, int64_t k_pos, int64_t v_pos, float *qs, float *scores, float *acc, T *out) {     \
    for (int64_t j = 0; j < r; j++) {                                                              \
      const T *qj = q + j * q_head;                                                                \
      _Pragma("omp simd") for (int64_t e = 0; e < d; e++) qs[j * d + e] = LOAD(qj[e]) * scale;     \
    }                                                                                              \
    const float *qg = qs;                                                                          \
    for (int64_t t = 0; t < n; t++) {                                                              \
      const T *kt = kg + t * k_pos;                                                                \
      for (int64_t j = 0; j < r; j++) {                                                            \
        const float *qj = qg + j * d;                                                              \
        float dot = 0.f;                                                                           \
        _Pragma("omp simd reduction(+ : dot)") for (int64_t e = 0; e < d; e++) dot +=              \
            qj[e] * LOAD(kt[e]);                                                                   \
        scores[j * n + t] = dot;                                                                   \
      }                                                                                            \
    }                                                                                              \
    for (int64_t j = 0; j < r; j++) {                                                              \
      float *sj = scores + j * n;                                                                  \
      float top = sj[0];                                                                           \
      for (int64_t t = 1; t < n; t++) top = sj[t] > top ? sj[t] : top;                             \
      float total = 0.f;                                                                           \
      _Pragma("omp simd reduction(+ : total)") for (int64_t t = 0; t < n; t++) {                   \
        sj[t] = expf(sj[t] - top);                                                                 \
        total += sj[t];                                                                            \
      }                                                                                            \
      const float inv = 1.f / total;                                                               \
      _Pragma("omp simd") for (int64_t t = 0; t < n; t++) sj[t] *= inv;                            \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * r * d);                                                         \
    for (int64_t t = 0; t < n; t++) {                                                              \
      const T *vt = vg + t * v_pos;                                                                \
      for (int64_t j = 0; j < r; j++) {                                                            \
        const float p = scores[j * n + t];                                                         \
        float *aj = acc + j * d;                                                                   \
        _Pragma("omp simd") for (int64_t e = 0; e < d; e++) aj[e] += p * LOAD(vt[e]);              \
      }                                                                                            \
    }                                                                                              \
    _Pragma("omp simd") for (int64_t i = 0; i < r * d; i++) out[i] = STORE(acc[i]);                \
  }

/* One task's call of attend_T with head dim D (a constant where it can be) */
#define ATTEND_D(ATTEND_T, D) \
  ATTEND_T(qg, q_head, scale, kg, vg, n, r, D, k_pos, v_pos, qs, scores, acc, o)

/* The library's entry points: every (sequence, kv head) of the step, shared out between threads. */
#define DECODE(NAME, T, ATTEND_T)                                                                  \
  int NAME(const T *q, const T *k, const T *v, const int64_t *lens, T *out, float scale,           \
           int64_t S, int64_t G, int64_t r, int64_t d, int64_t q_row, int64_t q_grp,               \
           int64_t q_head, int64_t k_row, int64_t k_head, int64_t k_pos, int64_t v_row,            \
           int64_t v_head, int64_t v_pos) {                                                        \
    int64_t longest = 1;                                                                           \
    for (int64_t s = 0; s < S; s++) longest = lens[s] > longest ? lens[s] : longest;               \
    int failed = 0;                                                                                \
    _Pragma("omp parallel") {                                                                      \
      float *scores = (float *)malloc(sizeof(float) * r * (longest + 2 * d));                      \
      if (scores == NULL) {                                                                        \
        _Pragma("omp atomic write") failed = 1;                                                    \
      }                                                                                            \
      float *acc = scores + r * longest, *qs = acc + r * d;                                        \
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t task = 0; task < S * G; task++) {       \
        if (scores == NULL) continue;                                                              \
        const int64_t s = task / G, g = task % G;                                                  \
        const T *qg = q + s * q_row + g * q_grp;                                                   \
        const T *kg = k + s * k_row + g * k_head;                                                  \
        const T *vg = v + s * v_row + g * v_head;                                                  \
        T *o = out + task * r * d;                                                                 \
        const int64_t n = lens[s];                                                                 \
        switch (d) {                                                                               \
          case 64: ATTEND_D(ATTEND_T, 64); break;                                                  \
          case 128: ATTEND_D(ATTEND_T, 128); break;                                                \
          case 32: ATTEND_D(ATTEND_T, 32); break;                                                  \
          default: ATTEND_D(ATTEND_T, d);                                                          \
        }                                                                                          \
      }                                                                                            \
      free(scores);                                                                                \
    }                                                                                              \
    return failed;                                                                                 \
  }

ATTEND(attend_f32, float, from_f32, to_f32)
ATTEND(attend_bf16, uint16_t, from_bf16, to_bf16)
DECODE(asyncrl_decode_f32, float, attend_f32)
DECODE(asyncrl_decode_bf16, uint16_t, attend_bf16)
