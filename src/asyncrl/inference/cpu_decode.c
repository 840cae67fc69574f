/* Decode attention on a CPU: one query token per sequence over that sequence's keys and values,
 * read in place from the engine's dense decode rows (asyncrl/inference/decode_kv.py) or from the
 * blocks it gathered from the paged pool, each sequence only up to its own length. Built and loaded by asyncrl/inference/cpu_decode.py.
 *
 * Per (sequence s, kv head g): the r query heads of the group share every key and value they
 * read; scores are fp32, the softmax is fp32 and exact (max subtracted), the output is accumulated
 * in fp32. Keys and values are fp32 or bf16 (bf16 is widened by a shift: exact).
 *
 * Layout: q and out are contiguous fp32 [S, G, r, d], q already multiplied by the softmax scale.
 * k and v are [S, G, positions, d] with element strides (row, head, position) and d contiguous.
 * lens[s] is sequence s's number of positions (>= 1).
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

/* One (sequence, kv head): n positions of keys kg and values vg (position stride k_pos, v_pos), the
 * group's r queries qg [r, d] -> out [r, d]; scores [r, n] and acc [r, d] are scratch. Inlined into
 * calls with d a constant (the common head dims), so its loops are unrolled for them. */
#define ATTEND(NAME, T, LOAD)                                                                      \
  static inline __attribute__((always_inline)) void NAME(                                          \
      const float *qg, const T *kg, const T *vg, int64_t n, int64_t r, int64_t d, int64_t k_pos,    \
      int64_t v_pos, float *scores, float *acc, float *out) {                                      \
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
    memcpy(out, acc, sizeof(float) * r * d);                                                       \
  }

/* The library's entry points: every (sequence, kv head) of the step, shared out between threads. */
#define DECODE(NAME, T, ATTEND_T)                                                                  \
  int NAME(const float *q, const T *k, const T *v, const int64_t *lens, float *out, int64_t S,     \
           int64_t G, int64_t r, int64_t d, int64_t k_row, int64_t k_head, int64_t k_pos,          \
           int64_t v_row, int64_t v_head, int64_t v_pos) {                                         \
    int64_t longest = 1;                                                                           \
    for (int64_t s = 0; s < S; s++) longest = lens[s] > longest ? lens[s] : longest;              \
    int failed = 0;                                                                                \
    _Pragma("omp parallel") {                                                                      \
      float *scores = (float *)malloc(sizeof(float) * r * (longest + d));                          \
      if (scores == NULL) {                                                                        \
        _Pragma("omp atomic write") failed = 1;                                                    \
      }                                                                                            \
      float *acc = scores + r * longest;                                                           \
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t task = 0; task < S * G; task++) {       \
        if (scores == NULL) continue;                                                              \
        const int64_t s = task / G, g = task % G;                                                  \
        const float *qg = q + task * r * d;                                                        \
        const T *kg = k + s * k_row + g * k_head;                                                  \
        const T *vg = v + s * v_row + g * v_head;                                                  \
        float *o = out + task * r * d;                                                             \
        switch (d) {                                                                               \
          case 64: ATTEND_T(qg, kg, vg, lens[s], r, 64, k_pos, v_pos, scores, acc, o); break;      \
          case 128: ATTEND_T(qg, kg, vg, lens[s], r, 128, k_pos, v_pos, scores, acc, o); break;    \
          case 32: ATTEND_T(qg, kg, vg, lens[s], r, 32, k_pos, v_pos, scores, acc, o); break;      \
          default: ATTEND_T(qg, kg, vg, lens[s], r, d, k_pos, v_pos, scores, acc, o);              \
        }                                                                                          \
      }                                                                                            \
      free(scores);                                                                                \
    }                                                                                              \
    return failed;                                                                                 \
  }

ATTEND(attend_f32, float, from_f32)
ATTEND(attend_bf16, uint16_t, from_bf16)
DECODE(asyncrl_decode_f32, float, attend_f32)
DECODE(asyncrl_decode_bf16, uint16_t, attend_bf16)
