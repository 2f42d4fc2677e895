// The tensor-core and memory primitives of the tiled attention kernel, as inline PTX: cp.async
// (16 bytes global -> shared, asynchronous), ldmatrix (8x8 b16 fragments from shared memory, plain and
// transposed), mma.sync m16n8k16 with float32 accumulation (float16 and bfloat16 operands), and the
// quad reductions over the four lanes that share an accumulator row.  sm_80 and later.  Under
// ATTNCAL_SIMT (the CUDA simulator of the tests, tests/simt, which compiles these sources with g++) each asm
// statement is replaced by the simulator's model of the same instruction, called with the same operands.
#ifndef ATTNCAL_CUDA_MMA_CUH_
#define ATTNCAL_CUDA_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attncal {
namespace {

// Two floats rounded to the 16-bit type and packed as an mma operand register (lower column in
// the low half).  The rounded values come back in a, b, so the row sums add what P*V multiplies.
template <typename T>
__device__ __forceinline__ uint32_t pack_round(float& a, float& b) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h = __floats2half2_rn(a, b);
    a = __low2float(h);
    b = __high2float(h);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    a = __low2float(h);
    b = __high2float(h);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));  // the simulator models this intrinsic too
}

// 16 bytes global -> shared, asynchronous; src_bytes == 0 writes 16 zero bytes (rows past the tile
// or columns past the head size).  src must be a valid address either way.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef ATTNCAL_SIMT
  simt::ptx::cp_async_cg_shared_global(smem_addr(dst), src, 16, src_bytes, simt::Loc::current());
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef ATTNCAL_SIMT
  simt::ptx::cp_async_commit_group(simt::Loc::current());
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef ATTNCAL_SIMT
  simt::ptx::cp_async_wait_group(N, simt::Loc::current());
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Four 8x8 b16 matrices from shared memory: lane l gives the address of row l%8 of matrix l/8 and
// receives in r[i] (row l/4, columns 2*(l%4), +1) of matrix i (with .trans: rows 2*(l%4), +1 of
// column l/4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row_ptr) {
#ifdef ATTNCAL_SIMT
  simt::ptx::ldmatrix_m8n8_x4_b16(r[0], r[1], r[2], r[3], smem_addr(row_ptr), false, simt::Loc::current());
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row_ptr) {
#ifdef ATTNCAL_SIMT
  simt::ptx::ldmatrix_m8n8_x4_b16(r[0], r[1], r[2], r[3], smem_addr(row_ptr), true, simt::Loc::current());
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
#endif
}

// c += A(16x16, row major) * B(16x8, "col": k-major per column), fp32 accumulate.
// A: a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, k 2t..), a[2] = (row g, k 2t+8..), a[3] = (row g+8, k 2t+8..)
// B: b0 = (k 2t..2t+1, col g), b1 = (k 2t+8.., col g);  C: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = row g+8.
template <typename T>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef ATTNCAL_SIMT
  const uint32_t b[2] = {b0, b1};
  simt::ptx::mma_m16n8k16_row_col_f32(c, a, b, c, !std::is_same<T, __half>::value, simt::Loc::current());
#else
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_MMA_CUH_
