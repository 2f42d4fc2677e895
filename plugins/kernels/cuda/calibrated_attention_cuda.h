/* Host-callable C ABI of the CUDA calibrated-attention kernels:
 * ai.attncal::PooledRowCalibratedAttention and ai.attncal::AllRowsCalibratedAttention
 * (attncal/graphs/contract.py, "Calibrated attention"; float64 spec:
 * attncal.calibration.oracle.attention_reference).  Used by the ORT CUDA kernels
 * (plugins/ort/cuda/cuda_ops.cc), the TensorRT plugin
 * (plugins/tensorrt/attncal_trt_attention_plugin.cpp) and, through ctypes,
 * benchmarks/gpu_check.py.  The design, the exact rules and the expected speed are
 * in the comment at the top of attention_tiled.cuh; the launchers (how a device's
 * shared memory picks the configuration) are calibrated_attention_cuda.cu.
 * Compiled with nvcc for sm_80 and sm_90; run only on a GPU machine.
 *
 * Errors are reported through attncal_cuda_last_error() (calibration_cuda.h), the
 * one error string of the library. */
#ifndef ATTNCAL_CUDA_CALIBRATED_ATTENTION_CUDA_H_
#define ATTNCAL_CUDA_CALIBRATED_ATTENTION_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "common/attncal_params.h"
#include "cuda/calibration_cuda.h" /* ATTNCAL_EXPORT, attncal_cuda_last_error */

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of device scratch attncal_cuda_calibrated_attention needs: the per-item
 * span records (common/span_geometry.h), a counter and one 4-byte slot per (item,
 * head, query row) for the rows handed to the exact per-row kernel, and with a
 * relative position bias (num_buckets > 0) its float32 rows per head and offset,
 * 4*N*(2*S_q - 1) bytes (the layout: cuda/launch_config.h, attention_workspace).
 * About 4*B*N*S_q bytes, 4*(B+2)*N*S_q with the bias. */
ATTNCAL_EXPORT size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N, int64_t num_buckets);

/* PooledRowCalibratedAttention / AllRowsCalibratedAttention (params->all_rows) on `stream`
 * (a cudaStream_t; NULL = the legacy default stream).
 *   dtype: ATTNCAL_DTYPE_FLOAT32, _FLOAT16 or _BFLOAT16 (q, k, v, relative_bias and out alike;
 *          computed in float32, only the context is rounded)
 *   q [B,S_q,N*D], k [B,S_k,N_kv*D], v [B,S_k,N_kv*D_v], mask int64 [B,S_k] (1 = valid key),
 *   out [B,S_q,N*D_v]: device memory, out must not overlap q, k, v or mask.
 *   The geometry is params': N_kv = num_kv_heads (0 = N; it must divide N; query head h reads
 *   key/value head h / (N / N_kv)), and the window window_left, window_right (-1 = no bound; a
 *   window needs S_q == S_k): a key outside a query's window gets the mask's additive bias.
 *   relative_bias [num_buckets, N] (device memory), num_buckets: the relative position bias
 *   (T5's encoder, MPNet): every score of head h at query q and key k gets
 *   relative_bias[bucket(k - q), h] (common/relative_position.h, with max distance
 *   params->relative_max_distance), after the scale and before the mask's bias.  num_buckets 0
 *   = no bias (relative_bias is not read); otherwise num_buckets >= 4, relative_max_distance >
 *   num_buckets / 4 and S_q == S_k, and relative_max_distance > 0 exactly when num_buckets > 0.
 *   scale: 0 means 1/sqrt(D).
 *   S_q == S_k for AllRows; S_q == S_k or 1 for PooledRow (1: the single query is the
 *   pooling token's).
 *   workspace: attncal_cuda_attention_workspace_bytes(B, S_q, N, num_buckets) bytes of device
 *   memory, or NULL to allocate it stream-ordered (cudaMallocAsync).  Not used when
 *   params->strength == 0 and num_buckets == 0.
 * Limits: B, N <= 65535; S_q, S_k < 2^31; B*N*S_q < 2^32 (else ATTNCAL_ERR_UNSUPPORTED).
 * Shared memory limits nothing: each block class takes the largest configuration the
 * device's opt-in limit holds (cuda/launch_config.h), down to the per-row kernel, whose
 * own buffers fall back to global memory or recomputation where they do not fit.  Head
 * sizes up to 128 run on the tiled kernel; larger ones on the per-row kernel (correct,
 * much slower).
 * Returns ATTNCAL_OK or an error code; attncal_cuda_last_error() says why. */
ATTNCAL_EXPORT int attncal_cuda_calibrated_attention(int dtype, const void* q, const void* k, const void* v,
                                                     const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                     int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale,
                                                     const void* relative_bias, int64_t num_buckets,
                                                     const AttncalParams* params, void* workspace, void* stream);

/* The same op computed by the per-row kernel alone (one block per query row, three
 * passes over K and V, the contract's float32 arithmetic written out directly).  For
 * cross-checking the tiled kernel on a GPU (benchmarks/gpu_check.py); slow: O(S_q*S_k)
 * reads of K and V per head.  Needs no workspace beyond what it allocates itself. */
ATTNCAL_EXPORT int attncal_cuda_calibrated_attention_reference(int dtype, const void* q, const void* k,
                                                               const void* v, const int64_t* mask, void* out,
                                                               int64_t B, int64_t S_q, int64_t S_k, int64_t N,
                                                               int64_t D, int64_t D_v, float scale,
                                                               const void* relative_bias, int64_t num_buckets,
                                                               const AttncalParams* params, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_CUDA_CALIBRATED_ATTENTION_CUDA_H_ */
