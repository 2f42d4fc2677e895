// The SIMT runtime of the CUDA simulator (tests/simt): what the stand-in CUDA headers
// (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h beside this directory) give the unmodified kernel sources
// in plugins/kernels/cuda when g++ compiles them as C++20 with -DATTNCAL_SIMT.
//
// * A block runs with one OS thread per CUDA thread (a pool of std::threads, reused across blocks;
//   the blocks of a grid run one after another; the pool shares one CPU, SIMT_CPU, since a launch's
//   time is its thread switches).  threadIdx / blockIdx / blockDim / gridDim are
//   thread_local.  Within a block the start order and extra yields at every synchronisation point are
//   drawn from a seeded generator (SIMT_SEED), so runs are reproducible in what the runtime decides and
//   still interleave for real.
// * __syncthreads is a counting barrier that records its call site: threads waiting at different sites
//   (divergence), a barrier reached after some thread of the block exited, and a wait longer than
//   SIMT_TIMEOUT_S seconds (deadlock) are errors that name the kernel, the block, the thread and the
//   site.  The launch then fails (cudaGetLastError), and the other threads stop at their next
//   synchronisation point.
// * Warp collectives (__shfl_*_sync, __syncwarp, and the PTX models' ldmatrix and mma.sync) exchange
//   values among the 32 lanes of a warp: the lanes of the mask must all arrive at the same call site with
//   the same mask; a calling lane outside the mask, a source lane outside it, a lane of the mask that
//   exited or does not exist are errors.
// * Dynamic shared memory is allocated at exactly the requested size against a guard page (a read or
//   write past its end or before its start is an error naming the offset; the few bytes below a 16-byte
//   boundary are checked by a canary for writes), and filled with 0xff bytes (NaN floats) before each
//   block, as is static shared memory (__shared__ variables live in one ELF section), so a read of
//   shared memory nothing wrote in this block shows.  An index past the end of a static __shared__
//   array traps (the library is compiled with -fsanitize=bounds) and is the block's error.
// * An intrinsic this runtime does not define fails the build: nothing falls back silently.
#ifndef SIMT_RUNTIME_H_
#define SIMT_RUNTIME_H_

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

using std::isinf;
using std::isnan;

// ------------------------------------------------------------------ CUDA qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared memory: one instance per variable (the blocks of a grid run one at a time), in the
// section simt_shared, which the runtime poisons before every block.
#define __shared__ __attribute__((section("simt_shared"))) static
#define __constant__ static const

// ------------------------------------------------------------------ vector types
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
struct __attribute__((aligned(16))) int4 {
  int x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace simt {

using Loc = std::source_location;

struct ThreadCtx;  // the running CUDA thread (runtime.cpp)
extern thread_local ThreadCtx* t_ctx;
extern thread_local uint3 t_threadIdx, t_blockIdx;
extern thread_local dim3 t_blockDim, t_gridDim;

[[noreturn]] void fail(const char* what, const Loc& loc);  // records the error, stops this thread
void syncthreads(const Loc& loc);
unsigned char* dynamic_shared_base();
size_t dynamic_shared_size();

// A warp collective: this lane's 16 words in, every lane's words out (valid until this lane's next
// collective).  `what` names the operation in errors.
struct Slot {
  uint32_t w[16];
};
const Slot* warp_exchange(unsigned mask, const Slot& mine, const char* what, const Loc& loc);
inline int lane_id() { return static_cast<int>(t_threadIdx.x & 31u); }  // blocks are 1-D here
void check_lane_in(unsigned mask, int lane, const char* what, const Loc& loc);

// ------------------------------------------------------------------ the launch
void run_grid(const char* name, const void* fn, dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* arg);

template <typename... P>
struct Launcher {
  void (*fn)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;
  template <typename... A>
  void operator()(A&&... a) const {
    std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
    struct Call {
      void (*fn)(P...);
      std::tuple<std::decay_t<P>...>* args;
    } call{fn, &args};
    run_grid(
        name, reinterpret_cast<const void*>(fn), grid, block, smem,
        [](void* p) {
          Call* c = static_cast<Call*>(p);
          std::apply(c->fn, *c->args);  // each thread its own copy of by-value parameters
        },
        &call);
  }
};

template <typename... P, typename S>
Launcher<P...> make_launcher(void (*fn)(P...), const char* name, dim3 grid, dim3 block, size_t smem, S) {
  return Launcher<P...>{fn, name, grid, block, smem};
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(dynamic_shared_base());
}

// ------------------------------------------------------------------ shuffles
template <typename T>
inline Slot to_slot(const T& v) {
  static_assert(sizeof(T) <= sizeof(Slot) && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
  Slot s{};
  std::memcpy(&s, &v, sizeof(T));
  return s;
}
template <typename T>
inline T from_slot(const Slot& s) {
  T v;
  std::memcpy(&v, &s, sizeof(T));
  return v;
}

template <typename T>
inline T shfl_to(unsigned mask, T var, int src_in_segment, int width, const char* what, const Loc& loc) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) fail("shuffle width must be a power of two <= 32", loc);
  const int lane = lane_id();
  const Slot* all = warp_exchange(mask, to_slot(var), what, loc);
  const int src = (lane & ~(width - 1)) + src_in_segment;
  check_lane_in(mask, src, what, loc);
  return from_slot<T>(all[src]);
}

}  // namespace simt

// ------------------------------------------------------------------ built-in variables
#define threadIdx (::simt::t_threadIdx)
#define blockIdx (::simt::t_blockIdx)
#define blockDim (::simt::t_blockDim)
#define gridDim (::simt::t_gridDim)
constexpr int warpSize = 32;

// The launch and dynamic shared memory of the kernel sources (cuda/cuda_common.cuh defines both for nvcc).
#define ATTNCAL_LAUNCH(kernel, grid, block, smem, stream) \
  ::simt::make_launcher(kernel, #kernel, dim3(grid), dim3(block), static_cast<size_t>(smem), stream)
#define ATTNCAL_DYNAMIC_SHARED(type, name) type* const name = ::simt::dynamic_shared<type>()

// ------------------------------------------------------------------ synchronisation
inline void __syncthreads(const simt::Loc& loc = simt::Loc::current()) { simt::syncthreads(loc); }
inline void __syncwarp(unsigned mask = 0xffffffffu, const simt::Loc& loc = simt::Loc::current()) {
  simt::warp_exchange(mask, simt::Slot{}, "__syncwarp", loc);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
                     const simt::Loc& loc = simt::Loc::current()) {
  return simt::shfl_to(mask, var, src_lane & (width - 1), width, "__shfl_sync", loc);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         const simt::Loc& loc = simt::Loc::current()) {
  // The source lane lane ^ lane_mask, within the lane's segment of `width` lanes.
  const int in_seg = (simt::lane_id() & (width - 1)) ^ lane_mask;
  if (in_seg >= width) return simt::shfl_to(mask, var, simt::lane_id() & (width - 1), width, "__shfl_xor_sync", loc);
  return simt::shfl_to(mask, var, in_seg, width, "__shfl_xor_sync", loc);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          const simt::Loc& loc = simt::Loc::current()) {
  // lane + delta within the segment, else the lane's own value (PTX shfl.down's clamp).
  const int in_seg = simt::lane_id() & (width - 1);
  const int src = in_seg + static_cast<int>(delta) < width ? in_seg + static_cast<int>(delta) : in_seg;
  return simt::shfl_to(mask, var, src, width, "__shfl_down_sync", loc);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        const simt::Loc& loc = simt::Loc::current()) {
  const int in_seg = simt::lane_id() & (width - 1);
  const int src = in_seg - static_cast<int>(delta) >= 0 ? in_seg - static_cast<int>(delta) : in_seg;
  return simt::shfl_to(mask, var, src, width, "__shfl_up_sync", loc);
}

// ------------------------------------------------------------------ atomics (global and shared alike)
template <typename T>
concept SimtAtomic = std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, long long> ||
                     std::is_same_v<T, unsigned long long> || std::is_same_v<T, float>;
template <SimtAtomic T>
inline T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
template <SimtAtomic T>
inline T atomicSub(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_sub(v, std::memory_order_relaxed);
}
template <SimtAtomic T>
inline T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v, std::memory_order_relaxed);
}
template <SimtAtomic T>
inline T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired, std::memory_order_relaxed);
  return expected;
}
template <SimtAtomic T>
  requires std::is_integral_v<T>
inline T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load(std::memory_order_relaxed);
  while (v < old && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
  }
  return old;
}
template <SimtAtomic T>
  requires std::is_integral_v<T>
inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load(std::memory_order_relaxed);
  while (v > old && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
  }
  return old;
}

// ------------------------------------------------------------------ integer min / max (CUDA's overloads)
template <typename A, typename B>
  requires(std::is_integral_v<A> && std::is_integral_v<B>)
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <typename A, typename B>
  requires(std::is_integral_v<A> && std::is_integral_v<B>)
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) > static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}

// ------------------------------------------------------------------ float intrinsics
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
// __expf: the GPU computes ex2.approx(x * log2(e)) (2 ulp of ex2, plus the rounding of the product);
// modelled with the same product and a correctly rounded exp2.  The GPU's own rounding is not modelled.
inline float __expf(float x) { return exp2f(x * 1.44269504088896340736f); }
// Correctly rounded single operations, never contracted (the library is built with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

#endif  // SIMT_RUNTIME_H_
