/* Helpers shared by kvserve's native kernels: storage dtype codes, scalar conversions of
 * 16-bit floats (used where the AVX-512 paths do not apply) and the AVX-512 row load. */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16, round to nearest even (PyTorch's conversion; NaN stays NaN). Written
 * without branches so that loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? nan : rounded);
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values of a K/V row as float32, converted in registers (bf16: shift; f16: F16C). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t off,
                                                            const int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)base + off);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* 16 float32 lanes rounded to bf16 as f32_to_bf16 does (nearest even, NaN kept and quieted:
 * the rounding add alone could carry a NaN into an infinity or a zero); the bf16 is each
 * lane's upper half, the lower half is left over from the rounding. */
static inline __m512i bf16_rounded_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
}

/* float32 -> bf16, 16 lanes, bit for bit f32_to_bf16. With AVX512-BF16, one instruction
 * (nearest even, NaN quieted as here) where no lane is a float32 denormal, which it would
 * flush to zero; such vectors (rare) take the integer rounding. */
static inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nonzero = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 denormal =
        _mm512_mask_testn_epi32_mask(nonzero, u, _mm512_set1_epi32(0x7f800000));
    if (__builtin_expect(!denormal, 1)) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16));
}

/* exp(x) on 16 lanes, relative error ~2e-7; clamped to [-87, 88] (lanes below -87 give ~0,
 * none overflow). 2^n * p(f) with n = round(x log2 e) and a degree-6 polynomial on
 * |f| <= ln2 / 2. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) * u in float32: silu(g) = g / (1 + exp(-g)). */
static inline __m512 silu_mul(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return _mm512_mul_ps(s, u);
}

/* The bf16 linear kernels' fused epilogues (amx_gemm.c, avx512_gemm.c). EPI_F32, a flag
 * beside EPI_NONE: y is float32, each value the bf16 it would have been (an LM head's logits,
 * which the sampler reads in float32, without a pass converting them). */
enum { EPI_NONE = 0, EPI_ADD = 1, EPI_SWIGLU = 2, EPI_F32 = 4 };

/* x rounded to bf16, kept as float32, on 16 lanes. */
static inline __attribute__((always_inline)) __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(bf16_rounded_bits(x), _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 outputs y[row][col .. col + 15] from their float32 sums v: EPI_SWIGLU silu(v) * u[0..15]
 * (the up projection's sums), EPI_ADD v + aux[row][col ..] (bf16, rows ldaux apart), else
 * v + bias[col ..] (float32, or NULL); rounded to bf16 once, as oneDNN's fused ops do. */
static inline __attribute__((always_inline)) void store_epilogue16(
    __m512 v, const float *u, int epilogue, const uint16_t *aux, int64_t ldaux,
    const float *bias, uint16_t *y, int64_t ldy, int64_t row, int64_t col) {
    if (epilogue == EPI_SWIGLU)
        v = silu_mul(v, _mm512_load_ps(u));
    else if (epilogue == EPI_ADD)
        v = _mm512_add_ps(v, load16(aux, row * ldaux + col, DT_BF16));
    else if (bias)
        v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
    if (epilogue & EPI_F32)
        _mm512_storeu_ps((float *)(void *)y + row * ldy + col, round_bf16x16(v));
    else
        _mm256_storeu_si256((__m256i *)(y + row * ldy + col), to_bf16(v));
}

/* One bf16 row of RMSNorm, out = w * round(x * rsqrt(mean(x^2) + eps)) (RMSNorm.forward's
 * roundings), for dim % 16 == 0: the fused RMSNorm (pointwise.c) and the linear kernels that
 * normalise their input rows as they copy them (amx_gemm.c, avx512_gemm.c) share it, so that
 * the fused and unfused paths give the same bits. Build without FMA contraction. */
static inline __attribute__((always_inline)) void rms_norm_row_bf16(const uint16_t *x,
                                                                    const uint16_t *w,
                                                                    uint16_t *out, int dim,
                                                                    float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < dim; j += 16) {
        const __m512 v = load16(x, j, DT_BF16);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float ss = _mm512_reduce_add_ps(acc);
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(ss / (float)dim + eps));
    for (int j = 0; j < dim; j += 16) {
        const __m512 y = round_bf16x16(_mm512_mul_ps(load16(x, j, DT_BF16), inv));
        _mm256_storeu_si256((__m256i *)(out + j), to_bf16(_mm512_mul_ps(load16(w, j, DT_BF16), y)));
    }
}

/* The 16 horizontal sums of a[0..15], lane i = sum of a[i]'s lanes: a transposing add tree
 * (45 shuffles and adds, where 16 separate reductions cost about 140). */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *a) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [r0, r1, r0, r1] of rows 2i, 2i+1 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: rows 4i .. 4i + 3 */
        const __m512d u = _mm512_castps_pd(x[2 * i]), v = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: rows 8i..+3 (twice), rows 8i+4..+7 (twice) */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
}
#endif
#if defined(KVSERVE_AMX_TILES) /* defined by the AMX kernels, after _GNU_SOURCE (syscall) */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the AMX register state only to a process that asks (once per process). */
static inline int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1;
    return state == 1;
}
#endif
#endif
