// simt_schedule.h -- the order in which the SIMT emulation (simt_cpu.h) runs the fibers of a block
// between switch points, and the blocks of a grid.
//
// A GPU promises no order between the threads of a block, nor between blocks, so a kernel whose
// result depends on the order has a race: a missing __syncthreads, a read of shared memory before a
// neighbour's write. The natural order (FORWARD: fiber 0 first, blocks x-fastest) hides every race
// in which the reader comes after the writer. The hostile schedules:
//   REVERSE  fibers, and blocks, last to first;
//   RANDOM   a fresh seeded permutation of the fibers at every round between barriers, and of the
//            blocks of every launch;
//   WARPS    warps (and blocks) in a fresh seeded random order, the lanes of each warp in order.
// A race-free kernel gives bit-identical results under every schedule (each output is computed by
// one thread with a fixed order of operations). The random state advances from the seed through
// the launches of the process, so a given seed and sequence of launches replays exactly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace simt {

enum Schedule : int { FORWARD = 0, REVERSE = 1, RANDOM = 2, WARPS = 3 };

struct ScheduleState {
    int mode = FORWARD;
    uint64_t rng = 0;
};
inline ScheduleState& schedule() { static ScheduleState s; return s; }

inline uint64_t next_random() {  // splitmix64: small, seedable, good enough to shuffle
    uint64_t z = (schedule().rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <typename I>
inline void shuffle(std::vector<I>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

// The order of one round over the fibers of a block: every READY fiber runs to its next switch
// point, in this order.
inline void round_order(std::vector<int>& order, int nthreads) {
    order.resize(nthreads);
    std::iota(order.begin(), order.end(), 0);
    const int mode = schedule().mode;
    if (mode == REVERSE) {
        std::reverse(order.begin(), order.end());
    } else if (mode == RANDOM) {
        shuffle(order);
    } else if (mode == WARPS) {
        std::vector<int> warps((nthreads + 31) / 32);
        std::iota(warps.begin(), warps.end(), 0);
        shuffle(warps);
        int k = 0;
        for (int w : warps)
            for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); ++i) order[k++] = i;
    }
}

// The order of the blocks of a launch, as linear indices (x fastest).
inline void block_order(std::vector<uint64_t>& blocks, uint64_t nblocks) {
    blocks.resize(nblocks);
    std::iota(blocks.begin(), blocks.end(), uint64_t{0});
    const int mode = schedule().mode;
    if (mode == REVERSE) std::reverse(blocks.begin(), blocks.end());
    if (mode == RANDOM || mode == WARPS) shuffle(blocks);
}

}  // namespace simt
