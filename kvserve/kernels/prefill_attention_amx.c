#define _GNU_SOURCE
/* Causal attention of a bfloat16 prefill chunk on AMX tiles: over its own fresh K/V (a chunk
 * that starts its sequence) or over the whole sequence so far (a chunk that continues one).
 *
 * Where the CPU has AMX (Sapphire Rapids and later), both matrix products of flash attention
 * run as bf16 tile products with float32 accumulation, the way a GPU flash kernel uses its
 * tensor cores: S = Q K^T for 16 queries x 32 keys per step, then P V with P rounded to bf16
 * (as PyTorch's own CPU flash kernel rounds it). The online softmax between them runs in
 * float32 on AVX-512. The FMA kernel of prefill_attention.c reaches a fraction of this on
 * such a CPU.
 *
 * Layout: q [L, H, D] (rows q_stride elements apart), out [L, H, D] contiguous; k/v hold Lk
 * >= L keys, element (t, h, d) at t * kv_stride + h * kv_hstride + d; query i is at position
 * Lk - L + i and sees keys j with pos - window < j <= pos (window 0 = unbounded). K and V of
 * each KV head are first repacked into the tile layouts the products read (VNNI pairs: the two
 * bf16 values a tile row multiplies together are adjacent):
 *   kp[kvh][b16][dc][r][j][2]: K[16 b16 + j][32 dc + 2 r + {0,1}]  (B tile of K^T, 16 keys)
 *   vp[kvh][b32][n][r][c][2]:  V[32 b32 + 2 r + {0,1}][16 n + c]    (B tile of V, 16 dims)
 * Keys past Lk are zero and masked. A task is one query head and 16 (head size 64) or 32
 * query positions.
 *
 * Returns 1 (nothing written) where it does not apply: no AMX on the build machine, the OS
 * refuses the tile state, not bf16, a head size that is not a multiple of 32 up to 128.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define KVSERVE_AMX_TILES
#include "kvserve_kernels.h"

#define MAXD 128

/* exp(x) for x <= 88 on 16 lanes, relative error ~3e-6: the probabilities are rounded to bf16
 * (2^-9) for P V and their float32 sum divides the output, so exp16's degree-6 polynomial
 * (2e-7) bought nothing here but two more FMAs per 16 scores, the softmax being most of the
 * kernel's vector work. 2^n * 2^f, n = round(x log2 e), 2^f by its degree-5 Taylor series on
 * |f| <= 1/2. */
static inline __m512 exp16_bf16(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fmsub_ps(x, log2e, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#define QB 32 /* queries per task: two A tiles of rows */
#define KB 32 /* keys per step: one A tile of P (32 bf16 per row) */
#define QB16 16 /* queries per task at head size 64 */


static void pack_kv(const uint16_t *k, const uint16_t *v, int64_t kv_stride, int64_t L, int D,
                    int64_t b32, uint16_t *kp, uint16_t *vp) {
    const int ndc = D / 32, nn = D / 16;
    for (int half = 0; half < 2; half++) { /* the two 16-key B tiles of K^T */
        for (int dc = 0; dc < ndc; dc++) {
            uint32_t *tile = (uint32_t *)(kp + ((int64_t)(2 * b32 + half) * ndc + dc) * 512);
            for (int j = 0; j < 16; j++) {
                const int64_t t = b32 * KB + half * 16 + j;
                uint32_t row[16] = {0}; /* the 16 value pairs of one key */
                if (t < L) memcpy(row, k + t * kv_stride + dc * 32, 64);
                for (int r = 0; r < 16; r++) tile[r * 16 + j] = row[r];
            }
        }
    }
    for (int n = 0; n < nn; n++) {
        uint16_t *tile = vp + (b32 * nn + n) * 512;
        for (int r = 0; r < 16; r++) {
            const int64_t t0 = b32 * KB + 2 * r, t1 = t0 + 1;
            for (int c = 0; c < 16; c++) {
                tile[r * 32 + 2 * c] = t0 < L ? v[t0 * kv_stride + n * 16 + c] : 0;
                tile[r * 32 + 2 * c + 1] = t1 < L ? v[t1 * kv_stride + n * 16 + c] : 0;
            }
        }
    }
}

/* One row's online-softmax step over a 32-key block: scores s0|s1 (keys 0-15, 16-31), the
 * visible lanes vis; writes the row's bf16 probabilities (zero where not visible) and returns
 * the factor its accumulator must be multiplied by. */
static inline __attribute__((always_inline)) float softmax_row(const float *srow, uint16_t *prow,
                                                               uint32_t vis, float scale,
                                                               float *m, float *l) {
    const __mmask16 v0 = (__mmask16)(vis & 0xffff), v1 = (__mmask16)(vis >> 16);
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 s0 = _mm512_mul_ps(_mm512_load_ps(srow), sc);
    const __m512 s1 = _mm512_mul_ps(_mm512_load_ps(srow + 16), sc);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 mx2 = _mm512_max_ps(_mm512_mask_mov_ps(ninf, v0, s0), _mm512_mask_mov_ps(ninf, v1, s1));
    const float bmax = _mm512_reduce_max_ps(mx2);
    const float mx = bmax > *m ? bmax : *m;
    const float corr = mx == *m ? 1.f : expf(*m - mx);
    const __m512 mxv = _mm512_set1_ps(mx);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, exp16_bf16(_mm512_sub_ps(s0, mxv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, exp16_bf16(_mm512_sub_ps(s1, mxv)));
    *l = *l * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    *m = mx;
    _mm512_store_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return corr;
}

/* Head size 64: the output of 16 queries (16 x 64 float32) lives in four accumulator tiles
 * for the whole task, so P V accumulates across key blocks without leaving the tiles. That
 * needs a softmax whose reference maximum rarely moves: a row's probabilities are taken
 * against the largest score it has seen only when a block beats that by more than LAZY_MAX
 * (natural-log units); otherwise against the old one, so p <= e^LAZY_MAX, harmless in float32
 * sums and bf16 products. Only a block that moves some row's reference writes the tiles out
 * and rescales them. (FlashAttention-3 rescales lazily for the same reason.) */
#define LAZY_MAX 8.f

/* S = Q K^T of key block b into sbuf (16 x 32 float32), on tiles 4-7. */
static inline __attribute__((always_inline)) void scores_d64(const uint16_t *qbuf,
                                                             const uint16_t *kph, int64_t b,
                                                             float *sbuf) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(6, qbuf, 128);
    _tile_loadd(7, kph + (2 * b) * 2 * 512, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, kph + (2 * b + 1) * 2 * 512, 64);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(6, qbuf + 32, 128);
    _tile_loadd(7, kph + ((2 * b) * 2 + 1) * 512, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, kph + ((2 * b + 1) * 2 + 1) * 512, 64);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(4, sbuf, KB * 4);
    _tile_stored(5, sbuf + 16, KB * 4);
}

/* O (tiles 0-3) += P V for key block b, P in pbuf (16 x 32 bf16). */
static inline __attribute__((always_inline)) void values_d64(const uint16_t *pbuf,
                                                             const uint16_t *vph, int64_t b) {
    _tile_loadd(4, pbuf, KB * 2);
    _tile_loadd(5, vph + (b * 4 + 0) * 512, 64);
    _tile_loadd(6, vph + (b * 4 + 1) * 512, 64);
    _tile_loadd(7, vph + (b * 4 + 2) * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vph + (b * 4 + 3) * 512, 64);
    _tile_dpbf16ps(3, 4, 5);
}

/* The whole task for head size 64, as a three-stage pipeline over key blocks: the scores of
 * block b + 1, the softmax of block b and the value product of block b - 1 in one iteration.
 * Data goes between the tiles and the vector registers through memory, and a load right
 * after the other unit's store waits for it to land; the pipeline lets an iteration pass in
 * between. */
static void attend_d64(const uint16_t *qbuf, const uint16_t *kph, const uint16_t *vph,
                       int64_t p0, int nq, int window, float scale, uint16_t *dst,
                       int64_t dst_stride) {
    enum { D = 64 };
    uint16_t pbuf[2][QB16 * KB] __attribute__((aligned(64)));
    float sbuf[2][QB16 * KB] __attribute__((aligned(64)));
    float obuf[QB16 * D] __attribute__((aligned(64)));
    /* Each row's running sum stays a vector of 16 partial sums (reduced once, at the end). */
    float lv[QB16 * 16] __attribute__((aligned(64)));
    float m[QB16];
    for (int i = 0; i < QB16; i++) m[i] = -INFINITY;
    memset(lv, 0, sizeof(lv));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t p_last = p0 + nq - 1, b_hi = p_last / KB;
    int64_t b_lo = window > 0 ? (p0 - window + 1) / KB : 0;
    b_lo = b_lo < 0 ? 0 : b_lo;
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    scores_d64(qbuf, kph, b_lo, sbuf[b_lo & 1]);
    for (int64_t b = b_lo; b <= b_hi; b++) {
        if (b < b_hi) scores_d64(qbuf, kph, b + 1, sbuf[(b + 1) & 1]);
        const float *sb = sbuf[b & 1];
        uint16_t *pb = pbuf[b & 1];
        const int64_t j0 = b * KB;
        const int full = j0 + KB - 1 <= p0 && (window <= 0 || j0 > p_last - window);
        float corr[QB16];
        int rescale = 0;
        for (int i = 0; i < QB16; i++) {
            uint32_t vis = 0xffffffffu;
            corr[i] = 1.f;
            if (!full) {
                const int64_t pos = p0 + i;
                int64_t lo = window > 0 ? pos - window + 1 - j0 : 0, hi = pos - j0 + 1;
                lo = lo < 0 ? 0 : lo;
                hi = hi > KB ? KB : hi;
                vis = i >= nq || hi <= lo ? 0
                      : (uint32_t)((((uint64_t)1 << hi) - 1) & ~(((uint64_t)1 << lo) - 1));
            }
            if (!vis) {
                _mm512_store_si512(pb + i * KB, _mm512_setzero_si512());
                continue;
            }
            const __mmask16 v0 = (__mmask16)(vis & 0xffff), v1 = (__mmask16)(vis >> 16);
            const __m512 s0 = _mm512_mul_ps(_mm512_load_ps(sb + i * KB), sc);
            const __m512 s1 = _mm512_mul_ps(_mm512_load_ps(sb + i * KB + 16), sc);
            const __m512 lim = _mm512_set1_ps(m[i] + LAZY_MAX);
            if (_mm512_mask_cmp_ps_mask(v0, s0, lim, _CMP_GT_OQ) |
                _mm512_mask_cmp_ps_mask(v1, s1, lim, _CMP_GT_OQ)) {
                /* the reference moves (always on a row's first keys) */
                const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(
                    _mm512_mask_mov_ps(ninf, v0, s0), _mm512_mask_mov_ps(ninf, v1, s1)));
                if (m[i] > -INFINITY) {
                    corr[i] = expf(m[i] - bmax);
                    _mm512_store_ps(lv + i * 16, _mm512_mul_ps(_mm512_load_ps(lv + i * 16),
                                                               _mm512_set1_ps(corr[i])));
                    rescale = 1;
                }
                m[i] = bmax;
            }
            const __m512 mv = _mm512_set1_ps(m[i]);
            const __m512 p0v = _mm512_maskz_mov_ps(v0, exp16_bf16(_mm512_sub_ps(s0, mv)));
            const __m512 p1v = _mm512_maskz_mov_ps(v1, exp16_bf16(_mm512_sub_ps(s1, mv)));
            _mm512_store_ps(lv + i * 16, _mm512_add_ps(_mm512_load_ps(lv + i * 16),
                                                       _mm512_add_ps(p0v, p1v)));
            _mm512_store_si512(pb + i * KB, (__m512i)_mm512_cvtne2ps_pbh(p1v, p0v));
        }
        if (b > b_lo) values_d64(pbuf[(b - 1) & 1], vph, b - 1);
        if (rescale) { /* O holds blocks up to b - 1: scale it before block b joins */
            _tile_stored(0, obuf, D * 4);
            _tile_stored(1, obuf + 16, D * 4);
            _tile_stored(2, obuf + 32, D * 4);
            _tile_stored(3, obuf + 48, D * 4);
            for (int i = 0; i < QB16; i++) {
                if (corr[i] == 1.f) continue;
                const __m512 c = _mm512_set1_ps(corr[i]);
                for (int n = 0; n < 4; n++)
                    _mm512_store_ps(obuf + i * D + 16 * n, _mm512_mul_ps(_mm512_load_ps(obuf + i * D + 16 * n), c));
            }
            _tile_loadd(0, obuf, D * 4);
            _tile_loadd(1, obuf + 16, D * 4);
            _tile_loadd(2, obuf + 32, D * 4);
            _tile_loadd(3, obuf + 48, D * 4);
        }
    }
    values_d64(pbuf[b_hi & 1], vph, b_hi);
    _tile_stored(0, obuf, D * 4);
    _tile_stored(1, obuf + 16, D * 4);
    _tile_stored(2, obuf + 32, D * 4);
    _tile_stored(3, obuf + 48, D * 4);
    for (int i = 0; i < nq; i++) {
        const float l = _mm512_reduce_add_ps(_mm512_load_ps(lv + i * 16));
        const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
        for (int n = 0; n < 4; n++)
            _mm256_storeu_si256((__m256i *)(dst + i * dst_stride + 16 * n),
                                to_bf16(_mm512_mul_ps(_mm512_load_ps(obuf + i * D + 16 * n), inv)));
    }
}

int kvserve_prefill_attention_amx(const void *q, int64_t q_stride, const void *k, const void *v,
                                  int64_t kv_stride, int64_t kv_hstride, void *out, int64_t L,
                                  int64_t Lk, int H, int KVH, int D, float scale, int window, int dt,
                                  int num_threads) {
    if (dt != 1 || D % 32 || D > MAXD || H % KVH || L <= 0 || Lk < L || !amx_permitted()) return 1;
    const int G = H / KVH, ndc = D / 32, nn = D / 16;
    const int64_t ctx = Lk - L; /* query i is at position ctx + i */
    const int64_t nb32 = (Lk + KB - 1) / KB, nqb = (L + QB - 1) / QB;
    const int64_t kp_head = nb32 * 2 * ndc * 512, vp_head = nb32 * nn * 512; /* bf16 elements */
    uint16_t *kp = aligned_alloc(64, (size_t)(KVH * kp_head) * 2);
    uint16_t *vp = aligned_alloc(64, (size_t)(KVH * vp_head) * 2);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return 2;
    }
    const uint16_t *q16 = q, *k16 = k, *v16 = v;
    uint16_t *o16 = out;
#pragma omp parallel num_threads(L * Lk * H * D < (1 << 22) ? 1 : num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < KVH * nb32; task++) {
            const int h = (int)(task / nb32);
            pack_kv(k16 + h * kv_hstride, v16 + h * kv_hstride, kv_stride, Lk, D, task % nb32,
                    kp + h * kp_head, vp + h * vp_head);
        }
        tile_config cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        uint16_t qbuf[QB * MAXD] __attribute__((aligned(64)));
        uint16_t pbuf[QB * KB] __attribute__((aligned(64)));
        float sbuf[QB * KB] __attribute__((aligned(64)));
        float pvbuf[QB * MAXD] __attribute__((aligned(64)));
        float acc[QB * MAXD] __attribute__((aligned(64)));
        float m[QB], l[QB], corr[QB];
        if (D == 64) {
            const int64_t nqb16 = (L + QB16 - 1) / QB16;
            /* Last query blocks (most keys) first, for balance. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < H * nqb16; task++) {
                const int hq = (int)(task % H), hk = hq / G;
                const int64_t p0 = (nqb16 - 1 - task / H) * QB16;
                const int nq = (int)(p0 + QB16 <= L ? QB16 : L - p0);
                for (int i = 0; i < QB16; i++) {
                    if (i < nq)
                        memcpy(qbuf + i * D, q16 + (p0 + i) * q_stride + (int64_t)hq * D, (size_t)D * 2);
                    else
                        memset(qbuf + i * D, 0, (size_t)D * 2);
                }
                attend_d64(qbuf, kp + hk * kp_head, vp + hk * vp_head, ctx + p0, nq, window, scale,
                           o16 + (p0 * H + hq) * (int64_t)D, (int64_t)H * D);
            }
        } else {
        /* Last query blocks (most keys) first, for balance. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < H * nqb; task++) {
            const int hq = (int)(task % H), hk = hq / G;
            const int64_t p0 = (nqb - 1 - task / H) * QB;
            const int nq = (int)(p0 + QB <= L ? QB : L - p0);
            for (int i = 0; i < QB; i++) {
                m[i] = -INFINITY;
                l[i] = 0.f;
                if (i < nq)
                    memcpy(qbuf + i * D, q16 + (p0 + i) * q_stride + (int64_t)hq * D, (size_t)D * 2);
                else
                    memset(qbuf + i * D, 0, (size_t)D * 2);
            }
            memset(acc, 0, sizeof(float) * QB * D);
            const int64_t pp0 = ctx + p0, p_last = pp0 + nq - 1; /* positions */
            int64_t b_lo = window > 0 ? (pp0 - window + 1) / KB : 0;
            b_lo = b_lo < 0 ? 0 : b_lo;
            const uint16_t *kph = kp + hk * kp_head, *vph = vp + hk * vp_head;
            for (int64_t b = b_lo; b <= p_last / KB; b++) {
                const int64_t j0 = b * KB;
                /* S = Q K^T: rows 0-15 and 16-31 of Q against keys 0-15 and 16-31, four
                 * independent accumulators (a tile product's latency is several times its
                 * issue interval). */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int dc = 0; dc < ndc; dc++) {
                    _tile_loadd(4, qbuf + dc * 32, D * 2);
                    _tile_loadd(5, qbuf + 16 * D + dc * 32, D * 2);
                    _tile_loadd(6, kph + ((2 * b) * ndc + dc) * 512, 64);
                    _tile_loadd(7, kph + ((2 * b + 1) * ndc + dc) * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, sbuf, KB * 4);
                _tile_stored(1, sbuf + 16, KB * 4);
                _tile_stored(2, sbuf + 16 * KB, KB * 4);
                _tile_stored(3, sbuf + 16 * KB + 16, KB * 4);
                /* Blocks wholly below the diagonal and inside the window need no mask. */
                const int full = j0 + KB - 1 <= pp0 && (window <= 0 || j0 > p_last - window);
                for (int i = 0; i < QB; i++) {
                    uint32_t vis = 0xffffffffu;
                    if (!full) {
                        const int64_t pos = pp0 + i;
                        int64_t lo = window > 0 ? pos - window + 1 - j0 : 0, hi = pos - j0 + 1;
                        lo = lo < 0 ? 0 : lo;
                        hi = hi > KB ? KB : hi;
                        vis = i >= nq || hi <= lo ? 0
                              : (uint32_t)((((uint64_t)1 << hi) - 1) & ~(((uint64_t)1 << lo) - 1));
                    }
                    if (!vis) { /* no visible key here: a no-op update */
                        _mm512_store_si512(pbuf + i * KB, _mm512_setzero_si512());
                        corr[i] = 1.f;
                        continue;
                    }
                    corr[i] = softmax_row(sbuf + i * KB, pbuf + i * KB, vis, scale, &m[i], &l[i]);
                }
                /* PV: P (16 x 32 keys, bf16) by V's dim blocks, four at a time. */
                _tile_loadd(4, pbuf, KB * 2);
                _tile_loadd(5, pbuf + 16 * KB, KB * 2);
                for (int n = 0; n < nn; n += 2) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    _tile_loadd(6, vph + (b * nn + n) * 512, 64);
                    _tile_loadd(7, vph + (b * nn + n + 1) * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                    _tile_stored(0, pvbuf + n * 16, D * 4);
                    _tile_stored(1, pvbuf + (n + 1) * 16, D * 4);
                    _tile_stored(2, pvbuf + 16 * D + n * 16, D * 4);
                    _tile_stored(3, pvbuf + 16 * D + (n + 1) * 16, D * 4);
                }
                for (int i = 0; i < nq; i++) {
                    const __m512 c = _mm512_set1_ps(corr[i]);
                    for (int n = 0; n < nn; n++) {
                        float *a = acc + i * D + 16 * n;
                        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), c,
                                                           _mm512_load_ps(pvbuf + i * D + 16 * n)));
                    }
                }
            }
            for (int i = 0; i < nq; i++) {
                const __m512 inv = _mm512_set1_ps(l[i] > 0.f ? 1.f / l[i] : 0.f);
                uint16_t *dst = o16 + ((p0 + i) * H + hq) * (int64_t)D;
                for (int n = 0; n < nn; n++)
                    _mm256_storeu_si256((__m256i *)(dst + 16 * n),
                                        to_bf16(_mm512_mul_ps(_mm512_load_ps(acc + i * D + 16 * n), inv)));
            }
        }
        }
        _tile_release();
    }
    free(kp);
    free(vp);
    return 0;
}

#else

int kvserve_prefill_attention_amx(const void *q, int64_t q_stride, const void *k, const void *v,
                                  int64_t kv_stride, int64_t kv_hstride, void *out, int64_t L,
                                  int64_t Lk, int H, int KVH, int D, float scale, int window, int dt,
                                  int num_threads) {
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)kv_hstride, (void)out;
    (void)L, (void)Lk, (void)H;
    (void)KVH, (void)D, (void)scale, (void)window, (void)dt, (void)num_threads;
    return 1; /* no AMX on the build machine: the FMA kernel or SDPA serves */
}

#endif
