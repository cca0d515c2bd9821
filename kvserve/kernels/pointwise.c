/* Fused element-wise ops of a decoder layer: RMSNorm and rotary embedding (and, at the end,
 * the copy of a step's K/V rows into the paged cache and the greedy sampler's top-k).
 *
 * In PyTorch each is a chain of separate ops (RMSNorm: to float, square, mean, rsqrt, scale,
 * round, weight; rotary: two gathers of cos/sin, their casts, a negated concatenation, two
 * products and a sum), each writing a full-size temporary. On a 2,048-token prefill chunk of a
 * 512-wide bf16 model that is several milliseconds per layer for a few megabytes of data; here
 * each row is read once and written once.
 *
 * Both kernels round exactly where the PyTorch reference rounds (kvserve/model/llama.py), so
 * the rotary kernel is bit-identical to it in float32 and bfloat16, and the RMSNorm kernel
 * differs from it only through the order of the sum of squares. Compiled
 * without -ffast-math and with -ffp-contract=off: a fused multiply-add would round once where
 * the reference rounds twice.
 *
 * Rows are split over OpenMP threads; small inputs (decode steps) run on one thread, where
 * waking the pool would cost more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve_kernels.h"

#define INLINE static inline __attribute__((always_inline))

/* Value of x rounded to the storage dtype, kept as float32. */
INLINE float round_dt(float x, int dt) {
    return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

INLINE float load_dt(const void *base, int64_t i, int dt) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

INLINE void store_dt(void *base, int64_t i, float x, int dt) {
    if (dt == DT_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

static int threads_for(int64_t elements, int num_threads) {
    return elements < (1 << 16) ? 1 : num_threads;
}


/* One row of RMSNorm; inlined with a constant dt so each dtype gets its own vector loop. */
INLINE void rms_row(const void *x, int64_t xi, const void *w, void *out, int64_t oi, int dim,
                    float eps, const int dt) {
#if defined(__AVX512F__)
    if (dt == DT_BF16 && dim % 16 == 0) {
        rms_norm_row_bf16((const uint16_t *)x + xi, (const uint16_t *)w, (uint16_t *)out + oi,
                          dim, eps);
        return;
    }
#endif
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int j = 0; j < dim; j++) {
        const float v = load_dt(x, xi + j, dt);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int j = 0; j < dim; j++) {
        const float y = round_dt(load_dt(x, xi + j, dt) * inv, dt);
        store_dt(out, oi + j, load_dt(w, j, dt) * y, dt);
    }
}

/* out[r] = w * round(x[r] * rsqrt(mean(x[r]^2) + eps)), as RMSNorm.forward computes it.
 * x rows are `x_stride` elements apart; out is contiguous [rows, dim]. */
int kvserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows,
                     int dim, float eps, int dt, int num_threads) {
    if (dt != DT_F32 && dt != DT_BF16) return 1;
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (dt == DT_BF16)
            rms_row(x, r * x_stride, w, out, r * (int64_t)dim, dim, eps, DT_BF16);
        else
            rms_row(x, r * x_stride, w, out, r * (int64_t)dim, dim, eps, DT_F32);
    }
    return 0;
}

/* One head of one token: x' = round(round(x * c) + round(rotate_half(x) * s)). */
INLINE void rotate_head(void *base, int64_t row, const float *c, const float *s, int half,
                        const int dt) {
#if defined(__AVX512F__)
    if (dt == DT_BF16 && half % 16 == 0) {
        uint16_t *x = (uint16_t *)base + row;
        for (int j = 0; j < half; j += 16) {
            const __m512 a = load16(x, j, DT_BF16), b = load16(x, j + half, DT_BF16);
            const __m512 nb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b),
                                                                   _mm512_set1_epi32((int)0x80000000u)));
            const __m512 lo = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(a, _mm512_loadu_ps(c + j))),
                                            round_bf16x16(_mm512_mul_ps(nb, _mm512_loadu_ps(s + j))));
            const __m512 hi = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(b, _mm512_loadu_ps(c + j + half))),
                                            round_bf16x16(_mm512_mul_ps(a, _mm512_loadu_ps(s + j + half))));
            _mm256_storeu_si256((__m256i *)(x + j), to_bf16(lo));
            _mm256_storeu_si256((__m256i *)(x + j + half), to_bf16(hi));
        }
        return;
    }
#endif
#pragma omp simd
    for (int j = 0; j < half; j++) {
        const float a = load_dt(base, row + j, dt), b = load_dt(base, row + j + half, dt);
        store_dt(base, row + j, round_dt(a * c[j], dt) + round_dt(-b * s[j], dt), dt);
        store_dt(base, row + j + half,
                 round_dt(b * c[j + half], dt) + round_dt(a * s[j + half], dt), dt);
    }
}

/* Rotate the first `rot` dims of every head of q and k in place (rotate_half convention):
 * x' = round(round(x * c) + round(rotate_half(x) * s)), with c and s the float32 tables at the
 * token's position rounded to the dtype, as _apply_rotary does. q rows (tokens) are q_stride
 * elements apart, k rows k_stride; heads are head_dim apart inside a row. */
int kvserve_rotary(void *q, int64_t q_stride, int q_heads, void *k, int64_t k_stride,
                   int k_heads, int head_dim, int rot, const float *cos_table,
                   const float *sin_table, int64_t table_rows, const int64_t *positions,
                   int64_t tokens, int dt, int num_threads) {
    if ((dt != DT_F32 && dt != DT_BF16) || rot % 2 || rot > head_dim || rot > 512) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return 2; /* nothing touched */
    const int half = rot / 2, heads = q_heads + k_heads;
#pragma omp parallel for num_threads( \
        threads_for(tokens * heads * rot, num_threads)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *ct = cos_table + positions[t] * rot, *st = sin_table + positions[t] * rot;
        float c[512], s[512]; /* rot <= 512, checked above */
        for (int j = 0; j < rot; j++) {
            c[j] = round_dt(ct[j], dt);
            s[j] = round_dt(st[j], dt);
        }
        for (int h = 0; h < heads; h++) {
            void *base = h < q_heads ? q : k;
            const int64_t row = h < q_heads ? t * q_stride + (int64_t)h * head_dim
                                            : t * k_stride + (int64_t)(h - q_heads) * head_dim;
            if (dt == DT_BF16)
                rotate_head(base, row, c, s, half, DT_BF16);
            else
                rotate_head(base, row, c, s, half, DT_F32);
        }
    }
    return 0;
}

/* This step's K and V rows into a paged cache of the same dtype: token t's KVH heads (rows
 * k_stride / v_stride elements apart, heads head_dim apart inside a row) go to slot
 * slots[t] of the per-layer pools [rows, KVH, block_size, head_dim], a negative slot
 * counting from the end as a PyTorch index does. PyTorch's indexed assignment of the same
 * rows costs tens of microseconds per call in index bookkeeping, per layer and step; this is
 * a few copies of head_dim values. Returns 2 (nothing written) if a slot is out of range. */
/* Element offset, in a pool, of slot s's row for KV head h (n slots; s < 0 counts from n). */
INLINE int64_t kv_row(int64_t s, int64_t n, int kv_heads, int block_size, int head_dim, int h) {
    if (s < 0) s += n;
    return ((s / block_size * kv_heads + h) * block_size + s % block_size) * head_dim;
}

int kvserve_kv_write(void *k_pool, void *v_pool, int64_t rows, int kv_heads, int block_size,
                     int head_dim, const int64_t *slots, int64_t tokens, const void *k,
                     int64_t k_stride, const void *v, int64_t v_stride, int elem_size) {
    const int64_t n = rows * block_size;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -n || slots[t] >= n) return 2;
    const size_t bytes = (size_t)head_dim * elem_size;
    /* A decode step's rows go to as many scattered blocks as it has sequences, and each copy
     * waited on its own cache (and TLB) miss: the lines are requested for writing AHEAD
     * tokens before their copy, so that the misses overlap. */
    enum { AHEAD = 32 };
    char *kp = k_pool, *vp = v_pool;
    for (int64_t t = 0; t < tokens + AHEAD; t++) {
        if (t < tokens)
            for (int h = 0; h < kv_heads; h++) {
                const int64_t dst = kv_row(slots[t], n, kv_heads, block_size, head_dim, h) * elem_size;
                for (size_t b = 0; b < bytes; b += 64) {
                    __builtin_prefetch(kp + dst + b, 1, 3);
                    __builtin_prefetch(vp + dst + b, 1, 3);
                }
            }
        const int64_t c = t - AHEAD; /* the token copied now */
        if (c < 0) continue;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t dst = kv_row(slots[c], n, kv_heads, block_size, head_dim, h) * elem_size;
            memcpy(kp + dst, (const char *)k + (c * k_stride + (int64_t)h * head_dim) * elem_size, bytes);
            memcpy(vp + dst, (const char *)v + (c * v_stride + (int64_t)h * head_dim) * elem_size, bytes);
        }
    }
    return 0;
}

/* The k largest values of each row of x [rows, cols] (rows x_stride apart), largest first, and
 * their column indices; among equal values the lower index first, as an argmax picks. The
 * greedy sampler re-scores these candidates (RESCORE_TOPK): torch.topk took a few
 * milliseconds per decode step over a 49,152-token vocabulary, for what is one read of the
 * logits. Most of a row is only compared, 16 lanes at a time, with the k-th value so far.
 * Returns 0; 1 (nothing to trust) if k is out of [1, min(cols, 16)] or a row holds a NaN
 * (torch.topk's ordering of NaN is left to it). */
int kvserve_topk_rows(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int k,
                      float *vals, int64_t *idx, int num_threads) {
    enum { KMAX = 16 };
    if (k < 1 || k > KMAX || k > cols) return 1;
    int nan_seen = 0;
#pragma omp parallel for num_threads(threads_for(rows * cols, num_threads)) schedule(static) reduction(| : nan_seen)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float v[KMAX];
        int64_t ix[KMAX];
        int n = 0; /* entries so far, v descending, ties by index */
        int nan_row = 0;
/* Insert column j (all entries so far have lower indices: a tie stays behind them). */
#define TOPK_INSERT(j)                                                  \
    do {                                                                \
        const float xv = row[j];                                        \
        if (xv != xv) { nan_row = 1; break; }                           \
        if (n == k && !(xv > v[k - 1])) break;                          \
        int p = n < k ? n++ : k - 1;                                    \
        while (p > 0 && xv > v[p - 1]) { v[p] = v[p - 1]; ix[p] = ix[p - 1]; p--; } \
        v[p] = xv;                                                      \
        ix[p] = (j);                                                    \
    } while (0)
        int64_t j = 0;
        for (; j < k; j++) TOPK_INSERT(j);
#if defined(__AVX512F__)
        for (; j + 16 <= cols && !nan_row; j += 16) {
            const __m512 c = _mm512_loadu_ps(row + j);
            /* lanes above the k-th value, and NaN lanes (unordered), go to the scalar insert */
            __mmask16 m = _mm512_cmp_ps_mask(c, _mm512_set1_ps(v[k - 1]), _CMP_NLE_UQ);
            while (m) {
                const int l = __builtin_ctz(m);
                m &= m - 1;
                TOPK_INSERT(j + l);
            }
        }
#endif
        for (; j < cols && !nan_row; j++) TOPK_INSERT(j);
#undef TOPK_INSERT
        nan_seen |= nan_row;
        for (int i = 0; i < k; i++) {
            vals[r * k + i] = v[i];
            idx[r * k + i] = ix[i];
        }
    }
    return nan_seen ? 1 : 0;
}
