#define _GNU_SOURCE
/* bfloat16 linear layers on AMX tiles, with the decoder's epilogues fused.
 *
 * y = x W^T for x [M, K] (rows lda apart) and a weight W [N, K] packed once at load into the
 * tile layout the products read (VNNI pairs: the two bf16 values of W a tile row multiplies
 * together are adjacent):
 *   wp[nb][kb][r][c][2] = W[16 nb + c][32 kb + 2 r + {0,1}]   (one 1 KiB B tile per 16 x 32)
 * x is first copied into contiguous 16 x 32 tiles (a partial last block of rows padded with
 * zeros), except at prefill sizes with no norm to apply, where it is read in place (a_rows).
 * A micro-step is 32 rows x 32 columns: four float32 accumulator tiles, two A and two
 * B tiles (the weights stream from memory at decode sizes; see PREFETCH). Its epilogue rounds
 * to bf16 once, after adding a bias, adding a residual, or, for the gate/up pair of SwiGLU,
 * taking silu(gate) * up, so an MLP's intermediate is written once.
 * Thread t owns a contiguous share of the columns; with few rows (decode) each column block's
 * weights serve every row block before the next is read, with many (prefill) a row block
 * serves every column block of the thread, its A tiles held in L1: the weights, by then in L2,
 * load with the streaming hint so as not to evict them, and a K longer than L1 holds is taken
 * in chunks (rows_in_k_chunks), and a thread's columns in groups whose weights stay in L2 while
 * every row block passes (L2_BUDGET). The epilogue of one micro-step runs in pieces between the
 * next one's tile products (pending), so that its vector work overlaps the tile unit's.
 *
 * Why not oneDNN: in a whole forward pass (cold weights, one layer after another) oneDNN's
 * bf16 matmuls with prepacked weights ran slower than these on an AMX Xeon, the most at decode
 * sizes (on a later, faster AMX Xeon oneDNN stayed ahead at prefill-sized steps: using it
 * there would cost a second copy of the weights); and oneDNN keeps a primitive per distinct
 * row count, memory that grows with traffic. K and N must be multiples of 32 (the caller uses
 * oneDNN for other shapes).
 *
 * Returns 0, 1 (nothing written) where it does not apply (no AMX on the build machine or the
 * OS refuses the tile state), 2 out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The layout is plain C: the AVX-512 kernel (avx512_gemm.c) reads it on CPUs without AMX. */
void kvserve_amx_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp) {
    const int64_t nkb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            uint16_t *t = wp + (nb * nkb + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * K + kb * 32 + 2 * r;
                    t[r * 32 + 2 * c] = src[0];
                    t[r * 32 + 2 * c + 1] = src[1];
                }
        }
}

void kvserve_amx_unpack(const uint16_t *wp, int64_t N, int64_t K, uint16_t *w) {
    const int64_t nkb = K / 32;
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            const uint16_t *t = wp + (nb * nkb + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    uint16_t *dst = w + (nb * 16 + c) * K + kb * 32 + 2 * r;
                    dst[0] = t[r * 32 + 2 * c];
                    dst[1] = t[r * 32 + 2 * c + 1];
                }
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define KVSERVE_AMX_TILES
#include "kvserve_kernels.h"
#include <omp.h>

int kvserve_amx_available(void) { return amx_permitted(); }

/* How block32 reads. FROM_L2: the weights are already in L2 (prefill: a row block serves every
 * column block of the thread): B tiles load with the streaming hint, so that they do not evict
 * the row block's A tiles from L1 (where they are read again for the next column block).
 * PREFETCH: the weights stream from memory for a single row block, fetched two K steps ahead
 * (with two to four row blocks the hardware prefetcher alone measured faster; the second
 * block's pass re-reads the weights from L1, which T0 prefetches of the next ones may evict).
 * ACCUMULATE: add onto the partial sums in cb instead of starting from zero. */
enum { FROM_L2 = 1, ACCUMULATE = 2, PREFETCH = 4 };

/* A K chunk of at most this many 32-wide blocks keeps a row block's A tiles (32 rows x 32 x
 * KCHUNK bf16, 36 KiB) inside a 48 KiB L1 beside the B tiles passing through it. */
#define KCHUNK 18
/* Prefill: a thread's column blocks are taken in groups of at most this many bytes of weights,
 * which stay in the 2 MiB L2 of every AMX core so far while all row blocks pass (the gate and
 * up projections of a SwiGLU MLP together outgrow it: their weights came from L3 for every row
 * block). */
#define L2_BUDGET (768 << 10)

/* The epilogue of a finished micro-step, done a few 16-wide pieces at a time between the tile
 * products of the next one: run after them, its vector work waited behind the tile products in
 * the reorder buffer instead of overlapping them. */
typedef struct {
    const float *c, *u; /* the stored float32 sums (and the up projection's) */
    int units;          /* 16-wide pieces: 2 per row; 0: none pending */
    int done;
    int64_t mb, nb;
    int epilogue;
    const uint16_t *aux;
    int64_t ldaux;
    const float *bias;
    uint16_t *y;
    int64_t ldy;
} pending;

/* The outputs of row block mb, column block nb (rows of them) from the float32 sums c (and u,
 * the up projection's, for EPI_SWIGLU), pending from now on. */
static inline void pending_set(pending *p, const float *c, const float *u, int rows, int64_t mb,
                               int64_t nb) {
    p->c = c;
    p->u = u;
    p->units = 2 * rows;
    p->done = 0;
    p->mb = mb;
    p->nb = nb;
}

/* Its pieces (two per row) done up to the upto-th. */
static inline __attribute__((always_inline)) void pending_run(pending *p, int upto) {
    if (upto > p->units) upto = p->units;
    for (; p->done < upto; p->done++) {
        const int i = p->done >> 1, h = p->done & 1;
        store_epilogue16(_mm512_load_ps(p->c + i * 32 + 16 * h), p->u + i * 32 + 16 * h,
                         p->epilogue, p->aux, p->ldaux, p->bias, p->y, p->ldy, p->mb * 32 + i,
                         p->nb * 32 + 16 * h);
    }
}

/* A row block's two 16-row A tiles at K block kb: a0 + kb * kstep and a1 + kb * kstep, their
 * rows ld bytes apart. */
typedef struct {
    const uint16_t *a0, *a1;
    int64_t kstep, ld;
} a_block;

/* Where the kernel reads x: the tile copy ap ([row block][half][kb][16][32], a partial last
 * block padded with zeros: a tile load reads one 1 KiB run), or, at prefill sizes with no norm
 * to apply, x itself (rows lda apart; a partial last row block from a padded copy of its own,
 * tail), which saves writing and reading back a copy as large as x. */
typedef struct {
    const uint16_t *ap, *x, *tail;
    int64_t lda, nkb, nmb, mtail;
} a_rows;

static inline a_block row_block(const a_rows *A, int64_t mb) {
    if (A->x && !(A->mtail && mb == A->nmb - 1)) {
        const uint16_t *r = A->x + mb * 32 * A->lda;
        return (a_block){r, r + 16 * A->lda, 32, 2 * A->lda};
    }
    const uint16_t *t = A->x ? A->tail : A->ap + mb * 2 * A->nkb * 512;
    return (a_block){t, t + A->nkb * 512, 512, 64};
}

/* The same rows from K block kc on. */
static inline a_block from_k(a_block a, int64_t kc) {
    return (a_block){a.a0 + kc * a.kstep, a.a1 + kc * a.kstep, a.kstep, a.ld};
}

/* 32 rows (a: rows 0-15 and 16-31 as tiles) x two 16-column B panels b0, b1 over
 * nkb K blocks, into cb[32][32] float32; mode: FROM_L2, PREFETCH, ACCUMULATE (above). pe (or
 * NULL): pending outputs, done between the K steps and all of them before cb is written. */
static inline __attribute__((always_inline)) void block32(a_block a, const uint16_t *b0,
                                                          const uint16_t *b1,
                                                          int64_t nkb, float *cb, int mode,
                                                          pending *pe) {
    if (mode & ACCUMULATE) {
        _tile_loadd(0, cb, 128);
        _tile_loadd(1, cb + 16, 128);
        _tile_loadd(2, cb + 512, 128);
        _tile_loadd(3, cb + 528, 128);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < nkb; kb++) {
        _tile_loadd(4, a.a0 + kb * a.kstep, a.ld);
        _tile_loadd(5, a.a1 + kb * a.kstep, a.ld);
        if (mode & FROM_L2) {
            _tile_stream_loadd(6, b0 + kb * 512, 64);
            _tile_stream_loadd(7, b1 + kb * 512, 64);
        } else {
            if (mode & PREFETCH)
                for (int l = 0; l < 1024; l += 64) {
                    _mm_prefetch((const char *)(b0 + (kb + 2) * 512) + l, _MM_HINT_T0);
                    _mm_prefetch((const char *)(b1 + (kb + 2) * 512) + l, _MM_HINT_T0);
                }
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (pe) pending_run(pe, (int)((kb + 1) * pe->units / nkb) + 1);
    }
    if (pe) pending_run(pe, pe->units);
    _tile_stored(0, cb, 128);
    _tile_stored(1, cb + 16, 128);
    _tile_stored(2, cb + 512, 128);
    _tile_stored(3, cb + 528, 128);
}

/* Every (row block, column block) item of the thread over all of K, in a software pipeline:
 * the epilogue of item i - 1 runs between the tile products of item i. cols_outer (few row
 * blocks, decode): each column block's weights are read once from memory and serve every row
 * block from L1; else (prefill) a row block stays in L1 while the thread's columns pass from
 * its L2. */
static void pipeline(const a_rows *A, const uint16_t *wp, const uint16_t *wp2, int64_t nb_lo,
                     int64_t nb_hi, int cols_outer, int epilogue, const float *bias,
                     const uint16_t *aux, int64_t ldaux, uint16_t *y, int64_t ldy) {
    const int64_t nmb = A->nmb, mtail = A->mtail, nkb = A->nkb;
    float cb[2][32 * 32] __attribute__((aligned(64)));
    float cu[2][32 * 32] __attribute__((aligned(64)));
    const int64_t n_outer = cols_outer ? nb_hi - nb_lo : nmb;
    const int64_t n_inner = cols_outer ? nmb : nb_hi - nb_lo;
    const int64_t items = n_outer * n_inner;
    const int mode = !cols_outer ? FROM_L2 : nmb == 1 ? PREFETCH : 0;
    pending pe = {.units = 0, .epilogue = epilogue, .aux = aux, .ldaux = ldaux, .bias = bias,
                  .y = y, .ldy = ldy};
    for (int64_t it = 0; it < items; it++) {
        const int64_t o = it / n_inner, in = it % n_inner;
        const int64_t mb = cols_outer ? in : o, nb = nb_lo + (cols_outer ? o : in);
        const a_block a = row_block(A, mb);
        const uint16_t *b0 = wp + (2 * nb) * nkb * 512, *b1 = b0 + nkb * 512;
        const int rows = mtail && mb == nmb - 1 ? (int)mtail : 32;
        if (epilogue == EPI_ADD) /* the residual this block's epilogue adds, by then in L1 */
            for (int i = 0; i < rows; i++)
                _mm_prefetch((const char *)(aux + (mb * 32 + i) * ldaux + nb * 32), _MM_HINT_T0);
        block32(a, b0, b1, nkb, cb[it & 1], mode, &pe);
        if (epilogue == EPI_SWIGLU) {
            const uint16_t *u0 = wp2 + (2 * nb) * nkb * 512, *u1 = u0 + nkb * 512;
            block32(a, u0, u1, nkb, cu[it & 1], mode, NULL);
        }
        pending_set(&pe, cb[it & 1], cu[it & 1], rows, mb, nb);
    }
    pending_run(&pe, pe.units);
}

/* Prefill with K over KCHUNK blocks (SwiGLU's down projection): for each row block, K in chunks
 * whose A tiles stay in L1 while the thread's columns pass, the partial sums of every column
 * block kept in part (float32 [2][nnb][32][32]: the second half for EPI_SWIGLU's up
 * projection); a row block's epilogue runs during the next row block's first chunk. */
static void rows_in_k_chunks(const a_rows *A, const uint16_t *wp, const uint16_t *wp2,
                             int64_t nnb, int64_t nb_lo, int64_t nb_hi, float *part,
                             int epilogue, const float *bias, const uint16_t *aux,
                             int64_t ldaux, uint16_t *y, int64_t ldy) {
    const int64_t nmb = A->nmb, mtail = A->mtail, nkb = A->nkb;
    const int64_t chunks = (nkb + KCHUNK - 1) / KCHUNK, step = (nkb + chunks - 1) / chunks;
    pending pe = {.units = 0, .epilogue = epilogue, .aux = aux, .ldaux = ldaux, .bias = bias,
                  .y = y, .ldy = ldy};
    for (int64_t mb = 0; mb < nmb; mb++) {
        const a_block a = row_block(A, mb);
        for (int64_t kc = 0; kc < nkb; kc += step) {
            const int64_t kn = nkb - kc < step ? nkb - kc : step, off = kc * 512;
            const int mode = FROM_L2 | (kc ? ACCUMULATE : 0);
            for (int64_t nb = nb_lo; nb < nb_hi; nb++) {
                const uint16_t *b0 = wp + 2 * nb * nkb * 512 + off, *b1 = b0 + nkb * 512;
                /* the previous row block's outputs of this column block, from the sums that
                 * this call overwrites once they are done */
                const int prev = kc == 0 && mb > 0;
                if (prev)
                    pending_set(&pe, part + nb * 1024, part + (nnb + nb) * 1024, 32, mb - 1, nb);
                block32(from_k(a, kc), b0, b1, kn, part + nb * 1024, mode,
                        prev ? &pe : NULL);
                if (epilogue == EPI_SWIGLU) {
                    const uint16_t *u0 = wp2 + 2 * nb * nkb * 512 + off, *u1 = u0 + nkb * 512;
                    block32(from_k(a, kc), u0, u1, kn, part + (nnb + nb) * 1024, mode, NULL);
                }
            }
        }
    }
    for (int64_t nb = nb_lo; nb < nb_hi; nb++) {
        pending_set(&pe, part + nb * 1024, part + (nnb + nb) * 1024, mtail ? (int)mtail : 32,
                    nmb - 1, nb);
        pending_run(&pe, pe.units);
    }
}

/* y[M, N] (rows ldy apart) = epilogue(x W^T): EPI_NONE (+ bias, float32 [N], or NULL),
 * EPI_ADD (+ aux [M, N] bf16, rows ldaux apart), EPI_SWIGLU (wp2 holds the up projection:
 * y = silu(x Wg^T) * (x Wu^T), both packed as wp); EPI_NONE | EPI_F32: y is float32.
 * norm_w (bf16 [K], or NULL): x is taken through RMSNorm first (weight norm_w, epsilon
 * norm_eps), each row as it is copied into tiles, so the decoder's norm before a projection
 * costs no pass, call or buffer of its own. */
int kvserve_amx_linear(const uint16_t *x, int64_t lda, int64_t M, int64_t K, const uint16_t *wp,
                       const uint16_t *wp2, int64_t N, const float *bias, int epilogue,
                       const uint16_t *aux, int64_t ldaux, uint16_t *y, int64_t ldy,
                       int num_threads, const uint16_t *norm_w, float norm_eps) {
    if (K % 32 || N % 32 || M <= 0 || !amx_permitted()) return 1;
    const int64_t nkb = K / 32, nnb = N / 32, nmb = (M + 31) / 32;
    const int64_t mtail = M % 32;
    const int prefill = nmb > 4; /* else few row blocks: each column block's weights serve all */
    const int direct = prefill && !norm_w; /* see a_rows */
    /* the tile copy: all of x, or (direct) its partial last row block */
    const int64_t copied = direct ? (mtail ? 1 : 0) : nmb, first = nmb - copied;
    uint16_t *ap = aligned_alloc(64, (size_t)(copied ? copied : 1) * 32 * K * 2);
    const int chunked = prefill && nkb > KCHUNK; /* see rows_in_k_chunks */
    float *part = chunked ? aligned_alloc(64, (size_t)nnb * 2 * 1024 * sizeof(float)) : NULL;
    if (!ap || (chunked && !part)) {
        free(ap);
        free(part);
        return 2;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = first * 32; r < nmb * 32; r++) {
        const int64_t mb = r / 32 - first, half = (r % 32) / 16, i = r % 16;
        uint16_t *dst = ap + ((mb * 2 + half) * nkb * 16 + i) * 32;
        if (r < M) {
            const uint16_t *src = x + r * lda;
            uint16_t normed[norm_w ? K : 1];
            if (norm_w) {
                rms_norm_row_bf16(src, norm_w, normed, (int)K, norm_eps);
                src = normed;
            }
            for (int64_t kb = 0; kb < nkb; kb++) memcpy(dst + kb * 512, src + kb * 32, 64);
        } else {
            for (int64_t kb = 0; kb < nkb; kb++) memset(dst + kb * 512, 0, 64);
        }
    }
    const a_rows A = {.ap = direct ? NULL : ap, .x = direct ? x : NULL, .tail = ap, .lda = lda,
                      .nkb = nkb, .nmb = nmb, .mtail = mtail};
    /* few rows: little work per column, so fewer threads than columns to share */
    int threads = num_threads;
    if ((int64_t)threads > nnb) threads = (int)nnb;
#pragma omp parallel num_threads(threads)
    {
        tile_config cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t nb_lo = nnb * t / T, nb_hi = nnb * (t + 1) / T;
        if (chunked)
            rows_in_k_chunks(&A, wp, wp2, nnb, nb_lo, nb_hi, part, epilogue, bias, aux, ldaux,
                             y, ldy);
        else if (!prefill)
            pipeline(&A, wp, wp2, nb_lo, nb_hi, 1, epilogue, bias, aux, ldaux, y, ldy);
        else { /* column groups of at most L2_BUDGET bytes of weights */
            const int64_t per_nb = 2 * nkb * 1024 * (epilogue == EPI_SWIGLU ? 2 : 1);
            const int64_t groups = ((nb_hi - nb_lo) * per_nb + L2_BUDGET - 1) / L2_BUDGET;
            const int64_t g = groups > 1 ? (nb_hi - nb_lo + groups - 1) / groups : nb_hi - nb_lo;
            for (int64_t lo = nb_lo; lo < nb_hi; lo += g)
                pipeline(&A, wp, wp2, lo, lo + g < nb_hi ? lo + g : nb_hi, 0, epilogue, bias,
                         aux, ldaux, y, ldy);
        }
        _tile_release();
    }
    free(part);
    free(ap);
    return 0;
}

#else

int kvserve_amx_available(void) { return 0; }

int kvserve_amx_linear(const uint16_t *x, int64_t lda, int64_t M, int64_t K, const uint16_t *wp,
                       const uint16_t *wp2, int64_t N, const float *bias, int epilogue,
                       const uint16_t *aux, int64_t ldaux, uint16_t *y, int64_t ldy,
                       int num_threads, const uint16_t *norm_w, float norm_eps) {
    (void)x, (void)lda, (void)M, (void)K, (void)wp, (void)wp2, (void)N, (void)bias;
    (void)epilogue, (void)aux, (void)ldaux, (void)y, (void)ldy, (void)num_threads;
    (void)norm_w, (void)norm_eps;
    return 1; /* no AMX on the build machine: oneDNN serves */
}

#endif
