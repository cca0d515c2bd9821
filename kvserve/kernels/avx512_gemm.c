#define _GNU_SOURCE
/* bfloat16 linear layers with AVX-512 float32 FMAs (or bf16 dot products where those are
 * faster: kvserve_avx512_set_dot, below), for CPUs without AMX, on weights in the
 * tile layout amx_gemm.c packs (VNNI pairs: wp[nb][kb][r][c][2] = W[16 nb + c][32 kb + 2 r +
 * {0,1}]), with the same fused epilogues (bias, residual add, SwiGLU's silu-and-product).
 *
 * Why: at decode sizes (a few rows) a linear layer is a stream of its weights from memory,
 * and oneDNN's bf16 GEMM read them so far below the bandwidth its float32 GEMV reaches that a
 * bf16 decode step, with half the bytes, ran slower than a float32 one. In the tile layout
 * each 16-column block of W is one sequential run of K / 2 vectors of 16 columns x 2 k; a
 * register tile of up to 12 rows x 2 blocks (or 4 rows x 4 blocks) keeps float32
 * accumulators in registers while the weights stream past once. A weight vector becomes two
 * float32 vectors with one shift and one mask (a bf16 value is the high half of a float32),
 * and the products run on the float32 FMA ports, which do twice the multiply-adds per cycle
 * of the bf16 dot-product instruction on the Xeons measured (not on an AMD Zen 4: there the
 * dot-product tiles below run). Products of bf16 values are exact
 * in float32, the sums float32, the result rounded to bf16 once: the arithmetic of a bf16
 * GEMM, in its own order.
 *
 * x is first converted to float32 in the order the tiles read it (per tile of MT rows,
 * [K / 2][MT][2]: one pointer walks it; the dot-product tiles take its bf16 pairs as they
 * are, [K / 2][MT] 32-bit words). With many rows (prefill), rows go in blocks of
 * MB_ROWS: each block's tiles reuse a column group's weights from cache before the next group
 * is read. Thread t owns a contiguous share of the output columns.
 *
 * float32 linear layers (kvserve_avx512_linear_f32) run the same tiles on float32 weights in
 * a layout of their own, wf[nb][k][c] = W[16 nb + c][k]: each 16-column block one sequential
 * run of K vectors, read as pairs of k so that x's tile order is the bf16 path's. oneDNN's
 * float32 GEMM at decode sizes read its weights well below the bandwidth one core reaches;
 * software prefetch well ahead of each stream (PREFETCH_BYTES) is most of what closes that
 * gap (the hardware prefetcher alone kept a few streams of 64-byte loads short of it).
 *
 * Returns 0, 1 (nothing written) for shapes it does not take (K or N not a multiple of 32,
 * no rows) or a build without AVX-512, 2 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "kvserve_kernels.h"
#include <omp.h>

enum { MT_MAX = 12, MB_ROWS = 96 };

int kvserve_avx512_available(void) { return 1; }

/* c[i][16 j + l] (rows 64 floats apart) = sum over k of x[i][k] W_j[l][k], for MT rows of x
 * and NT column blocks w[j] (npairs vectors of 16 columns x 2): STEP adds pair p's products
 * to acc. Float32 FMAs (FMA_STEP): xt is [npairs][MT][2] float32. */
#define TILE_FN(NAME, MT, NT, STEP)                                                           \
    static void NAME##_##MT##_##NT(const float *xt, const void *const *w, int64_t npairs,     \
                                   float *c) {                                                \
        __m512 acc[MT][NT];                                                                   \
        for (int i = 0; i < MT; i++)                                                          \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();                     \
        for (int64_t p = 0; p < npairs; p++) STEP(MT, NT)                                     \
        for (int i = 0; i < MT; i++)                                                          \
            for (int j = 0; j < NT; j++) _mm512_store_ps(c + i * 64 + j * 16, acc[i][j]);     \
    }
/* Every weight stream is prefetched PREFETCH_BYTES ahead of its loads, one cache line per
 * line read. A tile of many rows spends longer on each line than one of a few rows, so the
 * same distance in bytes is further ahead in time; the distance must cover the memory's
 * latency at the bandwidth the core can draw, which needs more lines in flight on a core
 * with more bandwidth to draw (an AMD Zen core more than the Xeons measured). A prefetch
 * past the end of a buffer is harmless: it never faults. */
enum { PREFETCH_BYTES = 4096 };
#define PREFETCH_AHEAD(ptr) _mm_prefetch((const char *)(ptr) + PREFETCH_BYTES, _MM_HINT_T0)

/* acc[i][j] += x pair p of row i times the weight vectors w0[j] (k = 2p), w1[j] (2p + 1). */
#define FMA_PAIR(MT, NT)                                                                      \
    for (int i = 0; i < MT; i++) {                                                            \
        const __m512 a0 = _mm512_set1_ps(xp[2 * i]), a1 = _mm512_set1_ps(xp[2 * i + 1]);      \
        for (int j = 0; j < NT; j++) {                                                        \
            acc[i][j] = _mm512_fmadd_ps(a0, w0[j], acc[i][j]);                                \
            acc[i][j] = _mm512_fmadd_ps(a1, w1[j], acc[i][j]);                                \
        }                                                                                     \
    }
#define FMA_STEP(MT, NT)                                                                      \
    {                                                                                         \
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                             \
        const float *xp = xt + p * 2 * MT;                                                    \
        __m512 w0[NT], w1[NT];                                                                \
        for (int j = 0; j < NT; j++) {                                                        \
            PREFETCH_AHEAD((const uint16_t *)w[j] + p * 32);                                  \
            const __m512i v = _mm512_loadu_si512((const uint16_t *)w[j] + p * 32);            \
            w0[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                            \
            w1[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));                           \
        }                                                                                     \
        FMA_PAIR(MT, NT)                                                                      \
    }
#define TILE(MT, NT) TILE_FN(tile, MT, NT, FMA_STEP)

/* Every tile a kind T defines, and the table of them by rows and blocks (prefix P): up to 4
 * rows, 4 blocks (4 x 4 + 8 weight registers); more rows, 2 blocks (12 x 2 + 4). */
#define TILES4(T, MT) T(MT, 1) T(MT, 2) T(MT, 3) T(MT, 4)
#define TILES2(T, MT) T(MT, 1) T(MT, 2)
#define ALL_TILES(T)                                                                          \
    TILES4(T, 1) TILES4(T, 2) TILES4(T, 3) TILES4(T, 4) TILES2(T, 5) TILES2(T, 6)             \
    TILES2(T, 7) TILES2(T, 8) TILES2(T, 9) TILES2(T, 10) TILES2(T, 11) TILES2(T, 12)
#define ROW4(P, MT) {P##_##MT##_1, P##_##MT##_2, P##_##MT##_3, P##_##MT##_4}
#define ROW2(P, MT) {P##_##MT##_1, P##_##MT##_2, NULL, NULL}
#define TILE_TABLE(P)                                                                         \
    {ROW4(P, 1), ROW4(P, 2), ROW4(P, 3), ROW4(P, 4), ROW2(P, 5), ROW2(P, 6),                  \
     ROW2(P, 7), ROW2(P, 8), ROW2(P, 9), ROW2(P, 10), ROW2(P, 11), ROW2(P, 12)}

ALL_TILES(TILE)
typedef void (*tile_fn)(const float *, const void *const *, int64_t, float *);
static const tile_fn TILE_FNS[MT_MAX][4] = TILE_TABLE(tile);

/* The tiles on float32 weights (wf layout): pair p is the two vectors of k = 2p, 2p + 1,
 * 32 consecutive floats, and x's pair is read as the FMA tiles read it. */
#define F32_STEP(MT, NT)                                                                      \
    {                                                                                         \
        const float *xp = xt + p * 2 * MT;                                                    \
        __m512 w0[NT], w1[NT];                                                                \
        for (int j = 0; j < NT; j++) {                                                        \
            const float *wj = (const float *)w[j] + p * 32;                                   \
            PREFETCH_AHEAD(wj);                                                               \
            PREFETCH_AHEAD(wj + 16);                                                          \
            w0[j] = _mm512_loadu_ps(wj);                                                      \
            w1[j] = _mm512_loadu_ps(wj + 16);                                                 \
        }                                                                                     \
        FMA_PAIR(MT, NT)                                                                      \
    }
#define TILE_F32(MT, NT) TILE_FN(tf32, MT, NT, F32_STEP)
ALL_TILES(TILE_F32)
static const tile_fn F32_FNS[MT_MAX][4] = TILE_TABLE(tf32);

/* store_epilogue16 for float32 outputs, with float32 residuals: nothing rounded. */
static inline __attribute__((always_inline)) void store_epilogue16_f32(
    __m512 v, const float *u, int epilogue, const float *aux, int64_t ldaux, const float *bias,
    float *y, int64_t ldy, int64_t row, int64_t col) {
    if (epilogue == EPI_SWIGLU)
        v = silu_mul(v, _mm512_load_ps(u));
    else if (epilogue == EPI_ADD)
        v = _mm512_add_ps(v, _mm512_loadu_ps(aux + row * ldaux + col));
    else if (bias)
        v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
    _mm512_storeu_ps(y + row * ldy + col, v);
}

/* The same tiles on the bf16 dot product (`vdpbf16ps`): the weight vector is already the
 * instruction's operand (16 columns x 2 k), and x's pair (two adjacent bf16 values of a row,
 * one 32-bit word) is broadcast as it is: no conversion of either, and one instruction per
 * 32 multiply-adds where the float32 path takes two FMAs and the conversions. Where a core
 * retires it as fast as an FMA (AMD Zen 4) that is about twice the rate; where it retires
 * it at half the FMA rate the float32 path stays (chosen by measurement, kernels/amx.py).
 * xt here: [npairs][MT] 32-bit pairs. */
#if defined(__AVX512BF16__)
#define HAVE_DOT 1
#define DOT_STEP(MT, NT)                                                                      \
    {                                                                                         \
        const uint32_t *xp = (const uint32_t *)xt + p * MT;                                   \
        __m512bh wv[NT];                                                                      \
        for (int j = 0; j < NT; j++) {                                                        \
            PREFETCH_AHEAD((const uint16_t *)w[j] + p * 32);                                  \
            wv[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)w[j] + p * 32);            \
        }                                                                                     \
        for (int i = 0; i < MT; i++) {                                                        \
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[i]);                       \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, wv[j]);   \
        }                                                                                     \
    }
#define TILE_DOT(MT, NT) TILE_FN(tdot, MT, NT, DOT_STEP)
ALL_TILES(TILE_DOT)
static const tile_fn DOT_FNS[MT_MAX][4] = TILE_TABLE(tdot);
#endif

static int use_dot = 0; /* set once at start-up (kvserve_avx512_set_dot) */

/* 1: the tiles run on bf16 dot products from now on, 0: on float32 FMAs; returns the mode
 * in force (0 where this build has no bf16 dot product). */
int kvserve_avx512_set_dot(int on) {
#ifdef HAVE_DOT
    use_dot = on != 0;
#else
    (void)on;
#endif
    return use_dot;
}

/* Rows go in blocks of MB_ROWS (the last one partial), each block in
 * near-equal tiles of at most MT_MAX rows (none much shorter than the others). */
static int64_t tiles_in_block(int64_t rows) { return (rows + MT_MAX - 1) / MT_MAX; }

/* Row r of x, or (norm_w not NULL) its RMSNorm written into buf. */
static inline const uint16_t *input_row(const uint16_t *x, int64_t lda, int64_t r, int64_t K,
                                        const uint16_t *norm_w, float norm_eps, uint16_t *buf) {
    if (!norm_w) return x + r * lda;
    rms_norm_row_bf16(x + r * lda, norm_w, buf, (int)K, norm_eps);
    return buf;
}

/* The driver of both entry points below; f32: x, the weights, aux and y are float32 (wf
 * layout), else bf16 (tile layout) as kvserve_avx512_linear describes. */
static int linear_impl(const void *x, int64_t lda, int64_t M, int64_t K, const void *wp,
                       const void *wp2, int64_t N, const float *bias, int epilogue,
                       const void *aux, int64_t ldaux, void *y, int64_t ldy, int num_threads,
                       const uint16_t *norm_w, float norm_eps, const int f32) {
    if (K % 32 || N % 32 || M <= 0) return 1;
    const int64_t npairs = K / 2, nnb = N / 16;
    const size_t blk = (size_t)K * 16 * (f32 ? sizeof(float) : sizeof(uint16_t)); /* bytes */
    /* tile bounds: start[t] .. start[t + 1], tiles of row block b from first[b] */
    const int64_t nblocks = M <= 4 ? 1 : (M + MB_ROWS - 1) / MB_ROWS;
    int64_t ntiles = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t rows = b == nblocks - 1 ? M - b * MB_ROWS : MB_ROWS;
        ntiles += M <= 4 ? 1 : tiles_in_block(rows);
    }
    const int dot = use_dot && !f32; /* x as 32-bit bf16 pairs (half its float32 room) */
    const size_t xbytes = ((size_t)M * K * 4 + 63) / 64 * 64;
    float *xt = aligned_alloc(64, xbytes + (size_t)(ntiles + 1 + nblocks + 1) * 8);
    if (!xt) return 2;
    int64_t *start = (int64_t *)((char *)xt + xbytes), *first = start + ntiles + 1;
    int64_t t = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t r0 = b * MB_ROWS, rows = b == nblocks - 1 ? M - r0 : MB_ROWS;
        const int64_t n = M <= 4 ? 1 : tiles_in_block(rows);
        first[b] = t;
        for (int64_t i = 0; i < n; i++) start[t++] = r0 + rows * i / n;
    }
    start[ntiles] = M;
    first[nblocks] = ntiles;
    /* Output blocks per group: 4 weight blocks stream together at up to 4 rows, 2 above (for
     * SwiGLU, each output block takes a gate and an up block). */
    const int swiglu = epilogue == EPI_SWIGLU;
    const int64_t group = (M <= 4 ? 4 : 2) >> swiglu;
    int threads = num_threads < 1 ? 1 : num_threads;
    if ((int64_t)threads > nnb) threads = (int)nnb;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < ntiles; ti++) { /* x as float32 pairs, in the tiles' order */
            const int64_t m0 = start[ti], mt = start[ti + 1] - m0;
            float *dst = xt + m0 * K;
            uint16_t normed[norm_w ? K : 1];
            if (dot) {
                uint32_t *d32 = (uint32_t *)dst;
                for (int64_t i = 0; i < mt; i++) {
                    const uint16_t *src = input_row(x, lda, m0 + i, K, norm_w, norm_eps, normed);
                    for (int64_t p = 0; p < npairs; p++)
                        memcpy(d32 + p * mt + i, src + 2 * p, sizeof(uint32_t));
                }
                continue;
            }
            if (f32) {
                for (int64_t i = 0; i < mt; i++) {
                    const float *src = (const float *)x + (m0 + i) * lda;
                    for (int64_t p = 0; p < npairs; p++) {
                        dst[(p * mt + i) * 2] = src[2 * p];
                        dst[(p * mt + i) * 2 + 1] = src[2 * p + 1];
                    }
                }
                continue;
            }
            for (int64_t i = 0; i < mt; i++) {
                const uint16_t *src = input_row(x, lda, m0 + i, K, norm_w, norm_eps, normed);
                for (int64_t p = 0; p < npairs; p++) {
                    dst[(p * mt + i) * 2] = bf16_to_f32(src[2 * p]);
                    dst[(p * mt + i) * 2 + 1] = bf16_to_f32(src[2 * p + 1]);
                }
            }
        }
        float c[MT_MAX * 64] __attribute__((aligned(64)));
        const int th = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t lo = nnb * th / T, hi = nnb * (th + 1) / T;
        for (int64_t b = 0; b < nblocks; b++)
            for (int64_t ob = lo; ob < hi; ob += group) {
                const int g = (int)(hi - ob < group ? hi - ob : group);
                const void *w[4];
                for (int j = 0; j < g; j++) {
                    w[j] = (const char *)wp + (ob + j) * blk;
                    if (swiglu) w[g + j] = (const char *)wp2 + (ob + j) * blk;
                }
                const int nt = swiglu ? 2 * g : g;
                for (int64_t ti = first[b]; ti < first[b + 1]; ti++) {
                    const int64_t m0 = start[ti];
                    const int mt = (int)(start[ti + 1] - m0);
                    if (f32)
                        F32_FNS[mt - 1][nt - 1](xt + m0 * K, w, npairs, c);
#ifdef HAVE_DOT
                    else if (dot)
                        DOT_FNS[mt - 1][nt - 1](xt + m0 * K, w, npairs, c);
#endif
                    else
                        TILE_FNS[mt - 1][nt - 1](xt + m0 * K, w, npairs, c);
                    for (int i = 0; i < mt; i++) /* SwiGLU: the up sums g blocks along */
                        for (int j = 0; j < g; j++) {
                            const __m512 v = _mm512_load_ps(c + i * 64 + j * 16);
                            const float *u = c + i * 64 + (g + j) * 16;
                            if (f32)
                                store_epilogue16_f32(v, u, epilogue, aux, ldaux, bias, y, ldy,
                                                     m0 + i, (ob + j) * 16);
                            else
                                store_epilogue16(v, u, epilogue, aux, ldaux, bias, y, ldy,
                                                 m0 + i, (ob + j) * 16);
                        }
                }
            }
    }
    free(xt);
    return 0;
}

/* y[M, N] (rows ldy apart) = epilogue(x W^T) for x [M, K] bf16 (rows lda apart):
 * EPI_NONE (+ bias, float32 [N], or NULL), EPI_ADD (+ aux [M, N] bf16, rows ldaux apart),
 * EPI_SWIGLU (wp2 holds the up projection: y = silu(x Wg^T) * (x Wu^T), both packed);
 * EPI_NONE | EPI_F32: y is float32. norm_w (bf16 [K], or NULL): x goes through RMSNorm
 * first, as in amx_gemm.c. */
int kvserve_avx512_linear(const uint16_t *x, int64_t lda, int64_t M, int64_t K,
                          const uint16_t *wp, const uint16_t *wp2, int64_t N, const float *bias,
                          int epilogue, const uint16_t *aux, int64_t ldaux, uint16_t *y,
                          int64_t ldy, int num_threads, const uint16_t *norm_w,
                          float norm_eps) {
    return linear_impl(x, lda, M, K, wp, wp2, N, bias, epilogue, aux, ldaux, y, ldy,
                       num_threads, norm_w, norm_eps, 0);
}

/* The same on float32: x [M, K], weights in the wf layout, aux [M, N] and y float32; the
 * epilogues of kvserve_avx512_linear without EPI_F32 (y is float32) or a norm. */
int kvserve_avx512_linear_f32(const float *x, int64_t lda, int64_t M, int64_t K,
                              const float *wp, const float *wp2, int64_t N, const float *bias,
                              int epilogue, const float *aux, int64_t ldaux, float *y,
                              int64_t ldy, int num_threads) {
    if (epilogue & EPI_F32) return 1;
    return linear_impl(x, lda, M, K, wp, wp2, N, bias, epilogue, aux, ldaux, y, ldy,
                       num_threads, NULL, 0.f, 1);
}

#else

int kvserve_avx512_available(void) { return 0; }

int kvserve_avx512_set_dot(int on) {
    (void)on;
    return 0;
}

int kvserve_avx512_linear(const uint16_t *x, int64_t lda, int64_t M, int64_t K,
                          const uint16_t *wp, const uint16_t *wp2, int64_t N, const float *bias,
                          int epilogue, const uint16_t *aux, int64_t ldaux, uint16_t *y,
                          int64_t ldy, int num_threads, const uint16_t *norm_w,
                          float norm_eps) {
    (void)x, (void)lda, (void)M, (void)K, (void)wp, (void)wp2, (void)N, (void)bias;
    (void)epilogue, (void)aux, (void)ldaux, (void)y, (void)ldy, (void)num_threads;
    (void)norm_w, (void)norm_eps;
    return 1; /* no AVX-512 on the build machine: oneDNN serves */
}

int kvserve_avx512_linear_f32(const float *x, int64_t lda, int64_t M, int64_t K,
                              const float *wp, const float *wp2, int64_t N, const float *bias,
                              int epilogue, const float *aux, int64_t ldaux, float *y,
                              int64_t ldy, int num_threads) {
    (void)x, (void)lda, (void)M, (void)K, (void)wp, (void)wp2, (void)N, (void)bias;
    (void)epilogue, (void)aux, (void)ldaux, (void)y, (void)ldy, (void)num_threads;
    return 1;
}

#endif
