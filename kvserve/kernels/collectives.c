/* One collective of the shared-memory communicator (kvserve/distributed/shm_communicator.py)
 * in one call: copy this rank's tensor into its buffer of the segment, raise its flag, spin
 * until every peer's flag has reached the same sequence number, and sum the ranks' buffers in
 * rank order into the tensor.
 *
 * The same steps written as torch ops in Python (slice views of the segment, copy_, a flag
 * store through a memoryview, torch.add) spend more time in the interpreter and the
 * dispatcher than in the copy and the sum of a decode step's few kilobytes, and a
 * tensor-parallel decode step runs two collectives per layer.
 *
 * The segment's layout is the communicator's: world_size header slots of `slot` bytes (a
 * rank's flag is the first int64 of its slot), then two sets of world_size buffers of
 * `buffer_bytes`, the set chosen by the sequence number's parity. Flags are stored with
 * release and loaded with acquire order, so the data a flag announces is visible once the
 * flag is.
 *
 * The sum rounds where the torch reference rounds: a bfloat16 sum is rounded to bfloat16
 * after each rank's addition, as torch.add then add_ do. Compiled without -ffast-math and
 * with -ffp-contract=off, so the additions are neither reordered nor fused: every rank
 * computes the same bits.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kvserve_kernels.h"

enum { PUBLISH = 1, AWAIT = 2, REDUCE = 4 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t *flag_of(char *segment, int64_t slot, int rank) {
    return (int64_t *)(segment + rank * slot);
}

/* out = b[0] + b[1] + ... + b[world-1], in that order, `n` elements of dtype `dt`. */
static void sum_ranks(void *out, char *const *b, int world, int64_t n, int dt) {
    if (dt == DT_F32) {
        float *o = out;
        const float *b0 = (const float *)b[0], *b1 = (const float *)b[1];
        for (int64_t i = 0; i < n; i++)
            o[i] = b0[i] + b1[i];
        for (int r = 2; r < world; r++) {
            const float *br = (const float *)b[r];
            for (int64_t i = 0; i < n; i++)
                o[i] += br[i];
        }
        return;
    }
    uint16_t *o = out; /* DT_BF16 */
    const uint16_t *b0 = (const uint16_t *)b[0], *b1 = (const uint16_t *)b[1];
    for (int64_t i = 0; i < n; i++)
        o[i] = f32_to_bf16(bf16_to_f32(b0[i]) + bf16_to_f32(b1[i]));
    for (int r = 2; r < world; r++) {
        const uint16_t *br = (const uint16_t *)b[r];
        for (int64_t i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(br[i]));
    }
}

/* One communicator's segment and place in it (ShmLayout in collectives.py): the arguments
 * every call shares, passed as one pointer, since each argument of a ctypes call costs. */
typedef struct {
    char *segment;
    int64_t slot, header, buffer_bytes, spin_ns;
    int32_t rank, world;
} shm_layout;

/* Runs the `phases` asked for (PUBLISH | AWAIT | REDUCE) of collective `seq` over `nbytes` at
 * `data` (REDUCE: float32 or bfloat16, `dt`). Returns 0 when all of them ran; 1 when a peer
 * had not reached `seq` within the layout's `spin_ns` of spinning (this rank's data is
 * published: the caller waits on, sleeping and watching its peers, then asks for REDUCE
 * alone); -1 for a dtype REDUCE does not handle or a world size outside 2..64. */
int kvserve_shm_collective(const shm_layout *c, int64_t seq, void *data, int64_t nbytes, int dt,
                           int phases) {
    char *segment = c->segment;
    const int world = c->world, rank = c->rank;
    const int64_t slot = c->slot, buffer_bytes = c->buffer_bytes;
    if (world < 2 || world > 64 || ((phases & REDUCE) && dt != DT_F32 && dt != DT_BF16))
        return -1;
    char *set = segment + c->header + (seq & 1) * (int64_t)world * buffer_bytes;
    if (phases & PUBLISH) {
        memcpy(set + rank * buffer_bytes, data, (size_t)nbytes);
        __atomic_store_n(flag_of(segment, slot, rank), seq, __ATOMIC_RELEASE);
    }
    if (phases & AWAIT) {
        int64_t start = 0;
        for (int r = 0; r < world; r++) {
            const int64_t *flag = flag_of(segment, slot, r);
            unsigned spins = 0;
            while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq) {
                cpu_relax();
                if ((++spins & 63) == 0) { /* the clock every 64 pauses */
                    const int64_t t = now_ns();
                    if (start == 0)
                        start = t;
                    else if (t - start > c->spin_ns)
                        return 1;
                }
            }
        }
    }
    if (phases & REDUCE) {
        char *bufs[64];
        for (int r = 0; r < world; r++)
            bufs[r] = set + r * buffer_bytes;
        sum_ranks(data, bufs, world, nbytes / (dt == DT_F32 ? 4 : 2), dt);
    }
    return 0;
}
