/* Causal attention of a prefill chunk over its sequence's keys: its own fresh K/V when the
 * chunk starts the sequence, or its cached context followed by its own K/V when it continues
 * one (a chunked prompt's later chunks, a prefix-cache hit's suffix).
 *
 * PyTorch's CPU flash kernel splits keys into 512-wide blocks below 768 queries, so a causal
 * mask saves it nothing at the usual prompt lengths: it computes the whole square. This kernel
 * works in 32-key blocks and skips every block above the diagonal; both matrix products are
 * float32 FMAs over values converted once, or, for bf16 on a CPU whose bf16 dot product
 * (`vdpbf16ps`) outruns its float32 FMAs (dt 2; an AMD Zen 4 retires one 512-bit `vdpbf16ps`,
 * 32 multiply-adds, as fast as one 512-bit FMA, 16), bf16 dot products over pairs: K and V
 * repacked as bf16 pairs, the probabilities rounded to bf16 for the value product (as SDPA's
 * and the AMX kernel's bf16 paths do), sums in float32.
 *
 * Layout: q [L, H, D] and k/v [Lk, KVH, D] (Lk >= L) in float32 or bfloat16 (dt 0 / 1 or 2), rows
 * (tokens) q_stride / kv_stride elements apart and KV heads kv_head_stride apart (views into
 * the fused QKV projection, or into the gathered [KVH, S, D] context); out [L, H, D] in the
 * same dtype, contiguous. Query i sits at position Lk - L + i. K and V of each KV head are
 * first converted to float32 and repacked, once per call:
 *   kt[block][d][j] = k[32 block + j][d]   (16 keys' values of one dim: one 512-bit load)
 *   vf[block][j][d] = v[32 block + j][d]
 * or, with dot products, as bf16 pairs (one 512-bit load: 16 keys x 2 dims, 16 dims x 2 keys):
 *   kp[block][d / 2][j][d % 2] = k[32 block + j][d]
 *   vp[block][j / 2][d][j % 2] = v[32 block + j][d]
 * A task is one KV head and a tile of TQ query positions for each of the G query heads that
 * share it (R = G * TQ rows), with an online softmax (running max and sum per row) in float32.
 *
 * Query at position i sees keys j with i - window < j <= i (window 0 = unbounded). Returns 1
 * (nothing written) where it does not apply: no AVX-512 (dt 2: no AVX512-BF16), head size not
 * a multiple of 16 or above 256, more than 64 rows per task; the caller then uses SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "kvserve_kernels.h"

#define KB 32      /* keys per block: two 16-lane vectors */
#define MAXD 256   /* largest head size */
#define MAXR 64    /* largest rows per task */
#define QK_ROWS 8  /* rows whose scores are computed together */

static inline float bf16f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i of a float32 (dt 0) or bfloat16 (dt 1) array, as float32. */
static inline float load_dt(const void *base, int64_t i, int dt) {
    return dt ? bf16f(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* r[i] (16 rows of 16 floats) transposed in registers: r[c] becomes column c. Four rounds of
 * shuffles, 64 in all, where the scalar transposing copy took a load and a store per value. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: rows i, i + 1 of columns c, c + 1 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* per 128-bit lane: rows i .. i + 3 of one column */
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) { /* u[4g + c]: rows 4g .. 4g + 3 of columns c, c + 4, c + 8, c + 12 */
        const __m512 a0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  /* columns c, c + 8 */
        const __m512 a1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);  /* c + 4, c + 12 */
        const __m512 b0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 b1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_f32x4(a0, b0, 0x88);
        r[c + 8] = _mm512_shuffle_f32x4(a0, b0, 0xdd);
        r[c + 4] = _mm512_shuffle_f32x4(a1, b1, 0x88);
        r[c + 12] = _mm512_shuffle_f32x4(a1, b1, 0xdd);
    }
}

/* K and V of one block as float32 (the layouts in the header); keys past Lk are zero. */
static void pack_block(const void *k, const void *v, int64_t kv_stride, int64_t Lk, int D,
                       int64_t b, float *kt, float *vf, int dt) {
    for (int j0 = 0; j0 < KB; j0 += 16)
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t t = b * KB + j0 + i;
                r[i] = t < Lk ? load16(k, t * kv_stride + d0, dt) : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_store_ps(kt + (d0 + c) * KB + j0, r[c]);
        }
    for (int j = 0; j < KB; j++) {
        const int64_t t = b * KB + j;
        for (int d0 = 0; d0 < D; d0 += 16)
            _mm512_store_ps(vf + j * D + d0, t < Lk ? load16(v, t * kv_stride + d0, dt) : _mm512_setzero_ps());
    }
}

/* For two rows a and b: acc = acc * corr + sum_j p[j] v[j] over the block's keys (masked keys
 * have p = 0). Each V load serves both rows, and even and odd keys go to separate accumulators,
 * so the loop is bound by FMAs, not by loads or FMA latency. Inlined with a constant D. */
static inline __attribute__((always_inline)) void pv_rows_d(float *aa, float *ab,
                                                            const float *pa, const float *pb,
                                                            float ca, float cb, const float *vb,
                                                            const int D) {
    enum { MAXC = MAXD / 16 };
    const int nc = D / 16;
    __m512 a0[MAXC], a1[MAXC], b0[MAXC], b1[MAXC];
    const __m512 cav = _mm512_set1_ps(ca), cbv = _mm512_set1_ps(cb);
    for (int c = 0; c < nc; c++) {
        a0[c] = _mm512_mul_ps(_mm512_loadu_ps(aa + 16 * c), cav);
        b0[c] = _mm512_mul_ps(_mm512_loadu_ps(ab + 16 * c), cbv);
        a1[c] = b1[c] = _mm512_setzero_ps();
    }
    for (int j = 0; j < KB; j += 2) {
        const __m512 pa0 = _mm512_set1_ps(pa[j]), pa1 = _mm512_set1_ps(pa[j + 1]);
        const __m512 pb0 = _mm512_set1_ps(pb[j]), pb1 = _mm512_set1_ps(pb[j + 1]);
        for (int c = 0; c < nc; c++) {
            const __m512 v0 = _mm512_load_ps(vb + j * D + 16 * c);
            const __m512 v1 = _mm512_load_ps(vb + (j + 1) * D + 16 * c);
            a0[c] = _mm512_fmadd_ps(pa0, v0, a0[c]);
            b0[c] = _mm512_fmadd_ps(pb0, v0, b0[c]);
            a1[c] = _mm512_fmadd_ps(pa1, v1, a1[c]);
            b1[c] = _mm512_fmadd_ps(pb1, v1, b1[c]);
        }
    }
    for (int c = 0; c < nc; c++) {
        _mm512_storeu_ps(aa + 16 * c, _mm512_add_ps(a0[c], a1[c]));
        _mm512_storeu_ps(ab + 16 * c, _mm512_add_ps(b0[c], b1[c]));
    }
}

/* F(args..., D) with D a constant at the common head sizes, so the inlined loops unroll. */
#define WITH_CONST_D(F, ...)                                                                    \
    do {                                                                                        \
        if (D == 64)                                                                            \
            F(__VA_ARGS__, 64);                                                                 \
        else if (D == 128)                                                                      \
            F(__VA_ARGS__, 128);                                                                \
        else                                                                                    \
            F(__VA_ARGS__, D);                                                                  \
    } while (0)

static void pv_rows(float *aa, float *ab, const float *pa, const float *pb, float ca, float cb,
                    const float *vb, int D) {
    WITH_CONST_D(pv_rows_d, aa, ab, pa, pb, ca, cb, vb);
}

#if defined(__AVX512BF16__)
#define HAVE_DP 1
/* K and V of one block as bf16 pairs (the layouts in the header), with AVX-512 moves: each
 * key's 32-bit pairs of dims gathered 16 keys at a time into kp, and each two keys' rows
 * interleaved into vp by one permute per 16 dims. Keys past Lk are zero. (Scalar 16-bit
 * moves took about a tenth of the kernel's time on a 1,024-token chunk.) */
static void pack_block_pairs(const uint16_t *k, const uint16_t *v, int64_t kv_stride, int64_t Lk,
                             int D, int64_t b, uint16_t *kp, uint16_t *vp) {
    const int64_t t0 = b * KB;
    const int64_t nk = Lk - t0 < KB ? Lk - t0 : KB; /* keys of this block that exist */
    const __m512i step = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(kv_stride * 2)));
    const __mmask16 m0 = nk >= 16 ? 0xffff : (__mmask16)((1u << nk) - 1);
    const __mmask16 m1 = nk >= 32 ? 0xffff : nk <= 16 ? 0 : (__mmask16)((1u << (nk - 16)) - 1);
    uint32_t *kp32 = (uint32_t *)kp;
    const char *k0 = (const char *)(k + t0 * kv_stride), *k1 = (const char *)(k + (t0 + 16) * kv_stride);
    for (int d2 = 0; d2 < D / 2; d2++) {
        const __m512i z = _mm512_setzero_si512();
        _mm512_store_si512(kp32 + d2 * KB, _mm512_mask_i32gather_epi32(z, m0, step, k0 + 4 * d2, 1));
        _mm512_store_si512(kp32 + d2 * KB + 16,
                           m1 ? _mm512_mask_i32gather_epi32(z, m1, step, k1 + 4 * d2, 1) : z);
    }
    /* vp[j / 2][d][j % 2]: output lanes 2i and 2i + 1 take dim i of rows j and j + 1 */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < KB; j += 2) {
        const int64_t t = t0 + j;
        for (int d = 0; d < D; d += 32) {
            const __mmask32 dm = D - d >= 32 ? 0xffffffffu : (__mmask32)((1u << (D - d)) - 1);
            const __m512i a = t < Lk ? _mm512_maskz_loadu_epi16(dm, v + t * kv_stride + d) : _mm512_setzero_si512();
            const __m512i c = t + 1 < Lk ? _mm512_maskz_loadu_epi16(dm, v + (t + 1) * kv_stride + d)
                                         : _mm512_setzero_si512();
            uint16_t *o = vp + ((int64_t)(j >> 1) * D + d) * 2;
            _mm512_store_si512(o, _mm512_permutex2var_epi16(a, lo, c));
            if (D - d > 16) _mm512_store_si512(o + 32, _mm512_permutex2var_epi16(a, hi, c));
        }
    }
}

/* pv_rows with bf16 dot products: pa/pb hold each row's 32 probabilities as 16 bf16 pairs. */
static inline __attribute__((always_inline)) void pv_rows_dp_d(float *aa, float *ab,
                                                               const uint32_t *pa,
                                                               const uint32_t *pb, float ca,
                                                               float cb, const uint16_t *vb,
                                                               const int D) {
    enum { MAXC = MAXD / 16 };
    const int nc = D / 16;
    __m512 a[MAXC], bb[MAXC];
    const __m512 cav = _mm512_set1_ps(ca), cbv = _mm512_set1_ps(cb);
    for (int c = 0; c < nc; c++) {
        a[c] = _mm512_mul_ps(_mm512_loadu_ps(aa + 16 * c), cav);
        bb[c] = _mm512_mul_ps(_mm512_loadu_ps(ab + 16 * c), cbv);
    }
    for (int jp = 0; jp < KB / 2; jp++) {
        const __m512bh p0 = (__m512bh)_mm512_set1_epi32((int)pa[jp]);
        const __m512bh p1 = (__m512bh)_mm512_set1_epi32((int)pb[jp]);
        for (int c = 0; c < nc; c++) {
            const __m512bh vv = (__m512bh)_mm512_load_si512(vb + ((int64_t)jp * D + 16 * c) * 2);
            a[c] = _mm512_dpbf16_ps(a[c], p0, vv);
            bb[c] = _mm512_dpbf16_ps(bb[c], p1, vv);
        }
    }
    for (int c = 0; c < nc; c++) {
        _mm512_storeu_ps(aa + 16 * c, a[c]);
        _mm512_storeu_ps(ab + 16 * c, bb[c]);
    }
}

static void pv_rows_dp(float *aa, float *ab, const uint32_t *pa, const uint32_t *pb, float ca,
                       float cb, const uint16_t *vb, int D) {
    WITH_CONST_D(pv_rows_dp_d, aa, ab, pa, pb, ca, cb, vb);
}
#endif

/* 1 where this build has the bf16 dot-product path (dt 2). */
int kvserve_prefill_has_bf16_dot(void) {
#ifdef HAVE_DP
    return 1;
#else
    return 0;
#endif
}

int kvserve_prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                              int64_t kv_stride, int64_t kv_head_stride, void *out, int64_t L,
                              int64_t Lk, int H, int KVH, int D, float scale, int window, int dt,
                              int num_threads) {
    const int G = H / KVH;
    const int dp = dt == 2; /* bf16 dot products */
#ifndef HAVE_DP
    if (dp) return 1;
#endif
    if (dp) dt = 1;
    if (D % 16 || D > MAXD || H % KVH || L <= 0 || Lk < L || (dt != 0 && dt != 1 && dt != 2)) return 1;
    const int64_t off = Lk - L; /* position of query 0 */
    const int esz = dt ? 2 : 4;
    /* At least 16 rows a task, and a multiple of QK_ROWS where that fits (G = 3: 8 positions,
     * 24 rows, where 5 gave 15 rows computed as 16), so no row of a score pass is padding. */
    int TQ = (16 + G - 1) / G;
    while ((G * TQ) % QK_ROWS && G * (TQ + 1) <= MAXR) TQ++;
    if (G * TQ > MAXR) TQ = MAXR / G;
    if (TQ < 1) return 1;
    const int64_t nb = (Lk + KB - 1) / KB, block_elems = (int64_t)KB * D;
    float *kt = aligned_alloc(64, (size_t)(KVH * nb * block_elems) * 4);
    float *vf = aligned_alloc(64, (size_t)(KVH * nb * block_elems) * 4);
    if (!kt || !vf) {
        free(kt);
        free(vf);
        return 2;
    }
    const int64_t tiles = (L + TQ - 1) / TQ;
    const int chunks = D / 16;
#pragma omp parallel num_threads(Lk * H * D < (1 << 15) ? 1 : num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < KVH * nb; task++) {
            const int h = (int)(task / nb);
            const int64_t b = task % nb, boff = (h * nb + b) * block_elems;
            const int64_t hoff = (int64_t)h * kv_head_stride * esz;
#ifdef HAVE_DP
            if (dp) { /* pairs of bf16: a block takes half its float32 room */
                pack_block_pairs((const uint16_t *)((const char *)k + hoff),
                                 (const uint16_t *)((const char *)v + hoff), kv_stride, Lk, D, b,
                                 (uint16_t *)(kt + boff), (uint16_t *)(vf + boff));
                continue;
            }
#endif
            pack_block((const char *)k + hoff, (const char *)v + hoff, kv_stride, Lk, D, b,
                       kt + boff, vf + boff, dt);
        }
        float acc[MAXR * MAXD], m[MAXR];
        __m512 lv[MAXR]; /* each row's running sum of probabilities, 16 lanes */
        float qf[QK_ROWS][MAXD];
        float pp[QK_ROWS + 1][KB], corr[QK_ROWS + 1], pair_scratch[MAXD];
        uint32_t qw[QK_ROWS][MAXD / 2], pw[QK_ROWS + 1][KB / 2]; /* bf16 pairs (dp) */
        /* Largest tiles (most keys) first, for balance. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KVH * tiles; task++) {
            const int h = (int)(task % KVH);
            const int64_t tile = tiles - 1 - task / KVH, p0 = tile * TQ;
            const int tq = (int)(p0 + TQ <= L ? TQ : L - p0), R = G * tq;
            const int64_t p_last = off + p0 + tq - 1; /* the tile's last key position */
            for (int r = 0; r < R; r++) {
                m[r] = -INFINITY;
                lv[r] = _mm512_setzero_ps();
            }
            memset(acc, 0, sizeof(float) * (size_t)R * D);
            int64_t b_lo = window > 0 ? (off + p0 - window + 1) / KB : 0;
            b_lo = b_lo < 0 ? 0 : b_lo;
            const int64_t b_hi = p_last / KB;
            for (int r0 = 0; r0 < R; r0 += QK_ROWS) {
                const int nr = R - r0 < QK_ROWS ? R - r0 : QK_ROWS;
                if (nr < QK_ROWS && dp)
                    memset(qw[nr], 0, sizeof(uint32_t) * (MAXD / 2) * (QK_ROWS - nr));
                else if (nr < QK_ROWS)
                    memset(qf[nr], 0, sizeof(float) * MAXD * (QK_ROWS - nr));
                for (int i = 0; i < nr; i++) { /* row r = g * tq + position offset */
                    const int r = r0 + i, g = r / tq;
                    const int64_t pos = p0 + r % tq;
                    const int64_t src = pos * q_stride + (int64_t)(h * G + g) * D;
                    if (dp) /* the bf16 values as they are; the scale goes on the scores */
                        memcpy(qw[i], (const uint16_t *)q + src, sizeof(uint16_t) * D);
                    else
                        for (int d = 0; d < D; d++) qf[i][d] = load_dt(q, src + d, dt) * scale;
                }
                for (int64_t b = b_lo; b <= b_hi; b++) {
                    const float *kb = kt + (h * nb + b) * block_elems;
                    const float *vb = vf + (h * nb + b) * block_elems;
                    __m512 s0[QK_ROWS], s1[QK_ROWS];
                    for (int i = 0; i < QK_ROWS; i++) s0[i] = s1[i] = _mm512_setzero_ps();
#ifdef HAVE_DP
                    if (dp) { /* one load: 16 keys x 2 dims; a broadcast pair serves 32 keys */
                        const uint16_t *kp = (const uint16_t *)kb;
                        for (int d2 = 0; d2 < D / 2; d2++) {
                            const __m512bh k0 = (__m512bh)_mm512_load_si512(kp + d2 * KB * 2);
                            const __m512bh k1 = (__m512bh)_mm512_load_si512(kp + d2 * KB * 2 + 32);
                            for (int i = 0; i < QK_ROWS; i++) {
                                const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qw[i][d2]);
                                s0[i] = _mm512_dpbf16_ps(s0[i], qd, k0);
                                s1[i] = _mm512_dpbf16_ps(s1[i], qd, k1);
                            }
                        }
                        const __m512 sc = _mm512_set1_ps(scale);
                        for (int i = 0; i < QK_ROWS; i++) {
                            s0[i] = _mm512_mul_ps(s0[i], sc);
                            s1[i] = _mm512_mul_ps(s1[i], sc);
                        }
                    } else
#endif
                    /* All QK_ROWS rows (the unused ones are zero): a constant trip count keeps
                     * the accumulators in registers; each query broadcast serves 32 keys. */
                    for (int d = 0; d < D; d++) {
                        const __m512 k0 = _mm512_load_ps(kb + d * KB);
                        const __m512 k1 = _mm512_load_ps(kb + d * KB + 16);
                        for (int i = 0; i < QK_ROWS; i++) {
                            const __m512 qd = _mm512_set1_ps(qf[i][d]);
                            s0[i] = _mm512_fmadd_ps(qd, k0, s0[i]);
                            s1[i] = _mm512_fmadd_ps(qd, k1, s1[i]);
                        }
                    }
                    /* Each row's visible keys, block maximum and new running maximum; then
                     * the rescale factors of all the rows in one exp16 instead of a libm call
                     * per row (which the bf16 path's short blocks felt); then the weights. */
                    float mold[QK_ROWS], mnew[QK_ROWS];
                    __mmask16 vm0[QK_ROWS], vm1[QK_ROWS];
                    __mmask16 novis = 0; /* rows with no visible key in this block */
                    for (int i = 0; i < QK_ROWS; i++) {
                        mold[i] = mnew[i] = 0.f;
                        if (i >= nr) continue;
                        const int r = r0 + i;
                        const int64_t pos = off + p0 + r % tq, j0 = b * KB;
                        /* visible keys of this row in the block: lanes [lo, hi) */
                        int64_t lo = window > 0 ? pos - window + 1 - j0 : 0;
                        int64_t hi = pos - j0 + 1;
                        lo = lo < 0 ? 0 : lo;
                        hi = hi > KB ? KB : hi;
                        if (hi <= lo) {
                            novis |= (__mmask16)(1u << i);
                            continue;
                        }
                        const uint64_t vis = (((uint64_t)1 << hi) - 1) & ~(((uint64_t)1 << lo) - 1);
                        vm0[i] = (__mmask16)(vis & 0xffff);
                        vm1[i] = (__mmask16)(vis >> 16);
                        /* one reduction for both halves: hidden lanes at -inf first */
                        const __m512 ninf = _mm512_set1_ps(-INFINITY);
                        const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(
                            _mm512_mask_mov_ps(ninf, vm0[i], s0[i]), _mm512_mask_mov_ps(ninf, vm1[i], s1[i])));
                        mold[i] = m[r];
                        mnew[i] = bmax > m[r] ? bmax : m[r];
                    }
                    /* exp(old - new); a first block's old maximum is -inf, which exp16 takes
                     * as -87 (a factor of ~1e-38 on a sum and accumulator that are still 0);
                     * rows with nothing visible keep theirs (factor 1) */
                    const __m512 cv = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(0xff, mold),
                                                          _mm512_maskz_loadu_ps(0xff, mnew)));
                    _mm512_mask_storeu_ps(corr, 0xff, _mm512_mask_blend_ps(novis, cv, _mm512_set1_ps(1.f)));
                    for (int i = 0; i < nr; i++) {
                        const int r = r0 + i;
                        if (novis >> i & 1) { /* no visible key: a no-op update */
                            if (dp)
                                memset(pw[i], 0, sizeof(pw[i]));
                            else
                                memset(pp[i], 0, sizeof(pp[i]));
                            continue;
                        }
                        const __m512 mxv = _mm512_set1_ps(mnew[i]);
                        __m512 pr0 = _mm512_maskz_mov_ps(vm0[i], exp16(_mm512_sub_ps(s0[i], mxv)));
                        __m512 pr1 = _mm512_maskz_mov_ps(vm1[i], exp16(_mm512_sub_ps(s1[i], mxv)));
#ifdef HAVE_DP
                        if (dp) { /* rounded to bf16 (nearest even, one instruction) for the
                                   * value product; l sums the same */
                            const __m256bh b0 = _mm512_cvtneps_pbh(pr0), b1 = _mm512_cvtneps_pbh(pr1);
                            _mm256_storeu_si256((__m256i *)pw[i], (__m256i)b0);
                            _mm256_storeu_si256((__m256i *)(pw[i] + 8), (__m256i)b1);
                            pr0 = _mm512_cvtpbh_ps(b0);
                            pr1 = _mm512_cvtpbh_ps(b1);
                        }
#endif
                        /* the row's sum stays a vector until the tile ends */
                        lv[r] = _mm512_fmadd_ps(lv[r], _mm512_set1_ps(corr[i]), _mm512_add_ps(pr0, pr1));
                        m[r] = mnew[i];
                        if (!dp) { /* the dot-product path stored its bf16 pairs above */
                            _mm512_storeu_ps(pp[i], pr0);
                            _mm512_storeu_ps(pp[i] + 16, pr1);
                        }
                    }
                    for (int i = 0; i < nr; i += 2) { /* an odd last row pairs with itself */
                        const int j = i + 1 < nr ? i + 1 : i;
                        if (j == i) {
                            if (dp)
                                memset(pw[QK_ROWS], 0, sizeof(pw[0]));
                            else
                                memset(pp[QK_ROWS], 0, sizeof(pp[0]));
                            corr[QK_ROWS] = 1.f;
                        }
                        float *aa = acc + (int64_t)(r0 + i) * D;
                        float *ab = j == i ? pair_scratch : acc + (int64_t)(r0 + j) * D;
                        const int jj = j == i ? QK_ROWS : j;
#ifdef HAVE_DP
                        if (dp) {
                            pv_rows_dp(aa, ab, pw[i], pw[jj], corr[i], corr[jj],
                                       (const uint16_t *)vb, D);
                            continue;
                        }
#endif
                        pv_rows(aa, ab, pp[i], pp[jj], corr[i], corr[jj], vb, D);
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const int g = r / tq;
                const int64_t pos = p0 + r % tq;
                const int64_t dst = (pos * H + h * G + g) * (int64_t)D;
                const float l = _mm512_reduce_add_ps(lv[r]);
                const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
                for (int c = 0; c < chunks; c++) {
                    const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)r * D + 16 * c), inv);
                    if (dt)
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + dst + 16 * c), to_bf16(o));
                    else
                        _mm512_storeu_ps((float *)out + dst + 16 * c, o);
                }
            }
        }
    }
    free(kt);
    free(vf);
    return 0;
}

#else

int kvserve_prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                              int64_t kv_stride, int64_t kv_head_stride, void *out, int64_t L,
                              int64_t Lk, int H, int KVH, int D, float scale, int window, int dt,
                              int num_threads) {
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)kv_head_stride, (void)out;
    (void)L, (void)Lk, (void)H;
    (void)KVH, (void)D, (void)scale, (void)window, (void)dt, (void)num_threads;
    return 1; /* no AVX-512 on the build machine: SDPA serves */
}

#endif
