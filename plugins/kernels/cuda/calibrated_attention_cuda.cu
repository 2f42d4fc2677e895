// The launchers and C ABI of the calibrated attention ops' CUDA kernels (calibrated_attention_cuda.h;
// the kernels: attention_tiled.cuh, whose header comment is the design, and attention_rows.cuh).
//
// One call, on one stream:
//  1. span_kernel (cuda_common.cuh): the items' span records, and the queue counter zeroed (not when
//     strength == 0: no row is calibrated then); with a relative position bias, relative_kernel: the
//     bias of every head at every key-minus-query offset, [N, 2*S_k-1] float32 in the workspace, which
//     the attention kernels add to each score (Args::rel), so no [S_q,S_k] bias exists;
//  2. the tiled kernel over the blocks without a calibrated row, with the largest configuration whose
//     base footprint fits the device (cuda/launch_config.h: choose_tiled);
//  3. the tiled kernel over the calibration blocks, with the largest configuration whose calibration
//     footprint fits (on sm_86 / sm_89 at head size 128: fewer warps and one stage), or, where none
//     fits, the per-row kernel over the calibrated rows;
//  4. the per-row kernel over the rows the calibration blocks queued.
// A head beyond 128 columns, and attncal_cuda_calibrated_attention_reference, run the per-row kernel
// over every row instead of 2-4.  Each kernel's shared-memory opt-in and the device's limits are set
// and queried once per device (cuda_common.cuh), not per launch.
//
// Compiled with nvcc for sm_80 and sm_90 wherever it is found; it has not run on a GPU (none where the
// library is built and tested): the choice of configuration is host-tested
// (tests/cpp/launch_config_test.cpp), and so are check()'s refusals (tests/test_native_trt.py); the
// kernels' correctness on a device, the geometry's included, rests on tests/gpu and benchmarks/gpu_check.py.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "common/relative_position.h"
#include "common/span_geometry.h"
#include "cuda/attention_common.cuh"
#include "cuda/attention_rows.cuh"
#include "cuda/attention_tiled.cuh"
#include "cuda/calibrated_attention_cuda.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch_config.h"

namespace {

using attncal::Args;
using attncal::DeviceFacts;
using attncal::fail;

template <typename T>
constexpr int dtype_of() {
  if (std::is_same<T, float>::value) return ATTNCAL_DTYPE_FLOAT32;
  return std::is_same<T, __half>::value ? ATTNCAL_DTYPE_FLOAT16 : ATTNCAL_DTYPE_BFLOAT16;
}

// The relative position bias per head and key-minus-query offset (Args::rel): rel[h*(2*S_k-1) + d] is
// table[bucket(d - (S_k-1)), h] in float32.  One thread per offset computes its bucket once (the host's
// function, common/relative_position.h, whose float32 steps give the CPU kernel's buckets) and writes
// that bucket's bias for every head (consecutive threads, consecutive offsets of one head).
template <typename T>
__global__ void relative_kernel(const T* __restrict__ table, int64_t buckets, float log_span, int64_t N,
                                int64_t S_k, float* __restrict__ rel) {
  const int64_t width = 2 * S_k - 1;
  for (int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; d < width;
       d += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T* row = table + attncal::relative_bucket(d - (S_k - 1), buckets, log_span) * N;
    for (int64_t h = 0; h < N; ++h) rel[h * width + d] = attncal::to_f(row[h]);
  }
}

template <typename T>
int launch_relative(const void* table, int64_t buckets, int64_t max_distance, int64_t N, int64_t S_k, float* rel,
                    cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t width = 2 * S_k - 1;
  const int64_t blocks = attncal::imin((width + kThreads - 1) / kThreads, 4096);
  ATTNCAL_LAUNCH(relative_kernel<T>, static_cast<unsigned>(blocks), kThreads, 0, stream)(
      static_cast<const T*>(table), buckets, attncal::relative_log_span(buckets, max_distance), N, S_k, rel);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "calibrated attention relative bias kernel launch", e);
  return ATTNCAL_OK;
}

// The per-row kernel over the queued rows (queue != NULL), the calibrated rows (calibrated_only) or
// every row.
template <typename T>
int launch_rows(const Args& a, const DeviceFacts& dev, const uint32_t* queue, const uint32_t* queue_count,
                bool calibrated_only, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(attncal::rows_kernel<T>);
  size_t limit = 0;
  int rc = attncal::kernel_smem_limit(kernel, dev, &limit);
  if (rc != ATTNCAL_OK) return rc;
  const int64_t n = (a.spans != nullptr && a.p.strength != 0.f) ? (a.S_k + a.p.basket_size - 1) / a.p.basket_size : 0;
  attncal::RowsLaunch l{};
  l.cfg = attncal::choose_rows(a.D, a.D_v, n, limit);
  l.queue = queue;
  l.queue_count = queue_count;
  l.calibrated_only = calibrated_only ? 1 : 0;
  if (l.cfg.smem_bytes > limit)  // its smallest form needs about 1 KiB, which every CUDA device has
    return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: the device's shared memory is below the per-row "
                                         "kernel's minimum");
  int64_t blocks = static_cast<int64_t>(dev.sms) * 8;
  if (queue == nullptr) blocks = attncal::imin(blocks * 64, a.B * a.N * a.S_q);
  ATTNCAL_LAUNCH(attncal::rows_kernel<T>, static_cast<unsigned>(blocks > 0 ? blocks : 1), attncal::kRowThreads,
                 l.cfg.smem_bytes, stream)(a, l);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "calibrated attention per-row kernel launch", e);
  return ATTNCAL_OK;
}

// One launch of the tiled kernel with configuration (NW, STAGES): blocks_x blocks along the query rows,
// smem_bytes of dynamic shared memory, opted in once per device.
template <typename T, int HD, int NW, int STAGES>
int launch_config(const Args& a, const DeviceFacts& dev, const attncal::TiledLaunch& l, int64_t blocks_x,
                  size_t smem_bytes, cudaStream_t stream) {
  auto kernel = attncal::attention_kernel<T, HD, NW, STAGES>;
  size_t limit = 0;
  const int rc = attncal::kernel_smem_limit(reinterpret_cast<const void*>(kernel), dev, &limit);
  if (rc != ATTNCAL_OK) return rc;
  if (smem_bytes > limit) return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: the chosen configuration "
                                                               "exceeds the kernel's shared memory");
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(a.N), static_cast<unsigned>(a.B));
  ATTNCAL_LAUNCH(kernel, grid, NW * 32, smem_bytes, stream)(a, l);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "calibrated attention kernel launch", e);
  return ATTNCAL_OK;
}

// One launch of the tiled kernel with the configuration `c` chose (one of tile_candidates), over the
// block class of `l`.
template <typename T, int HD>
int launch_tiled(const Args& a, const DeviceFacts& dev, const attncal::TiledChoice& c, const attncal::TiledLaunch& l,
                 cudaStream_t stream) {
  const int64_t rows = 16 * c.config.warps;
  // The calibration launch of a pooled op: one calibrated row per item, one block; otherwise every block
  // of the query rows (the calibration launch counts them from the item's first calibrated row).
  const int64_t blocks_x = (l.calibration && !a.p.all_rows) ? 1 : (a.S_q + rows - 1) / rows;
  // The instantiations of tile_candidates (cuda/launch_config.h).
  const int w = c.config.warps, s = c.config.stages;
  constexpr bool kF32 = std::is_same<T, float>::value;
  if (w == (kF32 ? 2 : 4) && s == (kF32 ? 1 : 2))
    return launch_config<T, HD, kF32 ? 2 : 4, kF32 ? 1 : 2>(a, dev, l, blocks_x, c.smem_bytes, stream);
  if constexpr (HD == 128) {
    if (w == (kF32 ? 1 : 2) && s == 1)
      return launch_config<T, HD, kF32 ? 1 : 2, 1>(a, dev, l, blocks_x, c.smem_bytes, stream);
  }
  return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: no kernel for the chosen configuration");
}

// Steps 2-4 of the file comment for a head of at most HD columns.  The tiled kernel declares no static
// shared memory, so a configuration fits when its dynamic shared memory is within the opt-in limit.
template <typename T, int HD>
int run_tiled(const Args& a, const DeviceFacts& dev, cudaStream_t stream) {
  const size_t limit = static_cast<size_t>(dev.smem_optin);
  const int64_t head = a.D > a.D_v ? a.D : a.D_v;
  const attncal::TiledChoice plain = attncal::choose_tiled(head, dtype_of<T>(), limit, false);
  if (!plain.tiled) return launch_rows<T>(a, dev, nullptr, nullptr, false, stream);  // below any sm_80+ device
  const bool calibration = a.spans != nullptr;
  const attncal::TiledChoice calib =
      calibration ? attncal::choose_tiled(head, dtype_of<T>(), limit, true) : attncal::TiledChoice{};
  const int calib_rows = calib.tiled ? 16 * calib.config.warps : 1;
  int rc = launch_tiled<T, HD>(a, dev, plain, attncal::TiledLaunch{0, calib_rows}, stream);
  if (rc != ATTNCAL_OK || !calibration) return rc;
  if (!calib.tiled) return launch_rows<T>(a, dev, nullptr, nullptr, true, stream);
  rc = launch_tiled<T, HD>(a, dev, calib, attncal::TiledLaunch{1, calib_rows}, stream);
  if (rc != ATTNCAL_OK) return rc;
  return launch_rows<T>(a, dev, a.queue, a.queue_count, false, stream);  // the rows the tiled kernel queued, if any
}

template <typename T>
int run_typed(const Args& a, bool reference_only, cudaStream_t stream) {
  DeviceFacts dev;
  const int rc = attncal::current_device(&dev);
  if (rc != ATTNCAL_OK) return rc;
  const int head = attncal::tiled_head(a.D > a.D_v ? a.D : a.D_v);
  if (reference_only || head == 0) return launch_rows<T>(a, dev, nullptr, nullptr, false, stream);
  return head == 64 ? run_tiled<T, 64>(a, dev, stream) : run_tiled<T, 128>(a, dev, stream);
}

int check(int dtype, const AttncalParams* params, int64_t B, int64_t S_q, int64_t S_k, int64_t N, int64_t D,
          int64_t D_v, int64_t num_buckets) {
  attncal_cuda_set_error("");
  if (params == nullptr) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "params is NULL");
  char msg[200];
  if (attncal_validate_params(params, msg, sizeof msg) != ATTNCAL_OK) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16 && dtype != ATTNCAL_DTYPE_BFLOAT16)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "dtype must be float32 (0), float16 (1) or bfloat16 (2)");
  if (B < 0 || S_q < 0 || S_k < 0 || D < 0 || D_v < 0) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "negative dimension");
  if (N < 1) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "the number of heads N must be >= 1");
  if (params->all_rows && S_q != S_k) {
    snprintf(msg, sizeof msg, "AllRowsCalibratedAttention needs S_q == S_k, got S_q=%lld, S_k=%lld", (long long)S_q,
             (long long)S_k);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  if (!params->all_rows && S_q != S_k && S_q != 1) {
    snprintf(msg, sizeof msg, "PooledRowCalibratedAttention needs S_q == S_k or S_q == 1, got S_q=%lld, S_k=%lld",
             (long long)S_q, (long long)S_k);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  // The geometry (contract.py): grouped key/value heads and the window, refused where invalid with the
  // CPU side's messages (common/attncal_attribute_parser.h, the ORT shape checks).
  const char* const* n = attncal_attr_names;
  const int64_t kv = params->num_kv_heads;
  if (kv < 0 || (kv > 0 && N % kv != 0)) {
    snprintf(msg, sizeof msg, "%s must divide %s=%lld (0 = %s), got %lld", n[ATTNCAL_ATTR_ID_num_kv_heads],
             n[ATTNCAL_ATTR_ID_num_heads], (long long)N, n[ATTNCAL_ATTR_ID_num_heads], (long long)kv);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  if (params->window_left < -1 || params->window_right < -1) {
    snprintf(msg, sizeof msg, "%s and %s must be >= 0, or -1 for no limit; got %d and %d",
             n[ATTNCAL_ATTR_ID_window_left], n[ATTNCAL_ATTR_ID_window_right], (int)params->window_left,
             (int)params->window_right);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  if ((params->window_left >= 0 || params->window_right >= 0) && S_q != S_k) {
    snprintf(msg, sizeof msg, "a window (%s, %s) needs S_q == S_k, got S_q=%lld, S_k=%lld",
             n[ATTNCAL_ATTR_ID_window_left], n[ATTNCAL_ATTR_ID_window_right], (long long)S_q, (long long)S_k);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  // The relative position bias (a table of num_buckets rows, 0 = none): the rules and messages of the ORT
  // shape check (common/relative_position.h).
  if (!attncal::relative_bias_ok(num_buckets != 0, num_buckets, params->relative_max_distance, S_q, S_k, msg,
                                 sizeof msg))
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  if (B > 65535 || N > 65535 || S_q > 0x7fffffff || S_k > 0x7fffffff || B * N * S_q >= (int64_t(1) << 32))
    return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: B and N must be <= 65535, S_q and S_k < 2^31, "
                                         "B*N*S_q < 2^32");
  return ATTNCAL_OK;
}

int run(int dtype, const void* q, const void* k, const void* v, const int64_t* mask, void* out, int64_t B,
        int64_t S_q, int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale, const void* relative_bias,
        int64_t num_buckets, const AttncalParams* params, void* workspace, void* stream_ptr, bool reference_only) {
  int rc = check(dtype, params, B, S_q, S_k, N, D, D_v, num_buckets);
  if (rc != ATTNCAL_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const size_t esize = dtype == ATTNCAL_DTYPE_FLOAT32 ? 4 : 2;
  if (B == 0 || S_q == 0 || D_v == 0) return ATTNCAL_OK;  // an empty context
  if (S_k == 0) {  // no keys: an empty softmax times an empty V is 0
    const cudaError_t e =
        cudaMemsetAsync(out, 0, static_cast<size_t>(B * S_q * N * D_v) * esize, stream);
    return e == cudaSuccess ? ATTNCAL_OK : fail(ATTNCAL_ERR_CUDA, "cudaMemsetAsync", e);
  }
  Args a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.mask = mask;
  a.out = out;
  a.B = B;
  a.S_q = S_q;
  a.S_k = S_k;
  a.N = N;
  a.N_kv = params->num_kv_heads > 0 ? params->num_kv_heads : N;
  a.D = D;
  a.D_v = D_v;
  // scale 0 means 1/sqrt(D); with D == 0 every dot product is 0 and so is every score.
  a.scale = D == 0 ? 0.f : (scale == 0.f ? 1.f / sqrtf(static_cast<float>(D)) : scale);
  a.p = *params;
  auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  // 16-byte cp.async needs 16-byte aligned rows; a zero head size (possibly null pointers) takes the
  // element-wise path, which reads nothing.
  a.vec16 = D > 0 && aligned(q) && aligned(k) && aligned(v) && (D * esize) % 16 == 0 && (D_v * esize) % 16 == 0;

  const bool calibration = params->strength != 0.f, relative = num_buckets > 0;
  if (relative && relative_bias == nullptr)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "relative_bias is NULL with num_buckets > 0");
  void* ws = workspace;
  bool owned = false;
  if (calibration || relative) {
    const attncal::AttentionWorkspace layout = attncal::attention_workspace(B, S_q, N, relative);
    if (ws == nullptr) {
      const cudaError_t e = cudaMallocAsync(&ws, layout.bytes, stream);
      if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMallocAsync", e);
      owned = true;
    }
    unsigned char* w = static_cast<unsigned char*>(ws);
    if (calibration) {
      int* spans = reinterpret_cast<int*>(w);
      a.spans = spans;
      a.queue_count = reinterpret_cast<uint32_t*>(w + layout.queue_count_offset);
      a.queue = reinterpret_cast<uint32_t*>(w + layout.queue_offset);
      rc = attncal::launch_spans(mask, B, S_k, spans, a.queue_count, stream);
    }
    if (relative && rc == ATTNCAL_OK) {
      float* rel = reinterpret_cast<float*>(w + layout.relative_offset);
      const int64_t md = params->relative_max_distance;
      if (dtype == ATTNCAL_DTYPE_FLOAT32) {
        rc = launch_relative<float>(relative_bias, num_buckets, md, N, S_k, rel, stream);
      } else if (dtype == ATTNCAL_DTYPE_FLOAT16) {
        rc = launch_relative<__half>(relative_bias, num_buckets, md, N, S_k, rel, stream);
      } else {
        rc = launch_relative<__nv_bfloat16>(relative_bias, num_buckets, md, N, S_k, rel, stream);
      }
      a.rel = rel;
    }
  }
  if (rc == ATTNCAL_OK) {
    if (dtype == ATTNCAL_DTYPE_FLOAT32) {
      rc = run_typed<float>(a, reference_only, stream);
    } else if (dtype == ATTNCAL_DTYPE_FLOAT16) {
      rc = run_typed<__half>(a, reference_only, stream);
    } else {
      rc = run_typed<__nv_bfloat16>(a, reference_only, stream);
    }
  }
  if (owned) {
    const cudaError_t e = cudaFreeAsync(ws, stream);
    if (e != cudaSuccess && rc == ATTNCAL_OK) rc = fail(ATTNCAL_ERR_CUDA, "cudaFreeAsync", e);
  }
  return rc;
}

}  // namespace

extern "C" size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N, int64_t num_buckets) {
  return attncal::attention_workspace(B, S_q, N, num_buckets > 0).bytes;
}

extern "C" int attncal_cuda_calibrated_attention(int dtype, const void* q, const void* k, const void* v,
                                                 const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                 int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale,
                                                 const void* relative_bias, int64_t num_buckets,
                                                 const AttncalParams* params, void* workspace, void* stream) {
  return run(dtype, q, k, v, mask, out, B, S_q, S_k, N, D, D_v, scale, relative_bias, num_buckets, params, workspace,
             stream, false);
}

extern "C" int attncal_cuda_calibrated_attention_reference(int dtype, const void* q, const void* k, const void* v,
                                                           const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                           int64_t S_k, int64_t N, int64_t D, int64_t D_v,
                                                           float scale, const void* relative_bias, int64_t num_buckets,
                                                           const AttncalParams* params, void* stream) {
  return run(dtype, q, k, v, mask, out, B, S_q, S_k, N, D, D_v, scale, relative_bias, num_buckets, params, nullptr,
             stream, true);
}
