/* Attention straight from the paged KV cache, one pass over each block.
 *
 * The plain-PyTorch path (the torch attention backend, kvserve/attention/torch_backend.py)
 * first gathers every sequence's blocks into a padded batch and then runs SDPA: K and V are read, written and read again, and the
 * padding is read too. This kernel reads each cached K/V row once, in place, with an online
 * softmax (running max and sum per query row), so decode attention runs close to the memory
 * bandwidth. It serves decode tokens (one query per sequence) and short chunks that continue
 * a cached context (a prefix-cache hit, a forked sample, a question after a cached document);
 * long prefill chunks are better served by SDPA's blocked matrix products.
 *
 * Work is split over (sequence, KV head, tile of up to QT queries) with OpenMP. The G query
 * heads of a GQA group share every K/V row they read, and one KV head's rows of a block are
 * contiguous (head-major blocks), so each task streams runs of block_size * D values.
 *
 * Layout: q/out [T, H, D] float32 (the flat batch); per sequence b its queries are rows
 * q_start[b] .. q_start[b] + q_len[b] - 1 at positions ctx_len[b] + i; k/v cache
 * [num_blocks, KVH, block_size, D] in float32, bfloat16 or float16; block_tables [B, stride]
 * int64. Query at cache index p sees keys p - w < pos <= p, where w is the smaller non-zero of
 * `window` (the layer's) and seq_windows[b] (the sequence's retention window; NULL: none);
 * 0 = unbounded.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QT 16

#include "kvserve_kernels.h"

/* n contiguous rows of D values starting at row `idx`, as float32 (converted into tmp). */
static inline const float *load_rows(const void *base, int64_t idx, int n, int D, int dt,
                                     float *tmp) {
    if (dt == DT_F32) return (const float *)base + idx * D;
    const uint16_t *p = (const uint16_t *)base + idx * D;
    if (dt == DT_BF16) {
        for (int j = 0; j < n * D; j++) tmp[j] = bf16_to_f32(p[j]);
    } else {
        for (int j = 0; j < n * D; j++) tmp[j] = f16_to_f32(p[j]);
    }
    return tmp;
}

/* The keys [*vlo, *vhi) of a block's [lo, hi) that a query at cache index qpos sees (causal,
 * and inside the sliding window; window 0 = unbounded); t0 is the block's first index. */
static inline __attribute__((always_inline)) void visible_keys(const int lo, const int hi,
                                                               const int64_t qpos,
                                                               const int64_t t0,
                                                               const int window, int *vlo,
                                                               int *vhi) {
    int64_t a = window > 0 ? qpos - window + 1 - t0 : lo;
    a = a < lo ? lo : (a > hi ? hi : a);
    int64_t z = qpos - t0 + 1;
    z = z > hi ? hi : (z < a ? a : z);
    *vlo = (int)a;
    *vhi = (int)z;
}

/* Online-softmax step for one query row over one block: the keys it may see are
 * [vlo, vhi) (causal, and inside the sliding window); their scores in sr become exp weights
 * relative to the new running max *m; *l is rescaled and accumulated. Returns the factor the
 * row's output accumulator must be multiplied by (exp(old max - new max)). */
static inline __attribute__((always_inline)) float softmax_update(
    float *restrict sr, const int lo, const int hi, const int64_t qpos, const int64_t t0,
    const int window, float *m, float *l, int *vlo_out, int *vhi_out) {
    visible_keys(lo, hi, qpos, t0, window, vlo_out, vhi_out);
    const int vlo = *vlo_out, vhi = *vhi_out;
    if (vhi <= vlo) return 1.f;
    float mx = *m;
    for (int t = vlo; t < vhi; t++) mx = sr[t] > mx ? sr[t] : mx;
    const float corr = expf(*m - mx);
    float sum = 0.f;
    for (int t = vlo; t < vhi; t++) { sr[t] = expf(sr[t] - mx); sum += sr[t]; }
    *m = mx;
    *l = *l * corr + sum;
    return corr;
}

/* One block of keys for the R query rows of a task: scores, online-softmax update, and the
 * weighted sum of values into acc. Inlined with a constant D at each call site, so the
 * compiler keeps rows in registers. (Measured: spanning several blocks per update was
 * slower.) */
static inline __attribute__((always_inline)) void attend_block(
    const float *restrict qs, const float *restrict kb, const float *restrict vb,
    float *restrict s, float *restrict acc, float *restrict m, float *restrict l,
    const int64_t *restrict qpos, const int R, const int D, const int bs, const int lo,
    const int hi, const int64_t t0, const int window) {
    for (int r = 0; r < R; r++) {
        const float *restrict qr = qs + r * D;
        float *restrict sr = s + r * bs;
        for (int t = lo; t < hi; t++) {
            const float *restrict kr = kb + t * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
            sr[t] = dot;
        }
    }
    for (int r = 0; r < R; r++) {
        float *restrict sr = s + r * bs;
        int vlo, vhi;
        const float corr = softmax_update(sr, lo, hi, qpos[r], t0, window, &m[r], &l[r], &vlo, &vhi);
        if (vhi <= vlo) continue;
        float *restrict ar = acc + r * D;
        for (int d = 0; d < D; d++) ar[d] *= corr;
        for (int t = vlo; t < vhi; t++) {
            const float p = sr[t];
            const float *restrict vr = vb + t * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ar[d] += p * vr[d];
        }
    }
}

#if defined(__AVX512F__)

/* acc[g] = acc[g] * corr[g] + sum_t p[g][t] v[t] for NR rows (a constant), keys [lo, hi);
 * each row's weights outside its own range are zero. Each cached value row is read and
 * converted once for the NR rows (the G query heads of a GQA group share every row): a pass
 * per row read it G times, and on a float32 cache that pass was most of the kernel's work. */
static inline __attribute__((always_inline)) void values_rows(
    const void *restrict vraw, const int dt, const float *restrict s, float *restrict acc,
    const float *restrict corr, const int NR, const int D, const int bs, const int lo,
    const int hi, const char *pf) {
    enum { MAXV = 8 };
    const int nv = D / 16;
    const int rb = D * (dt == DT_F32 ? 4 : 2); /* bytes of one cached row */
    __m512 o[4][MAXV];
    for (int g = 0; g < NR; g++) {
        const __m512 c = _mm512_set1_ps(corr[g]);
        for (int j = 0; j < nv; j++) o[g][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * j), c);
    }
    for (int t = lo; t < hi; t++) {
        __m512 v[MAXV];
        if (pf)
            for (int b = 0; b < rb; b += 64) _mm_prefetch(pf + (int64_t)t * rb + b, _MM_HINT_T1);
        for (int j = 0; j < nv; j++) v[j] = load16(vraw, (int64_t)t * D + 16 * j, dt);
        for (int g = 0; g < NR; g++) {
            const __m512 p = _mm512_set1_ps(s[g * bs + t]);
            for (int j = 0; j < nv; j++) o[g][j] = _mm512_fmadd_ps(p, v[j], o[g][j]);
        }
    }
    for (int g = 0; g < NR; g++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(acc + g * D + 16 * j, o[g][j]);
}

#if defined(__AVX512BF16__)
/* values_rows for a bf16 cache on bf16 dot products: the weights (already rounded to bf16 by
 * softmax_update16) go in pairs of keys, and each two cached value rows are interleaved in
 * registers (one permute per 16 dims) into the [dim][key pair] layout `vdpbf16ps` takes, so a
 * row's 64 dims cost 2 dot products per key where the float32 pass took 4 FMAs (and 4
 * conversions per key, shared by the rows); the rounding of the weights is the one SDPA's
 * bf16 path and the prefill kernel's dot-product path make. pf: a run of pfn lines to fetch
 * into L2, two per key pair (see attend_block_bf16). */
static inline __attribute__((always_inline)) void values_rows_dp(
    const uint16_t *restrict vraw, const float *restrict s, float *restrict acc,
    const float *restrict corr, const int NR, const int D, const int bs, const int lo,
    const int hi, const char *pf, const int pfn) {
    enum { MAXV = 8, MAXB = 256 };
    const int nv = D / 16;
    __m512 o[4][MAXV];
    uint16_t pw[4][MAXB + 2]; /* each row's weights from lo, and a zero after the last */
    for (int g = 0; g < NR; g++) {
        const __m512 c = _mm512_set1_ps(corr[g]);
        for (int j = 0; j < nv; j++) o[g][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * j), c);
        for (int t = lo; t < hi; t += 16) {
            const __mmask16 k = hi - t >= 16 ? 0xffff : (__mmask16)((1u << (hi - t)) - 1);
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, s + g * bs + t));
            _mm256_mask_storeu_epi16(pw[g] + (t - lo), k, (__m256i)b);
        }
        pw[g][hi - lo] = 0;
    }
    /* output lanes 2i and 2i + 1 take dim i of rows t and t + 1 (as the prefill kernel's vp) */
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int t = lo; t < hi; t += 2) {
        __m512bh v[MAXV];
        if (t - lo < pfn) _mm_prefetch(pf + (int64_t)(t - lo) * 64, _MM_HINT_T1);
        if (t - lo + 1 < pfn) _mm_prefetch(pf + (int64_t)(t - lo + 1) * 64, _MM_HINT_T1);
        const uint16_t *r = vraw + (int64_t)t * D;
        for (int j = 0; j < D / 32; j++) {
            const __m512i a = _mm512_loadu_si512(r + 32 * j);
            const __m512i c = t + 1 < hi ? _mm512_loadu_si512(r + D + 32 * j) : _mm512_setzero_si512();
            v[2 * j] = (__m512bh)_mm512_permutex2var_epi16(a, ilo, c);
            v[2 * j + 1] = (__m512bh)_mm512_permutex2var_epi16(a, ihi, c);
        }
        for (int g = 0; g < NR; g++) {
            uint32_t pr;
            memcpy(&pr, pw[g] + (t - lo), 4);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pr);
            for (int j = 0; j < nv; j++) o[g][j] = _mm512_dpbf16_ps(o[g][j], pp, v[j]);
        }
    }
    for (int k = hi - lo + ((hi - lo) & 1); k < pfn; k++) _mm_prefetch(pf + (int64_t)k * 64, _MM_HINT_T1);
    for (int g = 0; g < NR; g++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(acc + g * D + 16 * j, o[g][j]);
}
#endif

/* softmax_update on 16 lanes at a time, with exp16 in place of glibc's expf: every score of
 * [lo, hi) is written, the hidden ones as 0, so the values pass can read the whole range.
 * (The scalar loops, a libm call per 16 scores and the remainder one by one, were a
 * measurable part of the bf16 path, whose dot products take a few instructions per key.) */
static inline __attribute__((always_inline)) float softmax_update16(
    float *restrict sr, const int lo, const int hi, const int64_t qpos, const int64_t t0,
    const int window, float *m, float *l, int *vlo_out, int *vhi_out, const int round_bf16) {
    (void)round_bf16;
    visible_keys(lo, hi, qpos, t0, window, vlo_out, vhi_out);
    const int vlo = *vlo_out, vhi = *vhi_out;
    /* lanes of the chunk at t: those in [lo, hi) (written) and those in [vlo, vhi) (seen) */
#define LANES(from, to, t) ((__mmask16)(((to) <= (t) ? 0u : (to) >= (t) + 16 ? 0xffffu : (1u << ((to) - (t))) - 1u) \
                                      & ~((from) <= (t) ? 0u : (from) >= (t) + 16 ? 0xffffu : (1u << ((from) - (t))) - 1u)))
    if (vhi <= vlo) {
        for (int t = lo; t < hi; t += 16) _mm512_mask_storeu_ps(sr + t, LANES(lo, hi, t), _mm512_setzero_ps());
        return 1.f;
    }
    __m512 mxv = _mm512_set1_ps(*m);
    for (int t = vlo; t < vhi; t += 16) {
        const __mmask16 k = LANES(vlo, vhi, t);
        mxv = _mm512_mask_max_ps(mxv, k, mxv, _mm512_maskz_loadu_ps(k, sr + t));
    }
    const float mx = _mm512_reduce_max_ps(mxv);
    const float corr = expf(*m - mx);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int t = lo; t < hi; t += 16) {
        const __mmask16 w = LANES(lo, hi, t);
        __m512 p = _mm512_maskz_mov_ps(LANES(vlo, vhi, t), exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(w, sr + t), mv)));
#if defined(__AVX512BF16__)
        if (round_bf16) p = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(p)); /* l sums what the values get */
#endif
        _mm512_mask_storeu_ps(sr + t, w, p);
        sum = _mm512_add_ps(sum, p);
    }
#undef LANES
    *m = mx;
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    return corr;
}

/* The online-softmax update of a block for the R rows of a task (their scores in s), then
 * the values pass, RG rows at a time. vpf: for the float32 pass, the next block's value rows;
 * for the dot-product pass (dp), a run of pfn lines (see attend_block_bf16). */
static inline __attribute__((always_inline)) void softmax_values(
    const void *vraw, const int dt, float *restrict s, float *restrict acc, float *restrict m,
    float *restrict l, const int64_t *restrict qpos, const int R, const int D, const int bs,
    const int lo, const int hi, const int64_t t0, const int window, const char *vpf,
    const int dp, const int pfn) {
    const int RG = D <= 64 ? 4 : 2; /* rows whose accumulators fit in registers together */
    for (int r0 = 0; r0 < R; r0 += RG) {
        const int nr = R - r0 < RG ? R - r0 : RG;
        float corr[4];
        int ulo = hi, uhi = lo;
        for (int g = 0; g < nr; g++) {
            const int r = r0 + g;
            float *restrict sr = s + r * bs;
            int vlo, vhi;
            corr[g] = softmax_update16(sr, lo, hi, qpos[r], t0, window, &m[r], &l[r], &vlo, &vhi, dp);
            if (vhi <= vlo) vlo = vhi = lo;
            ulo = vlo < ulo && vhi > vlo ? vlo : ulo;
            uhi = vhi > uhi ? vhi : uhi;
        }
        if (uhi <= ulo) { /* nothing visible: only the rescale */
            for (int g = 0; g < nr; g++)
                for (int d = 0; d < D; d++) acc[(r0 + g) * D + d] *= corr[g];
            continue;
        }
        float *a0 = acc + r0 * D;
        const float *s0 = s + r0 * bs;
#if defined(__AVX512BF16__)
#define VB(NR) dp ? values_rows_dp((const uint16_t *)vraw, s0, a0, corr, NR, D, bs, ulo, uhi, vpf, r0 == 0 ? pfn : 0) \
                  : values_rows(vraw, dt, s0, a0, corr, NR, D, bs, ulo, uhi, r0 == 0 ? vpf : NULL)
#else
#define VB(NR) values_rows(vraw, dt, s0, a0, corr, NR, D, bs, ulo, uhi, r0 == 0 ? vpf : NULL)
#endif
        if (nr == 4) VB(4); else if (nr == 3) VB(3); else if (nr == 2) VB(2); else VB(1);
#undef VB
    }
}

/* attend_block with explicit AVX-512 for head sizes that are multiples of 16: the queries
 * and the output accumulators stay in registers (softmax_values), and cached rows are
 * converted in registers instead of through a scratch buffer. D and dt are constants at each
 * call site.
 *
 * kpf/vpf: the same head's rows in the task's next block (NULL: none), fetched into L2 a row
 * at a time as this block's rows are used. Blocks are scattered over the pool, so the
 * hardware prefetchers stop at each block's end. Fetching the whole next block into L1 at
 * once stalled on the core's few outstanding L1 misses; into L2, a row at a time, decode
 * attention over a scattered float32 cache read faster on a Xeon without AMX
 * (benchmarks/attention_kernels.py times contiguous and scattered blocks). */
static inline __attribute__((always_inline)) void attend_block_avx512(
    const float *restrict qs, const void *kraw, const void *vraw, float *restrict s,
    float *restrict acc, float *restrict m, float *restrict l, const int64_t *restrict qpos,
    const int R, const int D, const int dt, const int bs, const int lo, const int hi,
    const int64_t t0, const int window, const char *kpf, const char *vpf) {
    enum { MAXV = 16 }; /* up to D = 256 */
    const int nv = D / 16;
    const int rb = D * (dt == DT_F32 ? 4 : 2); /* bytes of one cached row */
    int r0 = 0;
    /* Rows in pairs: each key row is loaded (and converted) once for both. Head size 64 only:
     * two rows' queries and 16 accumulators take 24 of the 32 vector registers; at 128 the
     * queries alone would take 16. */
    if (D == 64)
        for (; r0 + 2 <= R; r0 += 2) {
            __m512 q0[4], q1[4];
            for (int j = 0; j < 4; j++) {
                q0[j] = _mm512_loadu_ps(qs + r0 * D + 16 * j);
                q1[j] = _mm512_loadu_ps(qs + (r0 + 1) * D + 16 * j);
            }
            float *restrict s0 = s + r0 * bs, *restrict s1 = s0 + bs;
            int t = lo;
            for (; t + 8 <= hi; t += 8) { /* 8 keys x 2 rows, reduced together */
                __m512 a[16];
                for (int i = 0; i < 8; i++) {
                    if (r0 == 0 && kpf)
                        for (int b = 0; b < rb; b += 64) _mm_prefetch(kpf + (int64_t)(t + i) * rb + b, _MM_HINT_T1);
                    const __m512 k0 = load16(kraw, (int64_t)(t + i) * D, dt);
                    a[i] = _mm512_mul_ps(q0[0], k0);
                    a[8 + i] = _mm512_mul_ps(q1[0], k0);
                    for (int j = 1; j < 4; j++) {
                        const __m512 kj = load16(kraw, (int64_t)(t + i) * D + 16 * j, dt);
                        a[i] = _mm512_fmadd_ps(q0[j], kj, a[i]);
                        a[8 + i] = _mm512_fmadd_ps(q1[j], kj, a[8 + i]);
                    }
                }
                const __m512 h = hsum16(a); /* lanes 0-7: row r0, 8-15: row r0 + 1 */
                _mm256_storeu_ps(s0 + t, _mm512_castps512_ps256(h));
                _mm256_storeu_ps(s1 + t, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(h), 1)));
            }
            for (; t < hi; t++) {
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                for (int j = 0; j < 4; j++) {
                    const __m512 kj = load16(kraw, (int64_t)t * D + 16 * j, dt);
                    a0 = _mm512_fmadd_ps(q0[j], kj, a0);
                    a1 = _mm512_fmadd_ps(q1[j], kj, a1);
                }
                s0[t] = _mm512_reduce_add_ps(a0);
                s1[t] = _mm512_reduce_add_ps(a1);
            }
        }
    for (int r = r0; r < R; r++) {
        __m512 q[MAXV];
        for (int j = 0; j < nv; j++) q[j] = _mm512_loadu_ps(qs + r * D + 16 * j);
        float *restrict sr = s + r * bs;
        int t = lo;
        for (; t + 16 <= hi; t += 16) { /* 16 rows' dot products, reduced together */
            __m512 a[16];
            for (int i = 0; i < 16; i++) {
                if (r == 0 && kpf) /* the next block's key row, a row at a time */
                    for (int b = 0; b < rb; b += 64) _mm_prefetch(kpf + (int64_t)(t + i) * rb + b, _MM_HINT_T1);
                a[i] = _mm512_mul_ps(q[0], load16(kraw, (int64_t)(t + i) * D, dt));
                for (int j = 1; j < nv; j++)
                    a[i] = _mm512_fmadd_ps(q[j], load16(kraw, (int64_t)(t + i) * D + 16 * j, dt), a[i]);
            }
            _mm512_storeu_ps(sr + t, hsum16(a));
        }
        for (; t < hi; t++) {
            __m512 a = _mm512_mul_ps(q[0], load16(kraw, (int64_t)t * D, dt));
            for (int j = 1; j < nv; j++)
                a = _mm512_fmadd_ps(q[j], load16(kraw, (int64_t)t * D + 16 * j, dt), a);
            sr[t] = _mm512_reduce_add_ps(a);
        }
    }
    softmax_values(vraw, dt, s, acc, m, l, qpos, R, D, bs, lo, hi, t0, window, vpf, 0, 0);
}
#define HAVE_AVX512_PATH 1
#endif

#if defined(__AVX512BF16__)
/* The bfloat16 cache with bfloat16 queries (a bf16 model): attend_block's work with the
 * CPU's bf16 dot products. Scores take two `vdpbf16ps` per key for D = 64 straight from the
 * cache (products are exact in float32, so only the summation order differs from the float32
 * path); the value pass converts each cached row once and reuses it for RG query rows held in
 * registers (the G heads of a GQA group share every row). Profiling the float32 path on a
 * 2-core AMX Xeon showed it compute-bound at well under half the read bandwidth: the bf16 ->
 * float32 conversions of K and V, repeated for every query row, were most of its work.
 * scores_bf16: one row's scores; pf, a run of pfn lines to fetch into L2, one per key. */
static inline __attribute__((always_inline)) void scores_bf16(
    const uint16_t *restrict qb, const uint16_t *restrict kraw, float *restrict sr, const int D,
    const int lo, const int hi, const float scale, const char *pf, const int pfn) {
    enum { MAXQ = 4 }; /* up to D = 128 */
    const int nq = D / 32;
    __m512bh q[MAXQ];
    for (int j = 0; j < nq; j++) q[j] = (__m512bh)_mm512_loadu_si512(qb + 32 * j);
    const __m512 sc = _mm512_set1_ps(scale);
    int t = lo;
    for (; t + 16 <= hi; t += 16) {
        __m512 a[16];
        for (int i = 0; i < 16; i++) {
            if (t - lo + i < pfn) _mm_prefetch(pf + (int64_t)(t - lo + i) * 64, _MM_HINT_T1);
            const uint16_t *kr = kraw + (int64_t)(t + i) * D;
            a[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(kr));
            for (int j = 1; j < nq; j++)
                a[i] = _mm512_dpbf16_ps(a[i], q[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
        }
        _mm512_storeu_ps(sr + t, _mm512_mul_ps(hsum16(a), sc));
    }
    for (; t < hi; t++) {
        if (t - lo < pfn) _mm_prefetch(pf + (int64_t)(t - lo) * 64, _MM_HINT_T1);
        const uint16_t *kr = kraw + (int64_t)t * D;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(kr));
        for (int j = 1; j < nq; j++)
            a = _mm512_dpbf16_ps(a, q[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
        sr[t] = _mm512_reduce_add_ps(a) * scale;
    }
}

/* The next block's lines to prefetch while this one is worked on: n of its keys, then n of its
 * values, handed out in runs (*i: the first not yet handed out); a run stays inside one of the
 * two. Returns the run's first line and sets *cnt to its length (0 when none are left). */
static inline __attribute__((always_inline)) const char *next_lines(const char *kpf,
                                                                    const char *vpf, const int n,
                                                                    int *i, const int len,
                                                                    int *cnt) {
    if (*i >= 2 * n) {
        *cnt = 0;
        return NULL;
    }
    const int in_k = *i < n;
    const char *p = in_k ? kpf + (int64_t)*i * 64 : vpf + (int64_t)(*i - n) * 64;
    const int room = (in_k ? n : 2 * n) - *i;
    *cnt = len < room ? len : room;
    *i += *cnt;
    return p;
}

static inline __attribute__((always_inline)) void attend_block_bf16(
    const uint16_t *restrict qb, const uint16_t *kraw, const uint16_t *vraw, float *restrict s,
    float *restrict acc, float *restrict m, float *restrict l, const int64_t *restrict qpos,
    const int R, const int D, const int bs, const int lo, const int hi, const int64_t t0,
    const int window, const float scale, const char *kpf, const char *vpf) {
    /* The next block (kpf/vpf; NULL: none) goes into L2 a line per key step of each row's
     * scores and two per key pair of the values pass, the rest at the end: spread over the
     * block's work. Issued a block's keys at a time, in a burst, they left the kernel's work
     * and its memory traffic adding up instead of overlapping on an AMX Xeon (a loop with
     * the same access pattern also slowed down with such bursts).
     * Into L1, a whole block at once stalled on the core's miss buffers on an EPYC. */
    const int n = kpf ? bs * D * 2 / 64 : 0, w = hi - lo;
    int i = 0, cnt;
    for (int r = 0; r < R; r++) {
        const char *p = next_lines(kpf, vpf, n, &i, w, &cnt);
        scores_bf16(qb + r * D, kraw, s + r * bs, D, lo, hi, scale, p, cnt);
    }
    const char *p = next_lines(kpf, vpf, n, &i, w + (w & 1), &cnt);
    softmax_values(vraw, DT_BF16, s, acc, m, l, qpos, R, D, bs, lo, hi, t0, window, p, 1, cnt);
    while ((p = next_lines(kpf, vpf, n, &i, 1, &cnt)) != NULL) _mm_prefetch(p, _MM_HINT_T1);
}
#define HAVE_BF16_PATH 1
#endif

/* One block of one KV head for the R rows of a task that read it: the path this CPU, cache
 * dtype and head size allow (bf16 dot products, AVX-512, or portable). row0/nrow0: the
 * head's first row in this block and in the next one (-1: none, for the prefetch). */
static inline __attribute__((always_inline)) void attend_head(
    const float *qh, const uint16_t *qbh, const int64_t *ph, int window, const void *k_cache,
    const void *v_cache, int64_t row0, int64_t nrow0, float *sh, float *ah, float *mh,
    float *lh, int R, int D, int dtype, int use_bf16, int bs, int lo, int hi, int64_t t0,
    float scale, float *ktmp, float *vtmp) {
    (void)qbh; (void)use_bf16; (void)nrow0; (void)scale;
#ifdef HAVE_BF16_PATH
    if (use_bf16) {
        const uint16_t *kr = (const uint16_t *)k_cache + row0 * D;
        const uint16_t *vr = (const uint16_t *)v_cache + row0 * D;
        const char *kpf = nrow0 < 0 ? NULL : (const char *)((const uint16_t *)k_cache + nrow0 * D);
        const char *vpf = nrow0 < 0 ? NULL : (const char *)((const uint16_t *)v_cache + nrow0 * D);
        if (D == 64) attend_block_bf16(qbh, kr, vr, sh, ah, mh, lh, ph, R, 64, bs, lo, hi, t0, window, scale, kpf, vpf);
        else attend_block_bf16(qbh, kr, vr, sh, ah, mh, lh, ph, R, 128, bs, lo, hi, t0, window, scale, kpf, vpf);
        return;
    }
#endif
#ifdef HAVE_AVX512_PATH
    if ((D == 64 || D == 128) && dtype != DT_F16) {
        const size_t esz = dtype == DT_F32 ? 4 : 2;
        const char *kr = (const char *)k_cache + row0 * D * esz;
        const char *vr = (const char *)v_cache + row0 * D * esz;
        const char *kpf = nrow0 < 0 ? NULL : (const char *)k_cache + nrow0 * D * esz;
        const char *vpf = nrow0 < 0 ? NULL : (const char *)v_cache + nrow0 * D * esz;
#define AVX_CALL(DD, DT) attend_block_avx512(qh, kr, vr, sh, ah, mh, lh, ph, R, DD, DT, bs, lo, hi, t0, window, kpf, vpf)
        if (D == 64 && dtype == DT_F32) AVX_CALL(64, DT_F32);
        else if (D == 64) AVX_CALL(64, DT_BF16);
        else if (dtype == DT_F32) AVX_CALL(128, DT_F32);
        else AVX_CALL(128, DT_BF16);
#undef AVX_CALL
        return;
    }
#endif
    const float *kb = load_rows(k_cache, row0, bs, D, dtype, ktmp);
    const float *vb = load_rows(v_cache, row0, bs, D, dtype, vtmp);
    switch (D) { /* constant D at the common head sizes */
    case 64: attend_block(qh, kb, vb, sh, ah, mh, lh, ph, R, 64, bs, lo, hi, t0, window); break;
    case 128: attend_block(qh, kb, vb, sh, ah, mh, lh, ph, R, 128, bs, lo, hi, t0, window); break;
    case 32: attend_block(qh, kb, vb, sh, ah, mh, lh, ph, R, 32, bs, lo, hi, t0, window); break;
    default: attend_block(qh, kb, vb, sh, ah, mh, lh, ph, R, D, bs, lo, hi, t0, window);
    }
}

/* H2O's side output for one task: once its rows' softmax max m and sum l are final, score
 * the keys again and add each key's probability, summed over the task's rows of each KV head
 * (the G query heads of the group, and the chunk's queries), to that head's row of `vote`
 * (float32 [KVH, vs]). A second pass over the keys the task just read (still in cache) keeps
 * the streaming pass as it is: the probabilities need the final max and sum, which the online
 * softmax knows only at the end. */
static void add_votes(float *vote, int64_t vs, const void *k_cache, const int64_t *table,
                      const float *qs, const uint16_t *qb, float *s, const float *m,
                      const float *l, const int64_t *qpos, int R, int HG, int h0, int KVH,
                      int D, int bs, int64_t first, int64_t last, int window, int dtype,
                      int use_bf16, float scale, float *ktmp, int shared) {
    (void)qb; (void)use_bf16; (void)scale;
    float sums[256]; /* block_size <= 256 */
    for (int h = 0; h < HG; h++) {
        float *vh = vote + (int64_t)(h0 + h) * vs;
        const int rr = h * R;
        for (int64_t t0 = (first / bs) * bs; t0 <= last; t0 += bs) {
            const int64_t row0 = (table[t0 / bs] * KVH + h0 + h) * bs;
            const int lo = (int)(first > t0 ? first - t0 : 0);
            const int hi = (int)(last - t0 + 1 < bs ? last - t0 + 1 : bs);
            const float *kb = NULL;
#ifdef HAVE_BF16_PATH
            if (!use_bf16)
#endif
                kb = load_rows(k_cache, row0, bs, D, dtype, ktmp);
            for (int t = lo; t < hi; t++) sums[t] = 0.f;
            for (int r = rr; r < rr + R; r++) {
                float *restrict sr = s + (int64_t)r * bs;
#ifdef HAVE_BF16_PATH
                if (use_bf16) {
                    scores_bf16(qb + (int64_t)r * D, (const uint16_t *)k_cache + row0 * D, sr, D,
                                lo, hi, scale, NULL, 0);
                } else
#endif
                {
                    const float *restrict qr = qs + (int64_t)r * D;
                    for (int t = lo; t < hi; t++) {
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; d++) dot += qr[d] * kb[t * D + d];
                        sr[t] = dot;
                    }
                }
                int a, z;
                visible_keys(lo, hi, qpos[r], t0, window, &a, &z);
                if (l[r] <= 0.f) continue;
                const float inv = 1.f / l[r], mr = m[r];
                for (int t = a; t < z; t++) sums[t] += expf(sr[t] - mr) * inv;
            }
            if (shared) { /* other tasks (query tiles of the sequence) add to these keys too */
                for (int t = lo; t < hi; t++) {
#pragma omp atomic
                    vh[t0 + t] += sums[t];
                }
            } else {
                for (int t = lo; t < hi; t++) vh[t0 + t] += sums[t];
            }
        }
    }
}

int kvserve_paged_attention(const void *q, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, int64_t bt_stride,
                            const int64_t *q_start, const int64_t *q_len,
                            const int64_t *ctx_len, const int32_t *seq_windows, void *out,
                            int B, int H, int KVH, int D, int bs, int layer_window, float scale,
                            int dtype, int num_threads, int q_dtype, int out_dtype,
                            const int64_t *vote_ptrs, const int64_t *vote_strides,
                            const int32_t *seq_sinks, const void *q_back) {
    if ((q_dtype != DT_F32 && q_dtype != DT_BF16) || (out_dtype != DT_F32 && out_dtype != DT_BF16))
        return -1;
    if (H % KVH) return -1;
    if (vote_ptrs && bs > 256) return -1;
    /* Every key a row reads must be in the table: a narrower one would read past its row. */
    for (int b = 0; b < B; b++)
        if (ctx_len[b] < 0 || q_len[b] < 0 || ctx_len[b] + q_len[b] > bt_stride * bs) return -3;
    const int G = H / KVH;
    int use_bf16 = 0;
#ifdef HAVE_BF16_PATH
    /* bf16 dot products need the queries exactly in bf16: only a bf16 model's queries are. */
    use_bf16 = dtype == DT_BF16 && q_dtype == DT_BF16 && (D == 64 || D == 128) && bs <= 256;
#endif
    /* Task list: (sequence, tile of queries, group of HG KV heads). A task walks its blocks
     * once for all its heads, so it reads one contiguous run of HG * block_size rows per block
     * instead of HG scattered ones (measured on scattered pools: the runs stream, the pieces
     * do not). HG is the largest divisor of KVH that still leaves 4 tasks per thread. */
    int64_t ntiles = 0;
    for (int b = 0; b < B; b++) ntiles += (q_len[b] + QT - 1) / QT;
    int HG = KVH;
    while (HG > 1 && ntiles * (KVH / HG) < 4 * (int64_t)num_threads) {
        int h = HG - 1;
        while (KVH % h) h--;
        HG = h;
    }
    const int ngroups = KVH / HG;
    int64_t *tile_seq = malloc(sizeof(int64_t) * (ntiles > 0 ? ntiles : 1));
    int64_t *tile_i0 = malloc(sizeof(int64_t) * (ntiles > 0 ? ntiles : 1));
    if (!tile_seq || !tile_i0) { free(tile_seq); free(tile_i0); return -2; }
    for (int b = 0, t = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < q_len[b]; i0 += QT, t++) { tile_seq[t] = b; tile_i0[t] = i0; }
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        const int maxr = QT * G * HG; /* rows of one task: its queries x the heads it serves */
        float *qs = malloc(sizeof(float) * maxr * D);
        float *acc = malloc(sizeof(float) * maxr * D);
        float *s = malloc(sizeof(float) * maxr * bs);
        float *m = malloc(sizeof(float) * maxr), *l = malloc(sizeof(float) * maxr);
        int64_t *qpos = malloc(sizeof(int64_t) * maxr);
        uint16_t *qb = malloc(sizeof(uint16_t) * maxr * D);
        /* StreamingLLM's sink keys: each row's query rotated back (q_back), its last sink */
        float *qsb = malloc(sizeof(float) * maxr * D);
        uint16_t *qbb = malloc(sizeof(uint16_t) * maxr * D);
        int64_t *qpos_s = malloc(sizeof(int64_t) * maxr);
        float *ktmp = malloc(sizeof(float) * bs * D), *vtmp = malloc(sizeof(float) * bs * D);
        if (!qs || !acc || !s || !m || !l || !qpos || !ktmp || !vtmp || !qb || !qsb || !qbb || !qpos_s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntiles * ngroups; task++) {
            if (failed) continue;
            const int64_t tile = task / ngroups;
            const int h0 = (int)(task % ngroups) * HG; /* first KV head of the task */
            const int b = (int)tile_seq[tile];
            const int64_t i0 = tile_i0[tile];
            const int nq = (int)(q_len[b] - i0 < QT ? q_len[b] - i0 : QT);
            const int R = nq * G; /* rows per head; head h's rows start at h * R */
            const int sw = seq_windows ? seq_windows[b] : 0;
            const int window = sw > 0 && (layer_window <= 0 || sw < layer_window) ? sw : layer_window;
            const int sinks = seq_sinks && window > 0 ? seq_sinks[b] : 0;
            for (int h = 0; h < HG; h++) {
                for (int i = 0; i < nq; i++) {
                    for (int g = 0; g < G; g++) {
                        const int r = h * R + i * G + g;
                        const int64_t qo = ((q_start[b] + i0 + i) * H + (h0 + h) * G + g) * D;
                        if (q_dtype == DT_BF16) {
                            const uint16_t *qp = (const uint16_t *)q + qo;
                            for (int d = 0; d < D; d++) {
                                qb[r * D + d] = qp[d];
                                qs[r * D + d] = bf16_to_f32(qp[d]) * scale;
                                acc[r * D + d] = 0.f;
                            }
                        } else {
                            const float *qp = (const float *)q + qo;
                            for (int d = 0; d < D; d++) { qs[r * D + d] = qp[d] * scale; acc[r * D + d] = 0.f; }
                        }
                        m[r] = -FLT_MAX;
                        l[r] = 0.f;
                        qpos[r] = ctx_len[b] + i0 + i;
                        if (sinks > 0) { /* sees sink keys up to its window's start */
                            const int64_t w0 = qpos[r] - window; /* newest key before it */
                            qpos_s[r] = w0 < sinks - 1 ? w0 : sinks - 1;
                            if (q_dtype == DT_BF16) {
                                const uint16_t *qp = (const uint16_t *)q_back + qo;
                                for (int d = 0; d < D; d++) {
                                    qbb[r * D + d] = qp[d];
                                    qsb[r * D + d] = bf16_to_f32(qp[d]) * scale;
                                }
                            } else {
                                const float *qp = (const float *)q_back + qo;
                                for (int d = 0; d < D; d++) qsb[r * D + d] = qp[d] * scale;
                            }
                        }
                    }
                }
            }
            const int64_t last = ctx_len[b] + i0 + nq - 1; /* newest key any row sees */
            const int64_t first = (window > 0 && ctx_len[b] + i0 - window + 1 > 0)
                                      ? ctx_len[b] + i0 - window + 1 : 0;
            /* Sink keys outside a row's window, scored with its rotated-back query; no window
             * key is a sink key seen here too (each row's sink range ends where its window
             * starts), and the online softmax does not care in which order keys come. */
            for (int64_t t0 = 0; t0 < sinks; t0 += bs) {
                const int64_t blk = block_tables[(int64_t)b * bt_stride + t0 / bs];
                const int hi = (int)(sinks - t0 < bs ? sinks - t0 : bs);
                for (int h = 0; h < HG; h++) {
                    const int rr = h * R;
                    attend_head(qsb + rr * D, qbb + rr * D, qpos_s + rr, 0, k_cache, v_cache,
                                (blk * KVH + h0 + h) * bs, -1, s + rr * bs, acc + rr * D,
                                m + rr, l + rr, R, D, dtype, use_bf16, bs, 0, hi, t0, scale,
                                ktmp, vtmp);
                }
            }
            for (int64_t t0 = (first / bs) * bs; t0 <= last; t0 += bs) {
                const int64_t blk = block_tables[(int64_t)b * bt_stride + t0 / bs];
                const int64_t nblk = t0 + bs <= last ? block_tables[(int64_t)b * bt_stride + t0 / bs + 1] : -1;
                const int lo = (int)(first > t0 ? first - t0 : 0);
                const int hi = (int)(last - t0 + 1 < bs ? last - t0 + 1 : bs);
                for (int h = 0; h < HG; h++) {
                    const int rr = h * R; /* this head's first row */
                    attend_head(qs + rr * D, qb + rr * D, qpos + rr, window, k_cache, v_cache,
                                (blk * KVH + h0 + h) * bs,
                                nblk < 0 ? -1 : (nblk * KVH + h0 + h) * bs, s + rr * bs,
                                acc + rr * D, m + rr, l + rr, R, D, dtype, use_bf16, bs, lo, hi,
                                t0, scale, ktmp, vtmp);
                }
            }
            if (vote_ptrs && vote_ptrs[b]) {
                add_votes((float *)(intptr_t)vote_ptrs[b], vote_strides[b], k_cache,
                          block_tables + (int64_t)b * bt_stride, qs, qb, s, m, l, qpos, R, HG,
                          h0, KVH, D, bs, first, last, window, dtype, use_bf16, scale, ktmp,
                          q_len[b] > QT);
            }
            for (int h = 0; h < HG; h++) {
                for (int i = 0; i < nq; i++) {
                    for (int g = 0; g < G; g++) {
                        const int r = h * R + i * G + g;
                        const int64_t oo = ((q_start[b] + i0 + i) * H + (h0 + h) * G + g) * D;
                        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                        if (out_dtype == DT_BF16) {
                            uint16_t *op = (uint16_t *)out + oo;
                            for (int d = 0; d < D; d++) op[d] = f32_to_bf16(acc[r * D + d] * inv);
                        } else {
                            float *op = (float *)out + oo;
                            for (int d = 0; d < D; d++) op[d] = acc[r * D + d] * inv;
                        }
                    }
                }
            }
        }
        free(qs); free(acc); free(s); free(m); free(l); free(qpos); free(ktmp); free(vtmp); free(qb);
        free(qsb); free(qbb); free(qpos_s);
    }
    free(tile_seq);
    free(tile_i0);
    return failed ? -2 : 0;
}
