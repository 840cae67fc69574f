/* The matmuls of decode-sized steps on a CPU: the MoE experts of one layer (SwiGLU experts over the
 * tokens routed to them) in one call, and the linears of decode steps. Built and loaded by
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
 * A linear (asyncrl_linear_*) is down's pass without the scaling: y = x . w^T over the rows given
 * (cpu_matmul.py sends at most MAX_LINEAR_ROWS), the weight [P, C] laid out as down is,
 * [Pp/32][C/2][32][2] or [Pp/32][C][32], and y rounded once.
 *
 * Both multiply in register blocks of up to RB rows by 32 columns: per input pair (bf16) or input
 * (fp32), two loads of 16 columns of weights, each row's input broadcast, 2 x RB accumulators.
 */
#include <immintrin.h>
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

/* e^x in 16 lanes, x clamped to [-88, 88]: x = n ln2 + r with |r| <= ln2 / 2 (ln2 as a head and a
 * tail, so that n ln2 loses nothing to rounding), e^r by its Taylor series to r^7, times 2^n by
 * vscalefps; within 1 ulp of e^x wherever e^x is a normal float. It replaces glibc's expf called
 * lane by lane (the compiler did not vectorise that loop), a sizeable share of the kernel's
 * time. */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  static const float taylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24,
                                 1.f / 6,    0.5f,      1.f,       1.f};
  __m512 p = _mm512_set1_ps(taylor[0]);
  for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
  return _mm512_scalef_ps(p, n);
}

/* silu(g) = g / (1 + e^-g) */
static inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

static inline __mmask16 tail(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* What differs between the dtypes, each op named with its dtype's suffix; the blocks and the
 * passes below are written once over them (the macros' S is the suffix, T the element type).
 *   vec:   a register of weights (and a broadcast input): 32 bf16 (16 column pairs) or 16 fp32;
 *   PER:   inputs consumed per multiply-add step (a bf16 pair, or one fp32);
 *   wload, bcast, mac: load 16 columns of weights for one step, broadcast a row's input(s) of
 *          step p, multiply-add them into 16 fp32 accumulators;
 *   rnd:   the rounding between ops (bf16: to bf16 and back; fp32: none);
 *   ld, st: 16 values of T from and to memory under a mask (st rounds to bf16);
 *   scalar: one T as a float. */
enum { PER_f32 = 1, PER_bf16 = 2 };
typedef __m512 vec_f32;
static inline vec_f32 wload_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline vec_f32 bcast_f32(const float *row, int64_t p) { return _mm512_set1_ps(row[p]); }
static inline __m512 mac_f32(__m512 acc, vec_f32 b, vec_f32 w) { return _mm512_fmadd_ps(b, w, acc); }
static inline __m512 rnd_f32(__m512 v) { return v; }
static inline __m512 ld_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void st_f32(float *p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline float scalar_f32(float v) { return v; }

static inline __m512 rnd_bf16(__m512 v) { return widen_bf16(round_bf16(v)); }
static inline __m512 ld_bf16(const uint16_t *p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
static inline void st_bf16(uint16_t *p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, round_bf16(v)); }
static inline float scalar_bf16(uint16_t v) {
  union { uint32_t u; float f; } x = {.u = (uint32_t)v << 16};
  return x.f;
}
#if defined(__AVX512BF16__)
typedef __m512bh vec_bf16;
static inline vec_bf16 wload_bf16(const uint16_t *w) { return (__m512bh)_mm512_loadu_si512(w); }
/* the bf16 pair of inputs 2p, 2p + 1 of a row, broadcast as one 32-bit lane */
static inline vec_bf16 bcast_bf16(const uint16_t *row, int64_t p) {
  int32_t v;
  memcpy(&v, row + 2 * p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}
static inline __m512 mac_bf16(__m512 acc, vec_bf16 b, vec_bf16 w) { return _mm512_dpbf16_ps(acc, b, w); }
#endif

/* res[i][0..32) = rows[i] . w for MR rows: 32 columns of packed weights over `inputs` inputs. One
 * function per row count, so that the accumulators stay in registers (2 x MR of them, 2 weight
 * registers and a broadcast). */
#define BLOCK(S, T, MR)                                                                            \
  static void block_##S##_##MR(const T *const *rows, int64_t inputs, const T *w, float *res) {      \
    __m512 a0[MR], a1[MR];                                                                         \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();     \
    for (int64_t p = 0; p < inputs / PER_##S; p++) {                                               \
      vec_##S w0 = wload_##S(w + p * 32 * PER_##S);                                                \
      vec_##S w1 = wload_##S(w + p * 32 * PER_##S + 16 * PER_##S);                                 \
      _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
        vec_##S b = bcast_##S(rows[i], p);                                                         \
        a0[i] = mac_##S(a0[i], b, w0);                                                             \
        a1[i] = mac_##S(a1[i], b, w1);                                                             \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                        \
      _mm512_storeu_ps(res + i * 32, a0[i]);                                                       \
      _mm512_storeu_ps(res + i * 32 + 16, a1[i]);                                                  \
    }                                                                                              \
  }

/* the blocks of 1..RB rows and their table, block_S[mr] */
#define BLOCKS(S, T)                                                                               \
  BLOCK(S, T, 1) BLOCK(S, T, 2) BLOCK(S, T, 3) BLOCK(S, T, 4)                                      \
  BLOCK(S, T, 5) BLOCK(S, T, 6) BLOCK(S, T, 7) BLOCK(S, T, 8)                                      \
  static void (*const block_##S[RB + 1])(const T *const *, int64_t, const T *, float *) = {        \
      NULL, block_##S##_1, block_##S##_2, block_##S##_3, block_##S##_4,                            \
      block_##S##_5, block_##S##_6, block_##S##_7, block_##S##_8};

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

/* asyncrl_moe_S returns 0, 1 (no memory for scratch) or 2 (an expert id outside [0, E)).
 * asyncrl_linear_S: y [M, N] = x [M, K] . w^T over a decode step's rows, w packed as down is,
 * [Np/32][K/2][32][2] (bf16, K even) or [Np/32][K][32] (fp32); y rounded once (bf16). */
#define MATMULS(S, T)                                                                              \
  int asyncrl_moe_##S(const T *x, const int64_t *ids, const T *weights, const T *gate_up,           \
                      const T *down, T *out, int64_t N, int64_t K, int64_t E, int64_t D,           \
                      int64_t Ip) {                                                                \
    const int64_t A = N * K, Dp = (D + 31) / 32 * 32, units = Ip / 16, dpanels = Dp / 32;          \
    int64_t *order = malloc(sizeof(int64_t) * (A ? A : 1));                                        \
    int64_t *starts = malloc(sizeof(int64_t) * (E + 1));                                           \
    T *h = malloc(sizeof(T) * (A ? A : 1) * Ip);                                                   \
    T *y = malloc(sizeof(T) * (A ? A : 1) * D);                                                    \
    int code = (order && starts && h && y) ? sort_by_expert(ids, A, E, order, starts) : 1;         \
    if (code) goto done;                                                                           \
    _Pragma("omp parallel if (A * D * Ip >= (1 << 16))") {                                         \
      /* 1. gate and up per (expert, 16 hidden units): h = silu(gate) * up */                      \
      _Pragma("omp for schedule(dynamic, 4)") for (int64_t task = 0; task < E * units; task++) {   \
        const int64_t e = task / units, u = task % units, n_e = starts[e + 1] - starts[e];         \
        const T *w = gate_up + (e * units + u) * D * 32;                                           \
        for (int64_t r0 = 0; r0 < n_e; r0 += RB) {                                                 \
          const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;                                     \
          const T *rows[RB];                                                                       \
          for (int i = 0; i < mr; i++) rows[i] = x + (order[starts[e] + r0 + i] / K) * D;          \
          float res[RB * 32];                                                                      \
          block_##S[mr](rows, D, w, res);                                                          \
          for (int i = 0; i < mr; i++) {                                                           \
            __m512 g = rnd_##S(_mm512_loadu_ps(res + i * 32));                                     \
            __m512 up = rnd_##S(_mm512_loadu_ps(res + i * 32 + 16));                               \
            st_##S(h + (starts[e] + r0 + i) * Ip + u * 16, 0xFFFF,                                 \
                   _mm512_mul_ps(rnd_##S(silu16(g)), up));                                         \
          }                                                                                        \
        }                                                                                          \
      }                                                                                            \
      /* 2. down per (expert, 32 columns), scaled by the routing weight, to the pair's slot */     \
      _Pragma("omp for schedule(dynamic, 2)") for (int64_t task = 0; task < E * dpanels; task++) { \
        const int64_t e = task / dpanels, c = task % dpanels, n_e = starts[e + 1] - starts[e];     \
        const T *w = down + (e * dpanels + c) * Ip * 32;                                           \
        const __mmask16 m0 = tail(D - c * 32), m1 = tail(D - c * 32 - 16);                         \
        for (int64_t r0 = 0; r0 < n_e; r0 += RB) {                                                 \
          const int mr = n_e - r0 < RB ? (int)(n_e - r0) : RB;                                     \
          const T *rows[RB];                                                                       \
          for (int i = 0; i < mr; i++) rows[i] = h + (starts[e] + r0 + i) * Ip;                    \
          float res[RB * 32];                                                                      \
          block_##S[mr](rows, Ip, w, res);                                                         \
          for (int i = 0; i < mr; i++) {                                                           \
            const int64_t a = order[starts[e] + r0 + i];                                           \
            const __m512 s = _mm512_set1_ps(scalar_##S(weights[a]));                               \
            T *dst = y + a * D + c * 32;                                                           \
            st_##S(dst, m0, _mm512_mul_ps(rnd_##S(_mm512_loadu_ps(res + i * 32)), s));             \
            st_##S(dst + 16, m1, _mm512_mul_ps(rnd_##S(_mm512_loadu_ps(res + i * 32 + 16)), s));   \
          }                                                                                        \
        }                                                                                          \
      }                                                                                            \
      /* 3. each token's sum over its choices */                                                   \
      _Pragma("omp for schedule(static)") for (int64_t n = 0; n < N; n++) {                        \
        for (int64_t d0 = 0; d0 < D; d0 += 16) {                                                   \
          const __mmask16 m = tail(D - d0);                                                        \
          __m512 sum = _mm512_setzero_ps();                                                        \
          for (int64_t k = 0; k < K; k++) sum = _mm512_add_ps(sum, ld_##S(y + (n * K + k) * D + d0, m)); \
          st_##S(out + n * D + d0, m, sum);                                                        \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
  done:                                                                                            \
    free(order);                                                                                   \
    free(starts);                                                                                  \
    free(h);                                                                                       \
    free(y);                                                                                       \
    return code;                                                                                   \
  }                                                                                                \
                                                                                                   \
  void asyncrl_linear_##S(const T *x, const T *w, T *y, int64_t M, int64_t K, int64_t N) {          \
    const int64_t panels = (N + 31) / 32;                                                          \
    _Pragma("omp parallel for schedule(static) if (M * N * K >= (1 << 18))")                       \
    for (int64_t c = 0; c < panels; c++) {                                                         \
      const __mmask16 m0 = tail(N - c * 32), m1 = tail(N - c * 32 - 16);                           \
      for (int64_t r0 = 0; r0 < M; r0 += RB) {                                                     \
        const int mr = M - r0 < RB ? (int)(M - r0) : RB;                                           \
        const T *rows[RB];                                                                         \
        for (int i = 0; i < mr; i++) rows[i] = x + (r0 + i) * K;                                   \
        float res[RB * 32];                                                                        \
        block_##S[mr](rows, K, w + c * K * 32, res);                                               \
        for (int i = 0; i < mr; i++) {                                                             \
          T *dst = y + (r0 + i) * N + c * 32;                                                      \
          st_##S(dst, m0, _mm512_loadu_ps(res + i * 32));                                          \
          st_##S(dst + 16, m1, _mm512_loadu_ps(res + i * 32 + 16));                                \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
  }

BLOCKS(f32, float)
MATMULS(f32, float)

/* The fp32 experts on bf16 inputs and routing weights (widened: exact), the output rounded once to
 * bf16: what asyncrl_moe_f32 computes on the same values cast to fp32 by torch and its output cast
 * back, without the casts as separate ops. For bf16 experts too small for native bf16 to pay, which
 * torch's path computes in fp32 (cpu_matmul.py). Same return codes as asyncrl_moe_f32. */
int asyncrl_moe_f32_bf16io(const uint16_t *x, const int64_t *ids, const uint16_t *weights,
                           const float *gate_up, const float *down, uint16_t *out, int64_t N,
                           int64_t K, int64_t E, int64_t D, int64_t Ip) {
  float *xf = malloc(sizeof(float) * (N * D + N * K + N * D + 1));
  if (!xf) return 1;
  float *wf = xf + N * D, *of = wf + N * K;
  for (int64_t i = 0; i < N * D; i += 16) {
    const __mmask16 m = tail(N * D - i);
    st_f32(xf + i, m, ld_bf16(x + i, m));
  }
  for (int64_t i = 0; i < N * K; i++) wf[i] = scalar_bf16(weights[i]);
  const int code = asyncrl_moe_f32(xf, ids, wf, gate_up, down, of, N, K, E, D, Ip);
  for (int64_t i = 0; i < N * D && !code; i += 16) {
    const __mmask16 m = tail(N * D - i);
    st_bf16(out + i, m, ld_f32(of + i, m));
  }
  free(xf);
  return code;
}
/* The router of a softmax-then-top-k MoE layer (moe.Router, Qwen3-MoE's) in one call, in place of
 * torch's cast, linear, softmax, top-k, normalisation and cast back. Per token: the logits x . w_e
 * over the E experts in fp32 (bf16 inputs widened: exact; the weight [E][D] in fp32), their softmax
 * (exp16), the K largest probabilities (of equal ones, the lower expert first), divided by their sum
 * when norm is set. Writes the ids [N][K] and the weights [N][K] in x's dtype (bf16: rounded once).
 * Only the order of the sums differs from torch's. Returns 1 when E > ROUTER_MAX_EXPERTS or K > E. */
#define ROUTER_MAX_EXPERTS 1024
#define ROUTER(S, T)                                                                                \
  int asyncrl_router_##S(const T *x, const float *w, int64_t *ids, T *weights, int64_t N,          \
                         int64_t D, int64_t E, int64_t K, int norm) {                              \
    if (E > ROUTER_MAX_EXPERTS || K > E || K < 1) return 1;                                        \
    _Pragma("omp parallel for schedule(static) if (N * E * D >= (1 << 20))")                       \
    for (int64_t n = 0; n < N; n++) {                                                              \
      float p[ROUTER_MAX_EXPERTS];                                                                 \
      const T *row = x + n * D;                                                                    \
      for (int64_t e = 0; e < E; e++) {                                                            \
        __m512 acc = _mm512_setzero_ps();                                                          \
        for (int64_t d = 0; d < D; d += 16) {                                                      \
          const __mmask16 m = tail(D - d);                                                         \
          acc = _mm512_fmadd_ps(ld_##S(row + d, m), ld_f32(w + e * D + d, m), acc);                \
        }                                                                                          \
        p[e] = _mm512_reduce_add_ps(acc);                                                          \
      }                                                                                            \
      float top = p[0];                                                                            \
      for (int64_t e = 1; e < E; e++) top = p[e] > top ? p[e] : top;                               \
      __m512 total = _mm512_setzero_ps();                                                          \
      for (int64_t e = 0; e < E; e += 16) {                                                        \
        const __mmask16 m = tail(E - e);                                                           \
        const __m512 v = exp16(_mm512_sub_ps(ld_f32(p + e, m), _mm512_set1_ps(top)));              \
        st_f32(p + e, m, v);                                                                       \
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, v));                                   \
      }                                                                                            \
      const float inv = 1.f / _mm512_reduce_add_ps(total);                                         \
      float chosen[ROUTER_MAX_EXPERTS], sum = 0.f;                                                 \
      for (int64_t k = 0; k < K; k++) {                                                            \
        int64_t best = -1;                                                                         \
        for (int64_t e = 0; e < E; e++)                                                            \
          if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;                               \
        if (best < 0) /* a NaN row: the first expert not taken yet, so the ids stay distinct */     \
          for (best = 0; p[best] < 0.f; best++) {}                                                 \
        ids[n * K + k] = best;                                                                     \
        chosen[k] = p[best] * inv;                                                                 \
        sum += chosen[k];                                                                          \
        p[best] = -1.f; /* taken: below every probability */                                       \
      }                                                                                            \
      for (int64_t k = 0; k < K; k++) {                                                            \
        const float v = norm ? chosen[k] / sum : chosen[k];                                        \
        st_##S(weights + n * K + k, 1, _mm512_set1_ps(v));                                         \
      }                                                                                            \
    }                                                                                              \
    return 0;                                                                                      \
  }

ROUTER(f32, float)
ROUTER(bf16, uint16_t)

#if defined(__AVX512BF16__)
BLOCKS(bf16, uint16_t)
MATMULS(bf16, uint16_t)
#endif

#endif
