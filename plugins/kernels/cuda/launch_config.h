// What the CUDA launchers decide on the host before a launch, as pure functions of the shapes, the
// dtype and the device's shared-memory limit (no CUDA runtime call): the tiled attention kernel's
// configuration and shared-memory layout, the per-row kernel's, whether the calibration kernels
// keep their basket values in shared memory, and the workspace layouts.  The kernels compute their
// shared-memory offsets with these same functions, so the choice and the kernel cannot disagree
// about a footprint.  g++ compiles this header alone (tests/cpp/launch_config_test.cpp checks the
// choices for the 163 KiB, 99 KiB and 227 KiB opt-in limits of sm_80, sm_86/sm_89 and sm_90).
//
// The tiled attention kernel (cuda/attention_tiled.cuh) runs one block per 16 * warps query rows,
// K and V in tiles of kKeyTile keys, `stages` tiles in flight.  Its shared memory, in this order:
//   Q block     rows x LD elements          LD = head + one 16-byte pad (conflict-free rows)
//   K tiles     stages x kKeyTile x LD
//   V tiles     stages x kKeyTile x LD
//   P rows      float32 only: rows x (kKeyTile + 4) floats (the scalar path's probabilities)
//   key mask    stages x kKeyTile bytes, rounded up to 16
//   -- base_bytes: enough for a block without a calibrated row --
//   O slots     one float4 per thread per 8 value columns (the full term of the calibration)
//   acc slots   the same again (the basket term)
//   -- calib_bytes: a calibration block --
// A block that holds no calibrated row needs base_bytes; only calibration blocks need calib_bytes
// (at head size 128, 149 KiB in float16 and 123 KiB in float32 with the largest configuration, more
// than the 99 KiB an sm_86 or sm_89 block may opt in to).  The launcher therefore runs two launches,
// one per block class, each with the largest configuration its footprint allows (choose_tiled), and
// the per-row kernel where none fits.
//
// The configurations (tile_candidates), largest first: the one the kernel was designed with (16-bit
// types 4 warps x 2 stages, float32 2 warps x 1 stage: its scalar-FMA tiles are twice the bytes and
// hold the P rows), which sm_80 and sm_90 run for both block classes; and at head size 128, where the
// calibration blocks' footprint exceeds 99 KiB, half the warps and one stage (16-bit 2 x 1, float32
// 1 x 1), which fits the 99 KiB of sm_86 and sm_89.  Below what a ladder's last step needs, the
// per-row kernel.  Why fewer warps and single buffering rather than a shorter key tile: they shrink
// every part of the footprint that grows with the block (the Q block, the O and acc slots, the K/V
// buffers) and leave a calibrated row's arithmetic as it is, since that depends on the key tile (where
// a row's online softmax rescales), which stays 64 keys on every device.  (The block height decides
// only which plain rows share a calibration block and so take its per-segment path: the same value,
// rounded another way.)  Each configuration is its own instantiation of the kernel: compile-time warps
// and stages keep its register allocation that of the design (no spills), and the ladder holds what
// the devices of sm_80 and later need (their opt-in limits: 99, 163 or 227 KiB), no more, because every
// instantiation adds to the build's nvcc time.
#ifndef ATTNCAL_CUDA_LAUNCH_CONFIG_H_
#define ATTNCAL_CUDA_LAUNCH_CONFIG_H_

#include <stddef.h>
#include <stdint.h>

#include "common/attncal_params.h"
#include "common/host_device.h"
#include "common/span_geometry.h"

namespace attncal {

// ------------------------------------------------------------------ the tiled attention kernel
constexpr int kKeyTile = 64;  // keys per K/V tile (BC)

struct TileConfig {
  int warps = 0;   // 16 query rows each
  int stages = 0;  // K/V tiles in flight: 2 (double-buffered cp.async) or 1
};

// The shared-memory layout of one block (offsets in bytes from the start of dynamic shared memory).
struct TileLayout {
  int rows = 0, ld = 0, ldp = 0;  // rows per block, elements per Q/K/V row, floats per P row
  size_t off_k = 0, off_v = 0, off_p = 0, off_mask = 0, base_bytes = 0, off_of = 0, off_acc = 0, calib_bytes = 0;
};

// elem_bytes: 2 (float16, bfloat16) or 4 (float32); head: the kernel's head size (64 or 128).
ATTNCAL_HD constexpr TileLayout tile_layout(int elem_bytes, int head, TileConfig c) {
  TileLayout L;
  L.rows = 16 * c.warps;
  L.ld = head + 16 / elem_bytes;
  L.ldp = kKeyTile + 4;
  const size_t q_bytes = static_cast<size_t>(elem_bytes) * L.rows * L.ld;
  const size_t kv_bytes = static_cast<size_t>(elem_bytes) * kKeyTile * L.ld;  // one K or V tile
  const size_t p_bytes = elem_bytes == 4 ? sizeof(float) * L.rows * L.ldp : 0;
  const size_t mask_bytes = 16 * ((static_cast<size_t>(c.stages) * kKeyTile + 15) / 16);
  const size_t acc_bytes = 16 * static_cast<size_t>(head / 8) * (32 * c.warps);  // one float4 per thread per 8 columns
  L.off_k = q_bytes;
  L.off_v = L.off_k + c.stages * kv_bytes;
  L.off_p = L.off_v + c.stages * kv_bytes;
  L.off_mask = L.off_p + p_bytes;
  L.base_bytes = L.off_mask + mask_bytes;
  L.off_of = L.base_bytes;
  L.off_acc = L.off_of + acc_bytes;
  L.calib_bytes = L.off_acc + acc_bytes;
  return L;
}

inline int elem_bytes_of(int dtype) { return dtype == ATTNCAL_DTYPE_FLOAT32 ? 4 : 2; }

// The tiled kernel's head size for a head of head_size columns (the larger of D and D_v): the two
// instantiated ones, 64 and 128; 0 beyond 128, which only the per-row kernel serves.
inline int tiled_head(int64_t head_size) { return head_size <= 64 ? 64 : (head_size <= 128 ? 128 : 0); }

// The configurations the kernel is instantiated for at `head` (64 or 128), largest first; returns how
// many (at most 2).
inline int tile_candidates(int dtype, int head, TileConfig out[2]) {
  const bool f32 = dtype == ATTNCAL_DTYPE_FLOAT32;
  out[0] = f32 ? TileConfig{2, 1} : TileConfig{4, 2};
  if (head != 128) return 1;
  out[1] = f32 ? TileConfig{1, 1} : TileConfig{2, 1};
  return 2;
}

// One block class's choice: the tiled kernel with `config` and `smem_bytes` of dynamic shared memory,
// or (tiled == false) the per-row kernel.
struct TiledChoice {
  bool tiled = false;
  int head = 0;
  TileConfig config;
  size_t smem_bytes = 0;
};

// The largest configuration whose footprint (calib_bytes for calibration blocks, base_bytes for the
// others) fits in smem_limit bytes of dynamic shared memory; the per-row kernel when the head is
// beyond 128 columns or nothing fits.
inline TiledChoice choose_tiled(int64_t head_size, int dtype, size_t smem_limit, bool calibrating) {
  TiledChoice c;
  c.head = tiled_head(head_size);
  if (c.head == 0) return c;
  TileConfig cand[2];
  const int n = tile_candidates(dtype, c.head, cand);
  for (int i = 0; i < n; ++i) {
    const TileLayout L = tile_layout(elem_bytes_of(dtype), c.head, cand[i]);
    const size_t bytes = calibrating ? L.calib_bytes : L.base_bytes;
    if (bytes <= smem_limit) {
      c.tiled = true;
      c.config = cand[i];
      c.smem_bytes = bytes;
      return c;
    }
  }
  return c;
}

// ------------------------------------------------------------------ the per-row attention kernel
// One block of kRowThreads threads per query row (cuda/attention_rows.cuh).  Its dynamic shared
// memory: the query row (q_floats: D, or 0 when it is read from global memory), the context
// accumulator of a chunk of acc_floats value columns (one owner thread per column), and the basket
// sums (basket_floats: the row's n baskets when they are kept; else kRowThreads + 1 floats, the
// sums of the baskets that meet one chunk of kRowThreads keys, recomputed per chunk).  Taken in this
// order until one fits: everything kept; baskets recomputed; the query read from global memory; the
// value columns in chunks (each chunk recomputes the row's weights).  Every form gives the same
// result: the same sums in the same order.
constexpr int kRowThreads = 128;

struct RowsConfig {
  int64_t q_floats = 0, acc_floats = 0, basket_floats = 0;
  bool baskets_kept = true;
  size_t smem_bytes = 0;
};

ATTNCAL_HD inline size_t rows_smem_bytes(const RowsConfig& c) {
  return sizeof(float) * static_cast<size_t>(c.q_floats + c.acc_floats + c.basket_floats);
}

// D, D_v: the head sizes; n_baskets: the baskets of a calibrated row (0 when no row is calibrated).
// Recomputing the baskets only saves room when the row has more of them than the chunk buffer holds.
inline RowsConfig choose_rows(int64_t D, int64_t D_v, int64_t n_baskets, size_t smem_limit) {
  RowsConfig c;
  c.q_floats = D;
  c.acc_floats = D_v;
  c.basket_floats = n_baskets;
  c.smem_bytes = rows_smem_bytes(c);
  if (c.smem_bytes <= smem_limit) return c;
  if (n_baskets > kRowThreads + 1) {
    c.baskets_kept = false;
    c.basket_floats = kRowThreads + 1;
    c.smem_bytes = rows_smem_bytes(c);
    if (c.smem_bytes <= smem_limit) return c;
  }
  c.q_floats = 0;
  c.smem_bytes = rows_smem_bytes(c);
  if (c.smem_bytes <= smem_limit) return c;
  const int64_t room = static_cast<int64_t>(smem_limit / sizeof(float)) - c.basket_floats;
  int64_t chunk = room / kRowThreads * kRowThreads;
  if (chunk < kRowThreads) chunk = kRowThreads;  // more than a limit of ~1 KiB holds: the launcher refuses it
  c.acc_floats = chunk < D_v ? chunk : D_v;
  c.smem_bytes = rows_smem_bytes(c);
  return c;
}

// ------------------------------------------------------------------ the calibration kernels
// Whether a row's n = ceil(K / basket_size) basket values fit in smem_limit bytes of dynamic shared
// memory (cuda/calibration_kernels.cuh keeps them there); otherwise the kernels recompute each
// basket's mass where they need it, with the same sum in the same order (one more read of the row).
struct BasketsConfig {
  bool kept = true;
  size_t smem_bytes = 0;
};

inline BasketsConfig choose_baskets(int64_t K, int32_t basket_size, size_t smem_limit) {
  const int64_t n = (K + basket_size - 1) / basket_size;
  BasketsConfig c;
  c.smem_bytes = sizeof(float) * static_cast<size_t>(n > 0 ? n : 1);
  if (c.smem_bytes > smem_limit) {
    c.kept = false;
    c.smem_bytes = 0;
  }
  return c;
}

// ------------------------------------------------------------------ workspaces
// The calibrated attention launcher's workspace: the span records (common/span_geometry.h), a
// 16-byte slot for the queue counter, then one uint32 per (item, head, query row) for the rows
// handed to the per-row kernel; with a relative position bias (`relative`), then, 16-byte aligned,
// its float32 rows per head and key-minus-query offset, N x (2*S_q - 1) (the bias needs S_q == S_k).
struct AttentionWorkspace {
  size_t queue_count_offset = 0, queue_offset = 0, relative_offset = 0, bytes = 0;
};

inline size_t align16(size_t x) { return (x + 15) & ~static_cast<size_t>(15); }

inline AttentionWorkspace attention_workspace(int64_t B, int64_t S_q, int64_t N, bool relative = false) {
  const int64_t b = B > 0 ? B : 0, s = S_q > 0 ? S_q : 0, n = N > 0 ? N : 0;
  const int64_t rows = b * n * s;
  AttentionWorkspace w;
  w.queue_count_offset = align16(span_workspace_bytes(B));
  w.queue_offset = w.queue_count_offset + 16;
  w.bytes = w.queue_offset + sizeof(uint32_t) * static_cast<size_t>(rows > 0 ? rows : 1);
  w.relative_offset = align16(w.bytes);
  if (relative) w.bytes = w.relative_offset + sizeof(float) * static_cast<size_t>(s > 0 ? n * (2 * s - 1) : 0);
  return w;
}

}  // namespace attncal

#endif  // ATTNCAL_CUDA_LAUNCH_CONFIG_H_
