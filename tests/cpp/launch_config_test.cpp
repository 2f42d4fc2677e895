// Host test of plugins/kernels/cuda/launch_config.h, the CUDA launchers' choices made on the host: for the
// shared-memory opt-in limits of sm_80 (163 KiB), sm_86 and sm_89 (99 KiB) and sm_90 (227 KiB), every dtype,
// head sizes 32..256 and both block classes (calibration blocks or not), the tiled attention kernel's choice
// fits and is the largest configuration that fits, where the footprint is recomputed here from the layout the
// header documents (not with its own function); sm_80 and sm_90 keep the configuration the kernel was
// designed with; sm_86 and sm_89 never fall back to the per-row kernel for a head the tiled kernel serves.
// Also the per-row kernel's and the calibration kernels' choices (they fit, for any shape) and the workspace
// layout.  Prints one summary line; exits non-zero on a failure.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/span_geometry.h"
#include "cuda/launch_config.h"

namespace {

int failures = 0, checked = 0;

void check(bool ok, const char* what, long long a = 0, long long b = 0, long long c = 0) {
  ++checked;
  if (!ok) {
    ++failures;
    if (failures <= 20) std::printf("FAIL %s (%lld, %lld, %lld)\n", what, a, b, c);
  }
}

struct Device {
  const char* name;
  size_t optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};
const Device kDevices[] = {{"sm_80", 163 * 1024}, {"sm_86", 99 * 1024}, {"sm_89", 99 * 1024}, {"sm_90", 227 * 1024}};
const int kDtypes[] = {ATTNCAL_DTYPE_FLOAT32, ATTNCAL_DTYPE_FLOAT16, ATTNCAL_DTYPE_BFLOAT16};

// The documented configurations, largest first: the design's (16-bit 4 warps x 2 stages, float32 2 x 1),
// then at head size 128 half the warps and one stage.
std::vector<attncal::TileConfig> ladder(int dtype, int head) {
  const bool f32 = dtype == ATTNCAL_DTYPE_FLOAT32;
  std::vector<attncal::TileConfig> v = {f32 ? attncal::TileConfig{2, 1} : attncal::TileConfig{4, 2}};
  if (head == 128) v.push_back(f32 ? attncal::TileConfig{1, 1} : attncal::TileConfig{2, 1});
  return v;
}

// The footprint from the layout the header documents: Q block, K and V tiles of 64 keys per stage, the
// float32 P rows, the key mask rounded up to 16 bytes; calibration blocks add two float4 per thread per
// 8 value columns.
size_t footprint(int dtype, int head, attncal::TileConfig c, bool calibrating) {
  const size_t elem = dtype == ATTNCAL_DTYPE_FLOAT32 ? 4 : 2, rows = 16 * c.warps, ld = head + 16 / elem;
  size_t bytes = elem * rows * ld + 2 * c.stages * elem * 64 * ld;
  if (elem == 4) bytes += 4 * rows * (64 + 4);
  bytes += (c.stages * 64 + 15) / 16 * 16;
  if (calibrating) bytes += 2 * 16 * (head / 8) * (32 * c.warps);
  return bytes;
}

bool same(attncal::TileConfig a, attncal::TileConfig b) { return a.warps == b.warps && a.stages == b.stages; }

void test_tiled() {
  for (const Device& dev : kDevices)
    for (int dtype : kDtypes)
      for (int head_size = 32; head_size <= 256; ++head_size)
        for (bool calibrating : {false, true}) {
          const attncal::TiledChoice c = attncal::choose_tiled(head_size, dtype, dev.optin, calibrating);
          if (head_size > 128) {  // only the per-row kernel serves it
            check(!c.tiled, "a head beyond 128 columns runs on the per-row kernel", head_size);
            continue;
          }
          const int head = head_size <= 64 ? 64 : 128;
          check(c.head == head, "the kernel's head size", head_size, c.head);
          const std::vector<attncal::TileConfig> cands = ladder(dtype, head);
          // The header's ladder is the documented one.
          attncal::TileConfig got[2];
          const int n = attncal::tile_candidates(dtype, head, got);
          check(n == static_cast<int>(cands.size()), "the ladder's length", dtype, head, n);
          for (int i = 0; i < n && i < static_cast<int>(cands.size()); ++i)
            check(same(got[i], cands[i]), "the ladder's configurations", dtype, head, i);
          // Largest first: each step needs less shared memory than the one before it, so the first
          // configuration that fits is the largest that fits.
          for (size_t i = 1; i < cands.size(); ++i)
            check(footprint(dtype, head, cands[i], calibrating) < footprint(dtype, head, cands[i - 1], calibrating),
                  "the ladder shrinks", dtype, head, static_cast<long long>(i));
          int want = -1;
          for (size_t i = 0; i < cands.size() && want < 0; ++i)
            if (footprint(dtype, head, cands[i], calibrating) <= dev.optin) want = static_cast<int>(i);
          if (want < 0) {
            check(!c.tiled, "nothing fits: the per-row kernel", dtype, head_size, calibrating);
            continue;
          }
          check(c.tiled, "a configuration fits", dtype, head_size, calibrating);
          if (!c.tiled) continue;
          check(same(c.config, cands[want]), "the largest configuration that fits", dtype, head_size, calibrating);
          check(c.smem_bytes == footprint(dtype, head, c.config, calibrating), "the footprint", dtype, head_size,
                static_cast<long long>(c.smem_bytes));
          check(c.smem_bytes <= dev.optin, "it fits", dtype, head_size, static_cast<long long>(c.smem_bytes));
          // The kernel's offsets come from tile_layout: the calibration slots start where a plain block ends.
          const attncal::TileLayout L = attncal::tile_layout(static_cast<int>(attncal::elem_bytes_of(dtype)), head,
                                                             c.config);
          check(L.off_of == L.base_bytes && (calibrating ? L.calib_bytes : L.base_bytes) == c.smem_bytes,
                "the kernel's layout", dtype, head_size);
          check(L.off_k % 16 == 0 && L.off_v % 16 == 0 && L.off_p % 16 == 0 && L.off_mask % 16 == 0 &&
                    L.off_acc % 16 == 0,
                "16-byte aligned regions", dtype, head_size);
          // sm_80 and sm_90 run the design's configuration for both classes; sm_86 and sm_89 run the tiled
          // kernel for both classes (their calibration blocks at head size 128 on the smaller step).
          if (dev.optin >= 163 * 1024)
            check(want == 0, "the design's configuration on sm_80 / sm_90", dtype, head_size, calibrating);
          if (head == 128 && calibrating && dtype != ATTNCAL_DTYPE_FLOAT32 && dev.optin == 99 * 1024)
            check(footprint(dtype, head, cands[0], true) > dev.optin && want == 1,
                  "sm_86 / sm_89: the calibration blocks take the smaller step", dtype, head_size);
        }
}

// The per-row kernel: its choice fits every limit of a real device (its static shared memory, 4 + 128
// floats, taken off the opt-in limit as the launcher does), whatever the head sizes and basket count, and is
// the first of its documented forms that fits.
void test_rows() {
  const size_t static_bytes = sizeof(float) * (4 + attncal::kRowThreads);
  const int64_t heads[] = {0, 32, 129, 256, 4096, 20000, 40000, 100000};
  const int64_t baskets[] = {0, 1, 129, 130, 4096, 30000, 1 << 20};
  for (const Device& dev : kDevices)
    for (int64_t D : heads)
      for (int64_t Dv : heads) {
        if (Dv == 0) continue;  // an empty context launches nothing
        for (int64_t n : baskets) {
          const size_t limit = dev.optin - static_bytes;
          const attncal::RowsConfig c = attncal::choose_rows(D, Dv, n, limit);
          check(c.smem_bytes <= limit && c.smem_bytes == attncal::rows_smem_bytes(c), "the per-row kernel fits", D,
                Dv, n);
          check(c.acc_floats >= 1 && c.acc_floats <= Dv && (c.acc_floats == Dv || c.acc_floats % 128 == 0),
                "whole chunks of value columns", D, Dv, n);
          check(c.baskets_kept ? c.basket_floats == n : c.basket_floats == attncal::kRowThreads + 1,
                "the basket buffer", D, Dv, n);
          check(c.q_floats == D || c.q_floats == 0, "the query row kept or read from global memory", D, Dv, n);
          const size_t all = sizeof(float) * static_cast<size_t>(D + Dv + n);
          if (all <= limit)
            check(c.baskets_kept && c.q_floats == D && c.acc_floats == Dv, "everything kept where it fits", D, Dv,
                  n);
          if (!c.baskets_kept)
            check(n > attncal::kRowThreads + 1 && all > limit, "baskets recomputed only to fit", D, Dv, n);
          if (c.q_floats == 0 && D > 0) {
            const size_t q_kept = sizeof(float) * static_cast<size_t>(D + Dv + c.basket_floats);
            check(q_kept > limit, "the query read from global memory only to fit", D, Dv, n);
          }
          if (c.acc_floats < Dv) check(c.q_floats == 0, "value columns chunked last", D, Dv, n);
        }
      }
}

// The calibration kernels: the basket values kept exactly when they fit, never a refusal.
void test_baskets() {
  // The kernels' static shared memory: their reduction slots (8 ints, 8 + 3 floats), 16-byte aligned.
  const size_t static_bytes = (sizeof(int) * 8 + sizeof(float) * 11 + 15) / 16 * 16;
  for (const Device& dev : kDevices)
    for (int64_t K : {1LL, 7LL, 512LL, 8192LL, 65536LL, 1LL << 20, (1LL << 31) - 1})
      for (int32_t S : {1, 2, 3, 8, 64, 1 << 20}) {
        const size_t limit = dev.optin - static_bytes;
        const attncal::BasketsConfig c = attncal::choose_baskets(K, S, limit);
        const size_t need = sizeof(float) * static_cast<size_t>((K + S - 1) / S);
        check(c.kept == (need <= limit), "baskets kept exactly when they fit", K, S);
        check(c.smem_bytes <= limit && (c.kept ? c.smem_bytes == need : c.smem_bytes == 0), "the basket buffer", K,
              S);
      }
}

// The attention workspace: the span records first, then the 16-byte-aligned queue counter, then a slot per
// (item, head, query row); with a relative position bias, then its float32 rows, 16-byte aligned, one per head
// of 2 * S_q - 1 offsets (the layout without the bias unchanged by it).
void test_workspace() {
  for (int64_t B : {0LL, 1LL, 3LL, 65535LL})
    for (int64_t S_q : {0LL, 1LL, 7LL, 512LL})
      for (int64_t N : {1LL, 12LL}) {
        const attncal::AttentionWorkspace w = attncal::attention_workspace(B, S_q, N);
        const size_t spans = attncal::span_workspace_bytes(B);
        check(spans == sizeof(int) * attncal::kSpanInts * static_cast<size_t>(B > 0 ? B : 1), "span records", B);
        check(w.queue_count_offset >= spans && w.queue_count_offset % 16 == 0 &&
                  w.queue_offset == w.queue_count_offset + 16,
              "the queue counter", B, S_q, N);
        const size_t rows = static_cast<size_t>(B * S_q * N);
        check(w.bytes == w.queue_offset + sizeof(uint32_t) * (rows > 0 ? rows : 1), "the queue", B, S_q, N);
        const attncal::AttentionWorkspace r = attncal::attention_workspace(B, S_q, N, true);
        check(r.queue_count_offset == w.queue_count_offset && r.queue_offset == w.queue_offset,
              "the relative bias leaves the queue in place", B, S_q, N);
        const size_t offsets = static_cast<size_t>(S_q > 0 ? 2 * S_q - 1 : 0);
        check(r.relative_offset >= w.bytes && r.relative_offset < w.bytes + 16 && r.relative_offset % 16 == 0 &&
                  r.bytes == r.relative_offset + sizeof(float) * static_cast<size_t>(N) * offsets,
              "the relative bias rows", B, S_q, N);
      }
}

}  // namespace

int main() {
  test_tiled();
  test_rows();
  test_baskets();
  test_workspace();
  std::printf("%d choices checked, %d failure(s)\n", checked, failures);
  return failures == 0 ? 0 : 1;
}
