// CPU models of the inline PTX of plugins/kernels/cuda/mma.cuh, written from the PTX ISA (the sections
// quoted below), not from mma.cuh's comments, so that a misreading of the fragment layouts that mma.cuh and
// its callers share cannot pass.  mma.cuh calls these under ATTNCAL_SIMT with the operands of its asm
// statements, in the same order.  Each is checked alone against a naive copy or GEMM
// (tests/simt/test_simt_runtime.py).
#ifndef SIMT_PTX_H_
#define SIMT_PTX_H_

#include <cstddef>
#include <cstdint>

#include "simt/runtime.h"

namespace simt {
namespace ptx {

// The .shared window: a shared-memory address is the offset into the block's dynamic shared memory
// (the attention kernel declares no static shared memory).  A generic pointer outside it is an error.
uint32_t cvta_generic_to_shared(const void* p, const Loc& loc);
unsigned char* shared_at(uint32_t addr, size_t bytes, size_t align, const char* what, const Loc& loc);

// cp.async.cg.shared.global [dst], [src], cp-size, src-size (PTX ISA, "cp.async"): "copies cp-size bytes
// from the source to the destination ... src-size ... specifies the number of bytes to copy from src; the
// remaining cp-size - src-size bytes are filled with zeros".  The copy is asynchronous: it is only known to
// be done after cp.async.wait_group / wait_all.  The model queues it in the issuing thread and performs it
// at the wait that covers its group, the latest point the ISA allows, so a missing wait reads stale shared
// memory.  "cp.async.commit_group ... batches all prior cp.async operations initiated by the executing
// thread but not committed to any group into a new cp.async-group"; "cp.async.wait_group N ... waits until
// only N or fewer of the most recent cp.async-groups are pending and all the prior cp.async-groups
// committed by the executing thread are complete".  Uncommitted copies are not waited for.
void cp_async_cg_shared_global(uint32_t dst, const void* src, int cp_size, int src_size, const Loc& loc);
void cp_async_commit_group(const Loc& loc);
void cp_async_wait_group(int n, const Loc& loc);
void cp_async_drop_pending();  // a thread's queue at its exit (the runtime calls it)

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 {r0,r1,r2,r3}, [p] (PTX ISA, "ldmatrix"): "The eight
// addresses required for each matrix are provided by eight threads ... Each address corresponds to the start
// of a matrix row.  Addresses addr0-addr7 correspond to the rows of the first matrix, addresses addr8-addr15
// correspond to the rows of the second matrix, and so on" (.x4: threads 0-7, 8-15, 16-23, 24-31).  "When
// reading 8x8 matrices, a group of four consecutive threads loads 16 bytes ... Each thread in a warp loads
// fragments of a row, with thread 0 receiving the first fragment in its register r, and so on.  A group of
// four threads loads an entire row of the matrix" (figure "ldmatrix fragment layout for one 8x8 Matrix with
// 16-bit elements": thread t holds row t/4, elements 2*(t%4) and 2*(t%4)+1, the first in the low half).
// "When .num = .x4, elements of the third and fourth matrices are loaded in the subsequent destination
// registers."  "Optional qualifier .trans indicates that the matrix is loaded in column-major format": thread t
// then holds column t/4, rows 2*(t%4) and 2*(t%4)+1.  Every lane of the warp takes part (.aligned).
void ldmatrix_m8n8_x4_b16(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr, bool trans,
                          const Loc& loc);

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 {d0..d3}, {a0..a3}, {b0,b1}, {c0..c3}
// (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with groupID = %laneid >> 2 and
// threadID_in_group = %laneid % 4:
//   A (16x16, .f16/.bf16: four .b32 registers, elements a0..a7 low to high):
//     row = groupID for ai where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//     col = (threadID_in_group * 2) + (i & 0x1) for ai where i < 4, ... + 8 for ai where i >= 4
//   B (16x8, two .b32 registers, b0..b3 low to high):
//     row = (threadID_in_group * 2) + (i & 0x1) for bi where i < 2, ... + 8 for bi where i >= 2; col = groupID
//   C, D (16x8 .f32, c0..c3): row = groupID for ci where i < 2, groupID + 8 for ci where i >= 2;
//     col = (threadID_in_group * 2) + (i & 0x1)
// D = A*B + C.  The model multiplies exactly and sums the 16 products and C in double, one rounding to
// float32; the tensor core's own accumulation order and rounding are the GPU's (not modelled).
void mma_m16n8k16_row_col_f32(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bool bf16,
                              const Loc& loc);

}  // namespace ptx
}  // namespace simt

inline size_t __cvta_generic_to_shared(const void* p, const simt::Loc& loc = simt::Loc::current()) {
  return simt::ptx::cvta_generic_to_shared(p, loc);
}

#endif  // SIMT_PTX_H_
