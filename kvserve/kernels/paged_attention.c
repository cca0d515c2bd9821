/* Decode attention straight from the paged KV cache, one pass over each block.
 *
 * The plain-PyTorch path (kvserve/model/attention.py) first gathers every sequence's blocks
 * into a padded batch and then runs SDPA: K and V are read, written and read again, and the
 * padding is read too. This kernel reads each cached K/V row once, in place, with an online
 * softmax (running max and sum per query head), so decode attention runs at close to the
 * memory bandwidth. Work is split over (sequence, KV head) pairs with OpenMP; the G query
 * heads of a GQA group share every K/V row they read, and a block's rows for one KV head are
 * contiguous (head-major blocks), so each task streams 4 KiB runs rather than strided rows.
 *
 * Layout: q/out [B, H, D] float32; k/v cache [num_blocks, KVH, block_size, D] in float32,
 * bfloat16 or float16; block_tables [B, bt_stride] int64; seq_lens [B] int64 (keys to attend,
 * the new token included). window > 0 restricts keys to the last `window` positions.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 64
#define MAX_D 256
#define MAX_BS 256

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000 | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline const float *load_row(const void *base, int64_t idx, int D, int dt, float *tmp) {
    if (dt == DT_F32) return (const float *)base + idx * D;
    const uint16_t *p = (const uint16_t *)base + idx * D;
    if (dt == DT_BF16) {
        for (int d = 0; d < D; d++) tmp[d] = bf16_to_f32(p[d]);
    } else {
        for (int d = 0; d < D; d++) tmp[d] = f16_to_f32(p[d]);
    }
    return tmp;
}

int kvserve_paged_decode(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                         float *out, int B, int H, int KVH, int D, int bs, int window,
                         float scale, int dtype, int num_threads) {
    if (H % KVH || H / KVH > MAX_G || D > MAX_D || bs > MAX_BS) return -1;
    const int G = H / KVH;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < (int64_t)B * KVH; task++) {
        const int b = (int)(task / KVH), hk = (int)(task % KVH);
        float qs[MAX_G][MAX_D], acc[MAX_G][MAX_D], s[MAX_G][MAX_BS];
        float m[MAX_G], l[MAX_G], ktmp[MAX_D], vtmp[MAX_D];
        for (int g = 0; g < G; g++) {
            const float *qp = q + ((int64_t)b * H + hk * G + g) * D;
            for (int d = 0; d < D; d++) { qs[g][d] = qp[d] * scale; acc[g][d] = 0.f; }
            m[g] = -FLT_MAX;
            l[g] = 0.f;
        }
        const int64_t L = seq_lens[b];
        const int64_t start = (window > 0 && L > window) ? L - window : 0;
        for (int64_t t0 = (start / bs) * bs; t0 < L; t0 += bs) {
            const int64_t blk = block_tables[(int64_t)b * bt_stride + t0 / bs];
            const int lo = (int)(start > t0 ? start - t0 : 0);
            const int hi = (int)(L - t0 < bs ? L - t0 : bs);
            for (int t = lo; t < hi; t++) {
                const float *kr = load_row(k_cache, (blk * KVH + hk) * bs + t, D, dtype, ktmp);
                for (int g = 0; g < G; g++) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; d++) dot += qs[g][d] * kr[d];
                    s[g][t] = dot;
                }
            }
            for (int g = 0; g < G; g++) {
                float mx = m[g];
                for (int t = lo; t < hi; t++) mx = s[g][t] > mx ? s[g][t] : mx;
                const float corr = expf(m[g] - mx);
                float sum = l[g] * corr;
                for (int t = lo; t < hi; t++) { s[g][t] = expf(s[g][t] - mx); sum += s[g][t]; }
                if (corr != 1.f)
                    for (int d = 0; d < D; d++) acc[g][d] *= corr;
                m[g] = mx;
                l[g] = sum;
            }
            for (int t = lo; t < hi; t++) {
                const float *vr = load_row(v_cache, (blk * KVH + hk) * bs + t, D, dtype, vtmp);
                for (int g = 0; g < G; g++) {
                    const float p = s[g][t];
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[g][d] += p * vr[d];
                }
            }
        }
        for (int g = 0; g < G; g++) {
            float *op = out + ((int64_t)b * H + hk * G + g) * D;
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
            for (int d = 0; d < D; d++) op[d] = acc[g][d] * inv;
        }
    }
    return 0;
}
