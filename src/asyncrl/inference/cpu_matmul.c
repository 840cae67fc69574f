/* The matmuls of decode-sized steps on a CPU: the MoE experts of one layer (SwiGLU experts over the
 * tokens routed to them) in one call, and linears of a few rows. Built and loaded by
 * asyncrl/inference/cpu_matmul.py.
 *
 * The experts (asyncrl_moe_*) run in three passes, each shared out between OpenMP threads:
 *   1. gate and up: per (expert, 16 hidden units), the expert's rows of x read in place (no sorted
 *      copy), the gate and up columns of those units computed together, and h = silu(gate) * up
 *      written to scratch;
 *   2. down: per (expert, 32 output columns), h times the down projection, scaled by the row's
 *      routing weight and written to the row's (token, choice) slot;
 *   3. combine: per token, the sum over its k choices.
 * The counting sort of the (token, choice) pairs by expert runs first, on the calling thread.
 *
 * Rounding follows torch's bf16 path step by step: gate, up, silu(gate), h, the down output and
 * its product with the weight are each rounded to bf16 (round to nearest even); the matmuls and the
 * sum over choices accumulate in fp32. bf16 products go through AVX-512 BF16's dot product (pairs of
 * bf16 products, exact, added in fp32), the same pairing oneDNN's bf16 matmul uses. In fp32 the
 * same passes run with fp32 FMAs and no rounding between them.
 *
 * Weight layouts (made by cpu_matmul.py, once per weight version):
 *   gate_up [E][Ip/16][D/2][32][2]: per 16 hidden units, 16 gate then 16 up columns, each column's
 *     inputs in pairs (bf16), or [E][Ip/16][D][32] (fp32);
 *   down [E][Dp/32][Ip/2][32][2] (bf16) or [E][Dp/32][Ip][32] (fp32).
 * Ip is I rounded up to 16 and Dp is D rounded up to 32, the padding zeros; D is even in bf16.
 *
 * A linear (asyncrl_linear_*) is down's pass without the scaling: y = x . w^T over a few rows, the
 * weight [P, C] laid out as down is, [Pp/32][C/2][32][2] or [Pp/32][C][32], and y rounded once.
 *
 * Both multiply in register blocks of up to RB rows by 32 columns: per input pair (bf16) or input
 * (fp32), two loads of 16 columns of weights, each row's input broadcast, 2 x RB accumulators.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Which dtypes this build computes: 1 fp32 (AVX-512 F/BW/VL), 2 bf16 (also AVX-512 BF16). */
int asyncrl_matmul_dtypes(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#if defined(__AVX512BF16__)
  return 3;
#else
  return 1;
#endif
#else
  return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#define RB 8 /* rows per register block: 2 x RB accumulators and 2 weight registers */

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* fp32 -> bf16, round to nearest even (the values are finite) */
static inline __m256i round_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 rounded(__m512 v) { return widen_bf16(round_bf16(v)); }

static inline __m512 silu16(__m512 g) {
  float a[16];
  _mm512_storeu_ps(a, g);
  for (int j = 0; j < 16; j++) a[j] = silu(a[j]);
  return _mm512_loadu_ps(a);
}

/* the bf16 pair of inputs 2p, 2p + 1 of a row, as one 32-bit lane */
static inline int32_t load_pair(const uint16_t *row, int64_t p) {
  int32_t v;
  memcpy(&v, row + 2 * p, sizeof v);
  return v;
}

static inline __mmask16 tail(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* res[i][0..32) = rows[i] . w for MR rows: 32 columns of packed weights, over `pairs` input pairs
 * (bf16) or `inputs` inputs (fp32). One function per row count, so that the accumulators stay in
 * registers (2 x MR of them, 2 weight registers and a broadcast). */
#define BLOCK_BF16(MR)                                                                             \
  static void block_bf16_##MR(const uint16_t *const *rows, int64_t pairs, const uint16_t *w,       \
                              float *res) {                                                        \
    __m512 a0[MR], a1[MR];                                                                         \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();     \
    for (int64_t p = 0; p < pairs; p++) {                                                          \
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 64);                                     \
      __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 64 + 32);                                \
      _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
        __m512bh b = (__m512bh)_mm512_set1_epi32(load_pair(rows[i], p));                           \
        a0[i] = _mm512_dpbf16_ps(a0[i], b, w0);                                                    \
        a1[i] = _mm512_dpbf16_ps(a1[i], b, w1);                                                    \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                        \
      _mm512_storeu_ps(res + i * 32, a0[i]);                                                       \
      _mm512_storeu_ps(res + i * 32 + 16, a1[i]);                                                  \
    }                                                                                              \
  }

#define BLOCK_F32(MR)                                                                              \
  static void block_f32_##MR(const float *const *rows, int64_t inputs, const float *w, float *res) { \
    __m512 a0[MR], a1[MR];                                                                         \
    const float *r[MR];                                                                            \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                        \
      a0[i] = a1[i] = _mm512_setzero_ps();                                                         \
      r[i] = rows[i];                                                                              \
    }                                                                                              \
    for (int64_t p = 0; p < inputs; p++) {                                                         \
      __m512 w0 = _mm512_loadu_ps(w + p * 32);                                                     \
      __m512 w1 = _mm512_loadu_ps(w + p * 32 + 16);                                                \
      _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
        __m512 b = _mm512_set1_ps(r[i][p]);                                                        \
        a0[i] = _mm512_fmadd_ps(b, w0, a0[i]);                                                     \
        a1[i] = _mm512_fmadd_ps(b, w1, a1[i]);                                                     \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                        \
      _mm512_storeu_ps(res + i * 32, a0[i]);                                                       \
      _mm512_storeu_ps(res + i * 32 + 16, a1[i]);                                                  \
    }                                                                                              \
  }

#define BLOCKS(B) B(1) B(2) B(3) B(4) B(5) B(6) B(7) B(8)

#if defined(__AVX512BF16__)
BLOCKS(BLOCK_BF16)
typedef void (*block_bf16_fn)(const uint16_t *const *, int64_t, const uint16_t *, float *);
static const block_bf16_fn block_bf16[RB + 1] = {
    NULL, block_bf16_1, block_bf16_2, block_bf16_3, block_bf16_4,
    block_bf16_5, block_bf16_6, block_bf16_7, block_bf16_8};
#endif
BLOCKS(BLOCK_F32)
typedef void (*block_f32_fn)(const float *const *, int64_t, const float *, float *);
static const block_f32_fn block_f32[RB + 1] = {
    NULL, block_f32_1, block_f32_2, block_f32_3, block_f32_4,
    block_f32_5, block_f32_6, block_f32_7, block_f32_8};

/* The (token, choice) pairs a = n * K + k sorted by expert, stable: order[starts[e] .. starts[e+1]). */
static int sort_by_expert(const int64_t *ids, int64_t A, int64_t E, int64_t *order, int64_t *starts) {
  memset(starts, 0, sizeof(int64_t) * (E + 1));
  for (int64_t a = 0; a < A; a++) {
    if (ids[a] < 0 || ids[a] >= E) return 2;
    starts[ids[a] + 1]++;
  }
  for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
  int64_t *next = malloc(sizeof(int64_t) * (E ? E : 1));
  if (!next) return 1;
  memcpy(next, starts, sizeof(int64_t) * E);
  for (int64_t a = 0; a < A; a++) order[next[ids[a]]++] = a;
  free(next);
  return 0;
}

#if defined(__AVX512BF16__)
/* Returns 0, 1 (no memory for scratch) or 2 (an expert id outside [0, E)). */
int asyncrl_moe_bf16(const uint16_t *x, const int64_t *ids, const uint16_t *weights, const uint16_t *gate_up,
                     const uint16_t *down, uint16_t *out, int64_t N, int64_t K, int64_t E, int64_t D,
                     int64_t Ip) {
  const int64_t A = N * K, Dp = (D + 31) / 32 * 32, units = Ip / 16, dpanels = Dp / 32;
  int64_t *order = malloc(sizeof(int64_t) * (A ? A : 1));
  int64_t *starts = malloc(sizeof(int64_t) * (E + 1));
  uint16_t *h = malloc(sizeof(uint16_t) * (A ? A : 1) * Ip);
  uint16_t *y = malloc(sizeof(uint16_t) * (A ? A : 1) * D);
  int code = (order && starts && h && y) ? sort_by_expert(ids, A, E, order, starts) : 1;
  if (code) goto done;
  const int parallel = A * D * Ip >= (1 << 16);

#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < E * units; task++) {
      const int64_t e = task / units, u = task % units, n_e = starts[e + 1] - starts[e];
      const uint16_t *w = gate_up + (e * units + u) * (D / 2) * 64;
      for (int64_t r0 = 0; r0 < n_e; r0 += RB) {
        const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;
        const uint16_t *rows[RB];
        for (int i = 0; i < mr; i++) rows[i] = x + (order[starts[e] + r0 + i] / K) * D;
        float res[RB * 32];
        block_bf16[mr](rows, D / 2, w, res);
        for (int i = 0; i < mr; i++) {
          __m512 g = rounded(_mm512_loadu_ps(res + i * 32)), up = rounded(_mm512_loadu_ps(res + i * 32 + 16));
          __m512 hv = _mm512_mul_ps(rounded(silu16(g)), up);
          _mm256_storeu_si256((__m256i *)(h + (starts[e] + r0 + i) * Ip + u * 16), round_bf16(hv));
        }
      }
    }
#pragma omp for schedule(dynamic, 2)
    for (int64_t task = 0; task < E * dpanels; task++) {
      const int64_t e = task / dpanels, c = task % dpanels, n_e = starts[e + 1] - starts[e];
      const uint16_t *w = down + (e * dpanels + c) * (Ip / 2) * 64;
      const __mmask16 m0 = tail(D - c * 32), m1 = tail(D - c * 32 - 16);
      for (int64_t r0 = 0; r0 < n_e; r0 += RB) {
        const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;
        const uint16_t *rows[RB];
        for (int i = 0; i < mr; i++) rows[i] = h + (starts[e] + r0 + i) * Ip;
        float res[RB * 32];
        block_bf16[mr](rows, Ip / 2, w, res);
        for (int i = 0; i < mr; i++) {
          const int64_t a = order[starts[e] + r0 + i];
          union { uint32_t u; float f; } wa = {.u = (uint32_t)weights[a] << 16};
          __m512 s = _mm512_set1_ps(wa.f);
          uint16_t *dst = y + a * D + c * 32;
          _mm256_mask_storeu_epi16(dst, m0, round_bf16(_mm512_mul_ps(rounded(_mm512_loadu_ps(res + i * 32)), s)));
          _mm256_mask_storeu_epi16(dst + 16, m1, round_bf16(_mm512_mul_ps(rounded(_mm512_loadu_ps(res + i * 32 + 16)), s)));
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const __mmask16 m = tail(D - d0);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++)
          sum = _mm512_add_ps(sum, widen_bf16(_mm256_maskz_loadu_epi16(m, y + (n * K + k) * D + d0)));
        _mm256_mask_storeu_epi16(out + n * D + d0, m, round_bf16(sum));
      }
    }
  }
done:
  free(order);
  free(starts);
  free(h);
  free(y);
  return code;
}

#endif

int asyncrl_moe_f32(const float *x, const int64_t *ids, const float *weights, const float *gate_up,
                    const float *down, float *out, int64_t N, int64_t K, int64_t E, int64_t D, int64_t Ip) {
  const int64_t A = N * K, Dp = (D + 31) / 32 * 32, units = Ip / 16, dpanels = Dp / 32;
  int64_t *order = malloc(sizeof(int64_t) * (A ? A : 1));
  int64_t *starts = malloc(sizeof(int64_t) * (E + 1));
  float *h = malloc(sizeof(float) * (A ? A : 1) * Ip);
  float *y = malloc(sizeof(float) * (A ? A : 1) * D);
  int code = (order && starts && h && y) ? sort_by_expert(ids, A, E, order, starts) : 1;
  if (code) goto done;
  const int parallel = A * D * Ip >= (1 << 16);

#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < E * units; task++) {
      const int64_t e = task / units, u = task % units, n_e = starts[e + 1] - starts[e];
      const float *w = gate_up + (e * units + u) * D * 32;
      for (int64_t r0 = 0; r0 < n_e; r0 += RB) {
        const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;
        const float *rows[RB];
        for (int i = 0; i < mr; i++) rows[i] = x + (order[starts[e] + r0 + i] / K) * D;
        float res[RB * 32];
        block_f32[mr](rows, D, w, res);
        for (int i = 0; i < mr; i++)
          _mm512_storeu_ps(h + (starts[e] + r0 + i) * Ip + u * 16,
                           _mm512_mul_ps(silu16(_mm512_loadu_ps(res + i * 32)), _mm512_loadu_ps(res + i * 32 + 16)));
      }
    }
#pragma omp for schedule(dynamic, 2)
    for (int64_t task = 0; task < E * dpanels; task++) {
      const int64_t e = task / dpanels, c = task % dpanels, n_e = starts[e + 1] - starts[e];
      const float *w = down + (e * dpanels + c) * Ip * 32;
      const __mmask16 m0 = tail(D - c * 32), m1 = tail(D - c * 32 - 16);
      for (int64_t r0 = 0; r0 < n_e; r0 += RB) {
        const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;
        const float *rows[RB];
        for (int i = 0; i < mr; i++) rows[i] = h + (starts[e] + r0 + i) * Ip;
        float res[RB * 32];
        block_f32[mr](rows, Ip, w, res);
        for (int i = 0; i < mr; i++) {
          const int64_t a = order[starts[e] + r0 + i];
          __m512 s = _mm512_set1_ps(weights[a]);
          float *dst = y + a * D + c * 32;
          _mm512_mask_storeu_ps(dst, m0, _mm512_mul_ps(_mm512_loadu_ps(res + i * 32), s));
          _mm512_mask_storeu_ps(dst + 16, m1, _mm512_mul_ps(_mm512_loadu_ps(res + i * 32 + 16), s));
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const __mmask16 m = tail(D - d0);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(m, y + (n * K + k) * D + d0));
        _mm512_mask_storeu_ps(out + n * D + d0, m, sum);
      }
    }
  }
done:
  free(order);
  free(starts);
  free(h);
  free(y);
  return code;
}

/* y [M, N] = x [M, K] . w^T for a few rows (a decode step's linears at small batches): w packed as
 * down is, [Np/32][K/2][32][2] (bf16, K even) or [Np/32][K][32] (fp32); y rounded once (bf16). */
#if defined(__AVX512BF16__)
void asyncrl_linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t K, int64_t N) {
  const int64_t panels = (N + 31) / 32;
#pragma omp parallel for schedule(static) if (M * N * K >= (1 << 18))
  for (int64_t c = 0; c < panels; c++) {
    const __mmask16 m0 = tail(N - c * 32), m1 = tail(N - c * 32 - 16);
    for (int64_t r0 = 0; r0 < M; r0 += RB) {
      const int mr = M - r0 < RB ? (int)(M - r0) : RB;
      const uint16_t *rows[RB];
      for (int i = 0; i < mr; i++) rows[i] = x + (r0 + i) * K;
      float res[RB * 32];
      block_bf16[mr](rows, K / 2, w + c * (K / 2) * 64, res);
      for (int i = 0; i < mr; i++) {
        uint16_t *dst = y + (r0 + i) * N + c * 32;
        _mm256_mask_storeu_epi16(dst, m0, round_bf16(_mm512_loadu_ps(res + i * 32)));
        _mm256_mask_storeu_epi16(dst + 16, m1, round_bf16(_mm512_loadu_ps(res + i * 32 + 16)));
      }
    }
  }
}
#endif

void asyncrl_linear_f32(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N) {
  const int64_t panels = (N + 31) / 32;
#pragma omp parallel for schedule(static) if (M * N * K >= (1 << 18))
  for (int64_t c = 0; c < panels; c++) {
    const __mmask16 m0 = tail(N - c * 32), m1 = tail(N - c * 32 - 16);
    for (int64_t r0 = 0; r0 < M; r0 += RB) {
      const int mr = M - r0 < RB ? (int)(M - r0) : RB;
      const float *rows[RB];
      for (int i = 0; i < mr; i++) rows[i] = x + (r0 + i) * K;
      float res[RB * 32];
      block_f32[mr](rows, K, w + c * K * 32, res);
      for (int i = 0; i < mr; i++) {
        float *dst = y + (r0 + i) * N + c * 32;
        _mm512_mask_storeu_ps(dst, m0, _mm512_loadu_ps(res + i * 32));
        _mm512_mask_storeu_ps(dst + 16, m1, _mm512_loadu_ps(res + i * 32 + 16));
      }
    }
  }
}

#endif
