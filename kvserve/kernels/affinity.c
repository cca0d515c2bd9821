/* Pin the calling thread's OpenMP workers, one CPU each (kvserve/kernels/openmp.py).
 *
 * A pool's workers are team members 1..n-1 of every parallel region the calling thread
 * starts with n threads, the same OS threads each time (libgomp reuses its pool in order), so
 * pinning them once holds until the pool is freed. The calling thread (member 0) is left
 * alone: the caller pins it for the length of a step only.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Pins member t of an n-thread team to cpus[t] for t >= 1; returns how many it pinned (n - 1
 * on success; fewer when the runtime gave a smaller team or the OS refused a CPU). */
int kvserve_pin_team(const int *cpus, int n) {
    int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
    {
        int t = omp_get_thread_num();
        if (t > 0 && omp_get_num_threads() == n) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[t], &set);
            pinned += sched_setaffinity(0, sizeof set, &set) == 0;
        }
    }
    return pinned;
}
