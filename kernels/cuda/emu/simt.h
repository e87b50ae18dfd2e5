#pragma once
// simt.h: a minimal host emulation of the CUDA execution model, to run the kernel sources of
// kernels/cuda/*.cu on the CPU (see run.sh). One std::thread per CUDA thread, a std::barrier per
// block for __syncthreads, a barrier per warp for shuffles (so shuffles must be reached by all 32
// lanes, as the kernels are written). Blocks run one after another; __shared__ becomes a static
// local (one instance per kernel instantiation, shared by the block's threads).
// What it checks: indexing, tiling, masking, synchronisation and reduction logic of the kernel
// code. What it does not: device numerics (host libm, no fused multiply-add contraction), memory
// model subtleties, performance, or anything about the real compiler. bf16/f16 are stand-ins.
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <algorithm>
using std::isnan; using std::isinf;
struct dim3_ { unsigned x = 0, y = 0, z = 0; };
thread_local dim3_ threadIdx, blockIdx;
dim3_ blockDim, gridDim;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(x)
static std::barrier<> *g_block_bar;
static std::barrier<> *g_warp_bar[32];
static uint64_t g_xbuf[32][32];
static int g_or_buf;
static std::atomic<int> g_or_acc;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int __syncthreads_or(int p) {
    g_block_bar->arrive_and_wait();
    if (threadIdx.x == 0) g_or_acc = 0;
    g_block_bar->arrive_and_wait();
    if (p) g_or_acc = 1;
    g_block_bar->arrive_and_wait();
    int r = g_or_acc;
    g_block_bar->arrive_and_wait();
    return r;
}
template <typename V> V shfl_impl(V v, int src_lane) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    uint64_t b = 0; std::memcpy(&b, &v, sizeof(V));
    g_xbuf[w][l] = b;
    g_warp_bar[w]->arrive_and_wait();
    uint64_t r = g_xbuf[w][src_lane & 31];
    g_warp_bar[w]->arrive_and_wait();
    V out; std::memcpy(&out, &r, sizeof(V)); return out;
}
template <typename V> V __shfl_xor_sync(unsigned, V v, int o) { return shfl_impl(v, (threadIdx.x & 31) ^ o); }
template <typename V> V __shfl_sync(unsigned, V v, int s) { return shfl_impl(v, s); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) { return (unsigned long long)(((unsigned __int128)a * b) >> 64); }
inline float __double2float_rn(double d) { return (float)d; }
static std::mutex g_atomic_mu;
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) { std::lock_guard<std::mutex> g(g_atomic_mu); auto o = *p; if (v < o) *p = v; return o; }
inline float atomicAdd(float *p, float v) { std::lock_guard<std::mutex> g(g_atomic_mu); auto o = *p; *p = o + v; return o; }
inline double atomicAdd(double *p, double v) { std::lock_guard<std::mutex> g(g_atomic_mu); auto o = *p; *p = o + v; return o; }
// bf16 / f16 stand-ins (round to nearest even from float; only what the kernels use).
struct __nv_bfloat16 { uint16_t b; };
struct __half { uint16_t b; };
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { uint32_t u; std::memcpy(&u, &f, 4); if (std::isnan(f)) return {0x7fc0}; u += 0x7fff + ((u >> 16) & 1); return {(uint16_t)(u >> 16)}; }
inline __nv_bfloat16 __double2bfloat16(double d) { return __float2bfloat16_rn((float)d); } // (double rounding; emulation only)
inline float __half2float(__half h) { _Float16 x; std::memcpy(&x, &h.b, 2); return (float)x; }
inline __half __float2half_rn(float f) { _Float16 x = (_Float16)f; __half h; std::memcpy(&h.b, &x, 2); return h; }
inline __half __double2half(double d) { _Float16 x = (_Float16)d; __half h; std::memcpy(&h.b, &x, 2); return h; }

// Launch: runs every block in turn, blockDim threads each.
inline void launch(dim3_ grid, dim3_ block, const std::function<void()> &k) {
    gridDim = grid; blockDim = block;
    int nthreads = block.x, nwarps = (nthreads + 31) / 32;
    for (unsigned by = 0; by < std::max(1u, grid.y); ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> bar(nthreads);
            std::vector<std::unique_ptr<std::barrier<>>> wb;
            for (int w = 0; w < nwarps; ++w) { wb.emplace_back(new std::barrier<>(32)); g_warp_bar[w] = wb.back().get(); }
            g_block_bar = &bar;
            std::vector<std::thread> ts;
            for (int t = 0; t < nthreads; ++t)
                ts.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; k(); });
            for (auto &t : ts) t.join();
        }
}
