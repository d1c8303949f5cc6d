// simt_cpu.h -- a small SIMT emulation so g++ can compile and run the SAME .cu kernel sources on
// the CPU (CI has no GPU). Force-included in the emulation build:
//
//   g++ -x c++ -std=c++17 -O2 -fPIC -shared -include worker/kernels/simt_cpu.h <all .cu> -o lib.so
//
// Model:
//  * One block runs at a time; every thread of that block is a fiber (ucontext, own small stack)
//    in ONE OS thread. So `__shared__` can simply be `static`: a static local is shared by all
//    fibers of the running block, exactly like shared memory (and, like shared memory, it holds
//    garbage from the previous block: kernels must not rely on its initial content).
//  * A fiber runs until a switch point: __syncthreads() (block barrier) or a warp shuffle (warp
//    barrier), or until it returns. The scheduler releases a block barrier when every live thread of
//    the block waits there, and a warp barrier when every live lane of that warp waits there.
//    Threads that have exited do not hold barriers back (as on Volta and later).
//  * Anything else (a warp waiting on a shuffle while another lane of it waits on __syncthreads,
//    i.e. divergent collectives) is reported as a deadlock: the launch fails with an error code.
//  * Launches are serialized by a mutex (shared-memory statics are process-wide).
//  * The order in which ready fibers run between switch points, and blocks run in a grid, is a
//    schedule (simt_schedule.h): the natural FORWARD one, or hostile ones that expose races.
#pragma once
#ifdef __CUDACC__
#error "simt_cpu.h is the CPU emulation header; do not include it in CUDA builds"
#endif

#include <ucontext.h>

#include "simt_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <vector>

// ---------------------------------------------------------------- CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __constant__ static const
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#ifndef __restrict__
#define __restrict__ __restrict
#endif
#define warpSize 32

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };

// ---------------------------------------------------------------- math
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
using std::min;
using std::max;

// ---------------------------------------------------------------- half / bfloat16 storage types
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit storage types");

inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.x, 2);
    return static_cast<float>(f);
}
inline __half __float2half(float v) {  // round to nearest even, like __float2half on the device
    _Float16 f = static_cast<_Float16>(v);
    __half h;
    std::memcpy(&h.x, &f, 2);
    return h;
}
inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = static_cast<uint32_t>(b.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float v) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &v, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = static_cast<uint16_t>((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        b.x = static_cast<uint16_t>(u >> 16);
    }
    return b;
}

// ---------------------------------------------------------------- the fiber runtime
namespace simt {

enum State : int { READY = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };

struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;
    dim3 tid;
    int linear = 0;
    int state = DONE;
    unsigned shfl_parity = 0;
};

constexpr size_t kStackBytes = 64 * 1024;
constexpr int kMaxThreads = 1024;

inline std::vector<Fiber>& fibers() { static std::vector<Fiber> f; return f; }
inline Fiber*& current() { static Fiber* c = nullptr; return c; }
inline ucontext_t& scheduler_ctx() { static ucontext_t u; return u; }
inline dim3& block_idx() { static dim3 d; return d; }
inline dim3& block_dim() { static dim3 d; return d; }
inline dim3& grid_dim() { static dim3 d; return d; }
inline std::function<void()>*& body() { static std::function<void()>* b = nullptr; return b; }
inline std::mutex& launch_mutex() { static std::mutex m; return m; }
// Per-warp exchange buffers, double-buffered by shuffle parity: a lane writes slot [parity][lane],
// all lanes meet at the warp barrier, then read. The next shuffle uses the other half, and the one
// after that cannot start before every lane has passed the barrier in between (so has read).
inline uint64_t (&shfl_buf())[kMaxThreads / 32][2][32] {
    static uint64_t b[kMaxThreads / 32][2][32];
    return b;
}

inline void yield(State s) {
    Fiber* f = current();
    f->state = s;
    swapcontext(&f->ctx, &scheduler_ctx());
}

inline void trampoline() {
    (*body())();
    current()->state = DONE;  // uc_link returns to the scheduler
}

// Run one block: all threads as fibers, switching at barriers. Returns 0, or -1 on deadlock.
inline int run_block(int nthreads) {
    std::vector<Fiber>& fs = fibers();
    const dim3 bd = block_dim();
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fs[i];
        if (!f.stack) f.stack = static_cast<char*>(std::malloc(kStackBytes));
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = &scheduler_ctx();
        makecontext(&f.ctx, trampoline, 0);
        f.linear = i;
        f.tid = dim3(i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y));
        f.state = READY;
        f.shfl_parity = 0;
    }
    const int nwarps = (nthreads + 31) / 32;
    static std::vector<int> order;
    for (;;) {
        round_order(order, nthreads);
        for (int i : order) {
            if (fs[i].state != READY) continue;
            current() = &fs[i];
            swapcontext(&scheduler_ctx(), &fs[i].ctx);
        }
        current() = nullptr;
        // Every fiber now waits at a barrier or is done.
        bool released = false;
        for (int w = 0; w < nwarps; ++w) {
            const int lo = w * 32, hi = std::min(nthreads, lo + 32);
            bool any = false, all = true;
            for (int i = lo; i < hi; ++i) {
                if (fs[i].state == DONE) continue;
                any = true;
                if (fs[i].state != WAIT_WARP) all = false;
            }
            if (any && all) {
                for (int i = lo; i < hi; ++i)
                    if (fs[i].state == WAIT_WARP) fs[i].state = READY;
                released = true;
            }
        }
        if (released) continue;
        bool alive = false, all_block = true;
        for (int i = 0; i < nthreads; ++i) {
            if (fs[i].state == DONE) continue;
            alive = true;
            if (fs[i].state != WAIT_BLOCK) all_block = false;
        }
        if (!alive) return 0;
        if (all_block) {
            for (int i = 0; i < nthreads; ++i)
                if (fs[i].state == WAIT_BLOCK) fs[i].state = READY;
            continue;
        }
        std::fprintf(stderr, "simt: deadlock in block (%u,%u,%u): divergent barrier/shuffle\n",
                     block_idx().x, block_idx().y, block_idx().z);
        return -1;
    }
}

// launch(kernel, grid, block, args...): blocks run one after another, in x-fastest order under
// FORWARD, last to first under REVERSE, in a seeded random order under RANDOM and WARPS.
template <typename... P, typename... A>
int launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    const long nthreads = static_cast<long>(block.x) * block.y * block.z;
    if (nthreads <= 0 || nthreads > kMaxThreads) return -2;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return 0;
    std::lock_guard<std::mutex> lock(launch_mutex());
    std::vector<Fiber>& fs = fibers();
    if (fs.size() < static_cast<size_t>(nthreads)) fs.resize(nthreads);
    std::function<void()> fn = [&]() { kernel(static_cast<P>(args)...); };
    body() = &fn;
    grid_dim() = grid;
    block_dim() = block;
    std::vector<uint64_t> blocks;
    block_order(blocks, static_cast<uint64_t>(grid.x) * grid.y * grid.z);
    for (uint64_t b : blocks) {
        block_idx() = dim3(static_cast<unsigned>(b % grid.x),
                           static_cast<unsigned>(b / grid.x % grid.y),
                           static_cast<unsigned>(b / (static_cast<uint64_t>(grid.x) * grid.y)));
        if (run_block(static_cast<int>(nthreads)) != 0) {
            // Abandon the stuck fibers: their stacks are re-initialised by the next launch.
            for (int i = 0; i < nthreads; ++i) fs[i].state = DONE;
            body() = nullptr;
            return -1;
        }
    }
    body() = nullptr;
    return 0;
}

inline void syncthreads() { yield(WAIT_BLOCK); }

template <typename T>
inline T exchange(T v, int src_lane_in_warp) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    Fiber* f = current();
    const int warp = f->linear / 32, lane = f->linear % 32;
    const unsigned par = f->shfl_parity;
    f->shfl_parity ^= 1u;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    shfl_buf()[warp][par][lane] = bits;
    yield(WAIT_WARP);
    T out;
    std::memcpy(&out, &shfl_buf()[warp][par][src_lane_in_warp], sizeof(T));
    return out;
}

inline int lane_id() { return current()->linear % 32; }

}  // namespace simt

#define threadIdx (::simt::current()->tid)
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())

inline void __syncthreads() { ::simt::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::simt::yield(::simt::WAIT_WARP); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    const int lane = ::simt::lane_id();
    // PTX shfl.bfly: a source past the end of the lane's own group of `width` gives the lane's own
    // value; one in an earlier group is read (CUDA's guide: "earlier groups" only)
    int src = lane ^ (lane_mask & 31);
    if (src > ((lane & ~(width - 1)) | (width - 1))) src = lane;
    return ::simt::exchange(v, src);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = ::simt::lane_id();
    const int seg = lane & ~(width - 1);
    int src = lane + static_cast<int>(delta);
    if (src >= seg + width) src = lane;
    return ::simt::exchange(v, src);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = ::simt::lane_id();
    const int seg = lane & ~(width - 1);
    int src = lane - static_cast<int>(delta);
    if (src < seg) src = lane;
    return ::simt::exchange(v, src);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    const int lane = ::simt::lane_id();
    return ::simt::exchange(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}

// Picks the schedule of every later launch (mode: 0 FORWARD, 1 REVERSE, 2 RANDOM, 3 WARPS; seed for
// the random ones). Weak: one definition however many translation units include this header.
extern "C" __attribute__((weak, visibility("default"))) int simt_set_schedule(int mode,
                                                                             uint64_t seed) {
    if (mode < ::simt::FORWARD || mode > ::simt::WARPS) return -1;
    std::lock_guard<std::mutex> lock(::simt::launch_mutex());
    ::simt::schedule().mode = mode;
    ::simt::schedule().rng = seed;
    return 0;
}

// Host wrappers for the emulation build: kernels/*.cu use SIMT_EMU_ENTRY(...) to export
// `emu_<name>(gx, gy, gz, bx, by, bz, params...)` for ctypes; it is empty under nvcc.
#define SIMT_EMU_ENTRY(NAME, PARAMS, ARGS)                                                  \
    extern "C" int emu_##NAME(unsigned gx, unsigned gy, unsigned gz, unsigned bx,            \
                              unsigned by, unsigned bz, PARAMS) {                            \
        return ::simt::launch(NAME, dim3(gx, gy, gz), dim3(bx, by, bz), ARGS);               \
    }
