/* Attention scores for bf16 training on CPUs with AVX-512 BF16 (asyncrl.model.cpu_scores).
 *
 * C[x, m, n] = scale * sum_k A[x, m, k] * B[x, n, k], bf16 inputs, fp32 output, not rounded: what an
 * fp32 matmul of the bf16 values gives, up to the order of the sums, at the bf16 dot product's
 * rate. B comes packed in pairs along k ([x][k/2][n][2]: each 32-bit word holds B[x, n, 2j] and
 * B[x, n, 2j + 1]), the layout _mm512_dpbf16_ps multiplies against a broadcast pair of A.
 *
 * Blocks of up to 8 rows of A by 32 columns of B, each accumulated over all of k in 16 registers.
 * Work is split over torch's OpenMP threads by (x, block of rows).
 */
#include <stdint.h>
#include <string.h>

int asyncrl_scores_supported(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define ROWS 8
#define COLS 32

static inline __attribute__((always_inline)) void block(int R, const uint16_t *a, int64_t lda,
                                                        const uint16_t *b, int64_t ldb, float *c,
                                                        int64_t ldc, int64_t n0, int64_t N,
                                                        int64_t pairs, float scale) {
    int64_t nn = N - n0 < COLS ? N - n0 : COLS;
    __mmask16 m0 = nn >= 16 ? 0xFFFF : (__mmask16)((1u << nn) - 1);
    __mmask16 m1 = nn >= 32 ? 0xFFFF : nn > 16 ? (__mmask16)((1u << (nn - 16)) - 1) : 0;
    __m512 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    b += n0 * 2;
    for (int64_t j = 0; j < pairs; j++, b += ldb) {
        __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, b);
        __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, b + 32);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, a + r * lda + 2 * j, sizeof pair);
            __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
    }
    __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(c + r * ldc + n0, m0, _mm512_mul_ps(acc[r][0], s));
        _mm512_mask_storeu_ps(c + r * ldc + n0 + 16, m1, _mm512_mul_ps(acc[r][1], s));
    }
}

/* A: X x M x K (batch stride xa, row stride lda, unit stride along k), K even.
 * B: packed, X x K/2 x (>= N) x 2 (batch stride xb, stride ldb between pairs j, in elements).
 * C: X x M x N fp32 (batch stride xc, row stride ldc). */
void asyncrl_scores_bf16(const uint16_t *A, int64_t xa, int64_t lda, const uint16_t *B, int64_t xb,
                         int64_t ldb, float *C, int64_t xc, int64_t ldc, int64_t X, int64_t M,
                         int64_t N, int64_t K, float scale) {
    int64_t blocks = (M + ROWS - 1) / ROWS, pairs = K / 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t x = 0; x < X; x++) {
        for (int64_t t = 0; t < blocks; t++) {
            int64_t m = t * ROWS, R = M - m < ROWS ? M - m : ROWS;
            const uint16_t *a = A + x * xa + m * lda, *b = B + x * xb;
            float *c = C + x * xc + m * ldc;
            for (int64_t n0 = 0; n0 < N; n0 += COLS) {
                switch (R) { /* a constant row count unrolls the block's loops */
                case 8: block(8, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 7: block(7, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 6: block(6, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 5: block(5, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 4: block(4, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 3: block(3, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                case 2: block(2, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                default: block(1, a, lda, b, ldb, c, ldc, n0, N, pairs, scale); break;
                }
            }
        }
    }
}
#endif
