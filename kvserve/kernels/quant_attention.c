/* Decode attention straight from quantized paged KV blocks (fp8, int8, KIVI 4/2-bit).
 *
 * The reference path (kvserve/kv/quant_storage.py, kivi_storage.py) dequantizes every
 * gathered block into a padded float batch and runs SDPA: the codes are read once but the
 * float copy is written and read again, which costs more than the bytes quantization saved.
 * Here each (sequence, KV head) task decodes one block tile at a time into a small float
 * buffer on the stack ([block_size][head_dim], in L1) and runs an online softmax over it, so
 * only the codes and their metadata stream from memory.
 *
 * Formats (fmt): 0 = fp8 (e4m3 or e5m2 codes via F16C, one scale per KV head), 1 = int8 (one
 * float16 scale per token and head), 2 = KIVI (keys: per-channel zero/scale codes against
 * three floats per block and head, lut[i] = 2**(-i/8) decodes the scale code; values: float16
 * scale/zero per token per channel group).
 * A KIVI block that is still partial (res_of_block[blk] >= 0) is read from the full-precision
 * residual pool instead (float32, bfloat16 or float16).
 *
 * No -ffast-math: it would set flush-to-zero for the whole process when the library loads.
 * The dot products vectorize through `omp simd` reductions instead.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define MAX_G 64
#define MAX_D 256
#define MAX_BS 256

enum { FMT_FP8 = 0, FMT_INT8 = 1, FMT_KIVI = 2 };
#include "kvserve_kernels.h"

/* Byte -> its 2 nibbles / 4 crumbs (lowest first), so unpacking is one table load per byte. */
static uint16_t NIB[256];
static uint32_t CRUMB[256];
static int tables_ready = 0;

static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        const uint8_t n[2] = {(uint8_t)(b & 15), (uint8_t)(b >> 4)};
        const uint8_t c[4] = {(uint8_t)(b & 3), (uint8_t)((b >> 2) & 3), (uint8_t)((b >> 4) & 3),
                              (uint8_t)(b >> 6)};
        memcpy(&NIB[b], n, 2);
        memcpy(&CRUMB[b], c, 4);
    }
    tables_ready = 1;
}

/* Unpack P bytes of 4-bit (2-bit) codes into 2P (4P) bytes, lowest bits first: SSE2 shifts,
 * masks and byte interleaves, 16 input bytes at a time; the tables handle the tail. */
static inline void unpack4(const uint8_t *row, int P, uint8_t *cd) {
    int j = 0;
#ifdef __SSE2__
    const __m128i m = _mm_set1_epi8(0x0f);
    for (; j + 16 <= P; j += 16) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(row + j));
        const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
        _mm_storeu_si128((__m128i *)(cd + 2 * j), _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128((__m128i *)(cd + 2 * j + 16), _mm_unpackhi_epi8(lo, hi));
    }
#endif
    for (; j < P; j++) memcpy(cd + 2 * j, &NIB[row[j]], 2);
}

static inline void unpack2(const uint8_t *row, int P, uint8_t *cd) {
    int j = 0;
#ifdef __SSE2__
    const __m128i m = _mm_set1_epi8(3);
    for (; j + 16 <= P; j += 16) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(row + j));
        const __m128i c0 = _mm_and_si128(x, m), c1 = _mm_and_si128(_mm_srli_epi16(x, 2), m);
        const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), m);
        const __m128i c3 = _mm_and_si128(_mm_srli_epi16(x, 6), m);
        const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpacklo_epi8(c2, c3);
        const __m128i a2 = _mm_unpackhi_epi8(c0, c1), b2 = _mm_unpackhi_epi8(c2, c3);
        _mm_storeu_si128((__m128i *)(cd + 4 * j), _mm_unpacklo_epi16(a, b));
        _mm_storeu_si128((__m128i *)(cd + 4 * j + 16), _mm_unpackhi_epi16(a, b));
        _mm_storeu_si128((__m128i *)(cd + 4 * j + 32), _mm_unpacklo_epi16(a2, b2));
        _mm_storeu_si128((__m128i *)(cd + 4 * j + 48), _mm_unpackhi_epi16(a2, b2));
    }
#endif
    for (; j < P; j++) memcpy(cd + 4 * j, &CRUMB[row[j]], 4);
}

#ifdef __F16C__
#define H2F(h) _cvtsh_ss(h) /* one instruction, where the bit twiddling costs a few dozen */
#else
#define H2F(h) f16_to_f32(h)
#endif

typedef struct {
    int fmt, D, bs, KVH, bits, group, e4m3;
    const uint8_t *k_codes, *v_codes;
    const float *lut, *k_head_scale, *v_head_scale;      /* lut: KIVI key scales or fp8 codes */
    const uint16_t *k_tok_scale, *v_tok_scale;           /* int8 */
    const uint8_t *k_meta; const float *k_base;          /* kivi keys */
    const uint16_t *v_scale, *v_zero;                    /* kivi values */
    const int64_t *res_of_block; const void *res_k, *res_v; int res_dtype;
    const float *q_rot; /* KIVI with rotated keys: q times the rotation, for quantized blocks */
} Cache;

static void load_residual(const void *base, int64_t row0, int n, int D, int dt, float *dst) {
    if (dt == DT_F32) { memcpy(dst, (const float *)base + row0 * D, sizeof(float) * n * D); return; }
    const uint16_t *p = (const uint16_t *)base + row0 * D;
    for (int i = 0; i < n * D; i++) dst[i] = dt == DT_BF16 ? bf16_to_f32(p[i]) : f16_to_f32(p[i]);
}

/* Decode rows [lo, hi) of block blk, KV head hk, into tile[t][d] (K when is_key, else V). */
static void decode_tile(const Cache *c, int64_t blk, int hk, int lo, int hi, int is_key,
                        float *tile) {
    const int D = c->D, bs = c->bs;
    const int64_t bh = blk * c->KVH + hk;
    if (c->fmt == FMT_KIVI && c->res_of_block[blk] >= 0) {
        const int64_t r = c->res_of_block[blk] * c->KVH + hk;
        for (int t = lo; t < hi; t++)
            load_residual(is_key ? c->res_k : c->res_v, r * bs + t, 1, D, c->res_dtype, tile + t * D);
        return;
    }
    const uint8_t *codes = is_key ? c->k_codes : c->v_codes;
    if (c->fmt == FMT_FP8) {
        const float s = (is_key ? c->k_head_scale : c->v_head_scale)[hk];
        for (int t = lo; t < hi; t++) {
            const uint8_t *row = codes + (bh * bs + t) * D;
            float *dst = tile + t * D;
            int d = 0;
#ifdef __F16C__
            /* fp8 -> float16 bits with shifts (e5m2 is float16's top byte; e4m3's exponent
             * bias is 8 less: x 2**8), then the hardware conversion, 8 lanes at a time. */
            const __m256 sv = _mm256_set1_ps(c->e4m3 ? s * 256.f : s);
            const __m128i m80 = _mm_set1_epi16(0x80), m7f = _mm_set1_epi16(0x7f);
            for (; d + 8 <= D; d += 8) {
                const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + d)));
                const __m128i h = c->e4m3
                    ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, m80), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, m7f), 7))
                    : _mm_slli_epi16(w, 8);
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), sv));
            }
#endif
            for (; d < D; d++) dst[d] = c->lut[row[d]] * s;
        }
    } else if (c->fmt == FMT_INT8) {
        const uint16_t *sc = (is_key ? c->k_tok_scale : c->v_tok_scale) + bh * bs;
        for (int t = lo; t < hi; t++) {
            const int8_t *row = (const int8_t *)codes + (bh * bs + t) * D;
            const float s = H2F(sc[t]);
#pragma omp simd
            for (int d = 0; d < D; d++) tile[t * D + d] = (float)row[d] * s;
        }
    } else {
        float s[MAX_D], z[MAX_D];
        uint8_t cd[MAX_D];
        if (is_key) { /* per-channel scale and zero of this block: lut[i] = 2**(-i/8) */
            const uint8_t *meta = c->k_meta + bh * 2 * D;
            const float *base = c->k_base + bh * 3;
            for (int d = 0; d < D; d++) {
                s[d] = base[2] * c->lut[meta[D + d]];
                z[d] = base[0] + (float)meta[d] * base[1];
            }
        }
        const int P = D * c->bits / 8, NG = D / c->group, gs = c->group;
        for (int t = lo; t < hi; t++) {
            const uint8_t *row = codes + (bh * bs + t) * P;
            if (c->bits == 4) unpack4(row, P, cd);
            else unpack2(row, P, cd);
            float *dst = tile + t * D;
            if (is_key) {
#pragma omp simd
                for (int d = 0; d < D; d++) dst[d] = (float)cd[d] * s[d] + z[d];
            } else {
                const uint16_t *vs = c->v_scale + (bh * bs + t) * NG, *vz = c->v_zero + (bh * bs + t) * NG;
                for (int g = 0; g < NG; g++) {
                    const float sg = H2F(vs[g]), zg = H2F(vz[g]);
#pragma omp simd
                    for (int d = g * gs; d < (g + 1) * gs; d++) dst[d] = (float)cd[d] * sg + zg;
                }
            }
        }
    }
}

/* Scores q.k for rows [lo, hi) of a block, from its decoded tile. (Folding KIVI's
 * per-channel scale and zero into the query instead measured slower here: the per-block
 * fold costs more than the 16 rows it saves.) */
static void key_scores(const Cache *c, int64_t blk, int hk, int lo, int hi, int G,
                       float qs[][MAX_D], float sc[][MAX_BS], float *kt) {
    const int D = c->D;
    decode_tile(c, blk, hk, lo, hi, 1, kt);
    for (int t = lo; t < hi; t++)
        for (int g = 0; g < G; g++) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qs[g][d] * kt[t * D + d];
            sc[g][t] = dot;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The AVX-512 (F, BW, VL) path: one K or V row at a time is converted from its codes into float32
 * registers (16 lanes per vector, D / 16 vectors) and used by all G query heads of the
 * group, with no float tile in between. Per-row scalar factors (the fp8 head scale, the int8
 * token scale) scale the score or the softmax weight, not every element.
 *
 * KIVI codes are not unpacked into channel order: 16 packed bytes widen to 16 lanes and each
 * shift by `bits` yields one vector, so lane i of vector v holds channel perm[16 v + i]
 * (channels interleaved by the codes per byte). A dot product and a weighted sum do not care
 * about channel order as long as both sides agree, so the task permutes its query rows once,
 * keeps its output accumulator permuted and un-permutes it when writing out; the per-channel
 * key scales are built permuted, value group scales are spread to lanes with one permute, and
 * the rare full-precision residual rows are gathered into the same order. */
enum { RS_RES, RS_FP8, RS_INT8, RS_KIVI_K, RS_KIVI_V };

typedef struct {
    int kind, row_bytes, bits, ng, res_dt, e4m3;
    const int32_t *perm;               /* NULL: channel order; else lane j holds perm[j] */
    const __m512i *gidx;               /* KIVI values: value group of each lane */
    const uint8_t *codes;              /* this block's rows for this KV head */
    const void *res;                   /* residual rows (a KIVI block still filling) */
    const uint16_t *tok_scale;         /* int8: one float16 scale per row */
    float head_scale;                  /* fp8 */
    float s[MAX_D], z[MAX_D];          /* KIVI keys: this block's per-lane scale and zero */
    const uint16_t *vs, *vz;           /* KIVI values: per row, per channel group */
} RowSrc;

/* Lane order of KIVI codes (see above); needs D a multiple of 16 codes-per-byte. */
static void kivi_lane_order(int D, int bits, int32_t *perm) {
    const int per = 8 / bits;
    for (int j = 0; j < D; j++) {
        const int v = j / 16, i = j % 16;
        perm[j] = (v / per) * 16 * per + per * i + v % per;
    }
}

static void row_source(const Cache *c, int64_t blk, int hk, int is_key, const int32_t *perm,
                       const __m512i *gidx, RowSrc *r) {
    const int D = c->D, bs = c->bs;
    const int64_t bh = blk * c->KVH + hk;
    r->e4m3 = c->e4m3;
    r->perm = perm;
    if (c->fmt == FMT_KIVI && c->res_of_block[blk] >= 0) {
        r->kind = RS_RES;
        r->res_dt = c->res_dtype;
        const size_t esz = c->res_dtype == DT_F32 ? 4 : 2;
        r->res = (const char *)(is_key ? c->res_k : c->res_v)
                 + (c->res_of_block[blk] * c->KVH + hk) * bs * D * esz;
        return;
    }
    const uint8_t *codes = is_key ? c->k_codes : c->v_codes;
    if (c->fmt == FMT_FP8) {
        r->kind = RS_FP8;
        r->row_bytes = D;
        r->codes = codes + bh * bs * D;
        const float sc = (is_key ? c->k_head_scale : c->v_head_scale)[hk];
        r->head_scale = c->e4m3 ? sc * 256.f : sc; /* e4m3 read as float16: x 2**-8 */
    } else if (c->fmt == FMT_INT8) {
        r->kind = RS_INT8;
        r->row_bytes = D;
        r->codes = codes + bh * bs * D;
        r->tok_scale = (is_key ? c->k_tok_scale : c->v_tok_scale) + bh * bs;
    } else {
        r->kind = is_key ? RS_KIVI_K : RS_KIVI_V;
        r->bits = c->bits;
        r->row_bytes = D * c->bits / 8;
        r->codes = codes + bh * bs * r->row_bytes;
        r->ng = D / c->group;
        r->gidx = gidx;
        if (is_key) {
            const uint8_t *meta = c->k_meta + bh * 2 * D;
            const float *base = c->k_base + bh * 3;
            for (int j = 0; j < D; j++) {
                const int d = perm[j];
                r->s[j] = base[2] * c->lut[meta[D + d]];
                r->z[j] = base[0] + (float)meta[d] * base[1];
            }
        } else {
            r->vs = c->v_scale + bh * bs * r->ng;
            r->vz = c->v_zero + bh * bs * r->ng;
        }
    }
}

/* A KIVI row's codes as float vectors in lane order; bits and nv are constants at each call
 * site, so x stays in registers. */
static inline __attribute__((always_inline)) void kivi_codes(const uint8_t *row, const int nv,
                                                             const int bits, __m512 *x) {
    const int per = 8 / bits;
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int cch = 0; cch < nv / per; cch++) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * cch)));
        for (int k = 0; k < per; k++)
            x[cch * per + k] =
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, bits * k), mask));
    }
}

/* Row t as nv vectors in x (lane order of r->perm); returns the row's scalar factor. */
static inline __attribute__((always_inline)) float load_row16(const RowSrc *r, int t,
                                                              const int nv, __m512 *x) {
    const int D = 16 * nv;
    const uint8_t *row = r->codes + (int64_t)t * r->row_bytes;
    switch (r->kind) {
    case RS_RES:
        if (r->perm == NULL) {
            for (int j = 0; j < nv; j++) x[j] = load16(r->res, (int64_t)t * D + 16 * j, r->res_dt);
        } else {
            float tmp[MAX_D];
            for (int j = 0; j < nv; j++)
                _mm512_storeu_ps(tmp + 16 * j, load16(r->res, (int64_t)t * D + 16 * j, r->res_dt));
            for (int j = 0; j < nv; j++)
                x[j] = _mm512_i32gather_ps(_mm512_loadu_si512(r->perm + 16 * j), tmp, 4);
        }
        return 1.f;
    case RS_FP8: /* fp8 -> float16 bits with shifts (see decode_tile), then F16C; 32 codes per
                  * integer step, the last 16 alone when nv is odd */
        for (int j = 0; j < nv; j += 2) {
            const __mmask32 m = j + 1 < nv ? 0xffffffffu : 0xffffu;
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, row + 16 * j));
            const __m512i h = r->e4m3
                ? _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8),
                                  _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7f)), 7))
                : _mm512_slli_epi16(w, 8);
            x[j] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
            if (j + 1 < nv) x[j + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        }
        return r->head_scale;
    case RS_INT8:
        for (int j = 0; j < nv; j++)
            x[j] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * j))));
        return H2F(r->tok_scale[t]);
    default: {
        if (r->bits == 2) kivi_codes(row, nv, 2, x);
        else kivi_codes(row, nv, 4, x);
        if (r->kind == RS_KIVI_K) {
            for (int j = 0; j < nv; j++)
                x[j] = _mm512_fmadd_ps(x[j], _mm512_loadu_ps(r->s + 16 * j),
                                       _mm512_loadu_ps(r->z + 16 * j));
        } else if (r->ng == 1) {
            const __m512 sv = _mm512_set1_ps(H2F(r->vs[t])), zv = _mm512_set1_ps(H2F(r->vz[t]));
            for (int j = 0; j < nv; j++) x[j] = _mm512_fmadd_ps(x[j], sv, zv);
        } else { /* up to 16 groups: their scales in one vector, spread to the lanes */
            const __mmask16 m = (__mmask16)((1u << r->ng) - 1);
            const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, r->vs + (int64_t)t * r->ng));
            const __m512 zv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, r->vz + (int64_t)t * r->ng));
            for (int j = 0; j < nv; j++)
                x[j] = _mm512_fmadd_ps(x[j], _mm512_permutexvar_ps(r->gidx[j], sv),
                                       _mm512_permutexvar_ps(r->gidx[j], zv));
        }
        return 1.f;
    }
    }
}

static inline void prefetch_codes(const Cache *c, int64_t blk, int hk) {
    const int64_t bh = blk * c->KVH + hk;
    const int row_bytes = c->fmt == FMT_KIVI ? c->D * c->bits / 8 : c->D;
    const size_t n = (size_t)c->bs * row_bytes, off = (size_t)bh * n;
    for (size_t o = 0; o < n; o += 64) {
        _mm_prefetch((const char *)c->k_codes + off + o, _MM_HINT_T0);
        _mm_prefetch((const char *)c->v_codes + off + o, _MM_HINT_T0);
    }
    if (c->fmt == FMT_KIVI) { /* and the metadata: key channel codes, value scales and zeros */
        const int ng = c->D / c->group;
        for (int o = 0; o < 2 * c->D; o += 64) _mm_prefetch((const char *)(c->k_meta + bh * 2 * c->D) + o, _MM_HINT_T0);
        _mm_prefetch((const char *)(c->k_base + bh * 3), _MM_HINT_T0);
        for (int o = 0; o < c->bs * ng * 2; o += 64) {
            _mm_prefetch((const char *)(c->v_scale + bh * c->bs * ng) + o, _MM_HINT_T0);
            _mm_prefetch((const char *)(c->v_zero + bh * c->bs * ng) + o, _MM_HINT_T0);
        }
    } else if (c->fmt == FMT_INT8) {
        for (int o = 0; o < c->bs * 2; o += 64) {
            _mm_prefetch((const char *)(c->k_tok_scale + bh * c->bs) + o, _MM_HINT_T0);
            _mm_prefetch((const char *)(c->v_tok_scale + bh * c->bs) + o, _MM_HINT_T0);
        }
    }
}

/* q . x over nv vectors (q in memory, x in registers), not yet reduced. */
static inline __attribute__((always_inline)) __m512 qdot(const float *q, const __m512 *x,
                                                         const int nv) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), x[0]);
    for (int j = 1; j < nv; j++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), x[j], a);
    return a;
}

static inline __attribute__((always_inline)) void key_scores_avx512(
    const Cache *c, int64_t blk, int hk, int lo, int hi, int G, float qs[][MAX_D],
    float sc[][MAX_BS], const int32_t *perm, const __m512i *gidx, const int nv) {
    RowSrc r;
    row_source(c, blk, hk, 1, perm, gidx, &r);
    int t = lo;
    for (; t + 16 <= hi; t += 16) { /* 16 rows' dot products per head, reduced together */
        __m512 part[MAX_G][16], f = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) {
            __m512 x[MAX_D / 16];
            f = _mm512_mask_mov_ps(f, (__mmask16)(1u << i), _mm512_set1_ps(load_row16(&r, t + i, nv, x)));
            for (int g = 0; g < G; g++) part[g][i] = qdot(qs[g], x, nv);
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(sc[g] + t, _mm512_mul_ps(f, hsum16(part[g])));
    }
    for (; t < hi; t++) {
        __m512 x[MAX_D / 16];
        const float f = load_row16(&r, t, nv, x);
        for (int g = 0; g < G; g++) sc[g][t] = f * _mm512_reduce_add_ps(qdot(qs[g], x, nv));
    }
}

static inline __attribute__((always_inline)) void values_avx512(
    const Cache *c, int64_t blk, int hk, int lo, int hi, int G, float sc[][MAX_BS],
    float acc[][MAX_D], const int32_t *perm, const __m512i *gidx, const int nv) {
    RowSrc r;
    row_source(c, blk, hk, 0, perm, gidx, &r);
    for (int t = lo; t < hi; t++) {
        __m512 x[MAX_D / 16];
        const float f = load_row16(&r, t, nv, x);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(f * sc[g][t]);
            for (int j = 0; j < nv; j++)
                _mm512_storeu_ps(acc[g] + 16 * j,
                                 _mm512_fmadd_ps(p, x[j], _mm512_loadu_ps(acc[g] + 16 * j)));
        }
    }
}
#define HAVE_AVX512_PATH 1
#endif

int kvserve_quant_decode(const float *q, float *out, const int64_t *block_tables,
                         int64_t bt_stride, const int64_t *seq_lens, const int32_t *seq_windows,
                         int B, int H, int layer_window, float scale, const Cache *c,
                         int num_threads) {
    const int KVH = c->KVH, D = c->D, bs = c->bs;
    if (H % KVH || H / KVH > MAX_G || D > MAX_D || bs > MAX_BS) return -1;
    if (c->fmt == FMT_KIVI && (D % (8 / c->bits) || D % c->group)) return -1;
    for (int b = 0; b < B; b++) /* every key read must be in the table */
        if (seq_lens[b] < 0 || seq_lens[b] > bt_stride * bs) return -3;
    const int G = H / KVH;
#ifdef HAVE_AVX512_PATH
    /* KIVI lanes interleave the channels of 16-byte code chunks: D a multiple of 16 x codes
     * per byte. KVSERVE_QUANT_SCALAR=1 selects the portable path (tests compare both). */
    const int avx = D % 16 == 0 && getenv("KVSERVE_QUANT_SCALAR") == NULL
                    && (c->fmt != FMT_KIVI || (c->group % 16 == 0 && D % (128 / c->bits) == 0));
    int32_t lane_order[MAX_D];
    const int32_t *perm = NULL;
    __m512i gidx[MAX_D / 16];
    if (avx && c->fmt == FMT_KIVI) {
        kivi_lane_order(D, c->bits, lane_order);
        perm = lane_order;
        for (int j = 0; j < D / 16; j++) {
            int32_t g[16];
            for (int i = 0; i < 16; i++) g[i] = lane_order[16 * j + i] / c->group;
            gidx[j] = _mm512_loadu_si512(g);
        }
    }
#else
    const int32_t *perm = NULL;
#endif
    if (!tables_ready) init_tables(); /* called from one Python thread at a time (the GIL) */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < (int64_t)B * KVH; task++) {
        const int b = (int)(task / KVH), hk = (int)(task % KVH);
        float qs[MAX_G][MAX_D], qr[MAX_G][MAX_D], acc[MAX_G][MAX_D], sc[MAX_G][MAX_BS];
        float kt[bs * D], vt[bs * D]; /* one block tile each, a few KiB */
        float m[MAX_G], l[MAX_G];
        for (int g = 0; g < G; g++) {
            const int64_t row = ((int64_t)b * H + hk * G + g) * D;
            for (int d = 0; d < D; d++) { /* in the lane order of the stored rows */
                const int64_t src = row + (perm ? perm[d] : d);
                qs[g][d] = q[src] * scale;
                if (c->q_rot) qr[g][d] = c->q_rot[src] * scale;
                acc[g][d] = 0.f;
            }
            m[g] = -FLT_MAX;
            l[g] = 0.f;
        }
        const int64_t L = seq_lens[b];
        /* the smaller non-zero of the layer's window and the sequence's retention window */
        const int sw = seq_windows ? seq_windows[b] : 0;
        const int window = sw > 0 && (layer_window <= 0 || sw < layer_window) ? sw : layer_window;
        const int64_t start = (window > 0 && L > window) ? L - window : 0;
        for (int64_t t0 = (start / bs) * bs; t0 < L; t0 += bs) {
            const int64_t blk = block_tables[(int64_t)b * bt_stride + t0 / bs];
            const int lo = (int)(start > t0 ? start - t0 : 0);
            const int hi = (int)(L - t0 < bs ? L - t0 : bs);
            /* rotated keys (quantized KIVI blocks) meet the rotated query */
            float(*qk)[MAX_D] = c->q_rot && c->res_of_block[blk] < 0 ? qr : qs;
#ifdef HAVE_AVX512_PATH
            if (avx && t0 + bs < L) /* scattered blocks: start fetching the next one's codes */
                prefetch_codes(c, block_tables[(int64_t)b * bt_stride + t0 / bs + 1], hk);
            if (avx) {
                switch (D) { /* a constant vector count at the common head sizes */
                case 64: key_scores_avx512(c, blk, hk, lo, hi, G, qk, sc, perm, gidx, 4); break;
                case 128: key_scores_avx512(c, blk, hk, lo, hi, G, qk, sc, perm, gidx, 8); break;
                default: key_scores_avx512(c, blk, hk, lo, hi, G, qk, sc, perm, gidx, D / 16);
                }
            } else
#endif
            key_scores(c, blk, hk, lo, hi, G, qk, sc, kt);
            for (int g = 0; g < G; g++) {
                float mx = m[g];
                for (int t = lo; t < hi; t++) mx = sc[g][t] > mx ? sc[g][t] : mx;
                const float corr = expf(m[g] - mx);
                float sum = l[g] * corr;
                for (int t = lo; t < hi; t++) { sc[g][t] = expf(sc[g][t] - mx); sum += sc[g][t]; }
                if (corr != 1.f)
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[g][d] *= corr;
                m[g] = mx;
                l[g] = sum;
            }
#ifdef HAVE_AVX512_PATH
            if (avx) {
                switch (D) {
                case 64: values_avx512(c, blk, hk, lo, hi, G, sc, acc, perm, gidx, 4); break;
                case 128: values_avx512(c, blk, hk, lo, hi, G, sc, acc, perm, gidx, 8); break;
                default: values_avx512(c, blk, hk, lo, hi, G, sc, acc, perm, gidx, D / 16);
                }
                continue;
            }
#endif
            decode_tile(c, blk, hk, lo, hi, 0, vt);
            for (int t = lo; t < hi; t++)
                for (int g = 0; g < G; g++) {
                    const float p = sc[g][t];
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[g][d] += p * vt[t * D + d];
                }
        }
        for (int g = 0; g < G; g++) {
            float *op = out + ((int64_t)b * H + hk * G + g) * D;
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
            for (int d = 0; d < D; d++) op[perm ? perm[d] : d] = acc[g][d] * inv;
        }
    }
    return 0;
}
