/* Peak arithmetic rate of one core, instruction by instruction: a loop of independent
 * float32 FMAs (vfmadd231ps, 32 FLOPs per 512-bit instruction) and one of AVX512-BF16 dot
 * products (vdpbf16ps, 64 FLOPs). Twelve accumulators hide each instruction's latency, so the
 * loops measure throughput: the ceiling any GEMM of that dtype can reach on this core.
 * Each function returns GFLOP/s, or -1 where the build machine lacks the instruction. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* The accumulators' sum, written where the compiler cannot drop the loop that made it. */
static void keep(const __m512 *acc, float *sink) {
    float s = 0.f;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
    *sink = s;
}
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

double kvserve_peak_fma_f32(int64_t iters, float *sink) {
#if defined(__AVX512F__)
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
    __m512 x = _mm512_set1_ps(1.0001f);
    const __m512 y = _mm512_set1_ps(0.9999f);
    const double t = now();
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
        __asm__ volatile("" : "+v"(x)); /* keep the loop from being folded */
    }
    const double dt = now() - t;
    keep(acc, sink);
    return (double)iters * 12 * 32 / dt / 1e9;
#else
    (void)iters, (void)sink;
    return -1.0;
#endif
}

double kvserve_peak_dot_bf16(int64_t iters, float *sink) {
#if defined(__AVX512BF16__)
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double t = now();
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    const double dt = now() - t;
    keep(acc, sink);
    return (double)iters * 12 * 64 / dt / 1e9;
#else
    (void)iters, (void)sink;
    return -1.0;
#endif
}
