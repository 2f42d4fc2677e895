/* Host-callable C ABI of the CUDA calibrated-attention kernels:
 * ai.attncal::PooledRowCalibratedAttention and ai.attncal::AllRowsCalibratedAttention
 * (attncal/graphs/contract.py, "Calibrated attention"; float64 spec:
 * attncal.calibration.oracle.attention_reference).  Used by the ORT CUDA kernels
 * (plugins/ort/cuda_ops.cc), the TensorRT plugin
 * (plugins/tensorrt/attncal_trt_attention_plugin.cpp) and, through ctypes,
 * benchmarks/gpu_check.py.  The design, the exact rules and the expected speed are
 * in the comment at the top of calibrated_attention_cuda.cu.
 *
 * Errors are reported through attncal_cuda_last_error() (calibration_cuda.h), the
 * one error string of the library. */
#ifndef ATTNCAL_CALIBRATED_ATTENTION_CUDA_H_
#define ATTNCAL_CALIBRATED_ATTENTION_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "attncal_params.h"
#include "calibration_cuda.h" /* ATTNCAL_EXPORT, attncal_cuda_last_error */

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of device scratch attncal_cuda_calibrated_attention needs: the per-item
 * spans, a counter and one 4-byte slot per (item, head, query row) for the rows
 * handed to the exact per-row kernel (see the .cu).  About 4*B*N*S_q bytes. */
ATTNCAL_EXPORT size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N);

/* PooledRowCalibratedAttention / AllRowsCalibratedAttention (params->all_rows) on `stream`
 * (a cudaStream_t; NULL = the legacy default stream).
 *   dtype: ATTNCAL_DTYPE_FLOAT32, _FLOAT16 or _BFLOAT16 (q, k, v and out alike;
 *          computed in float32, only the context is rounded)
 *   q [B,S_q,N*D], k [B,S_k,N*D], v [B,S_k,N*D_v], mask int64 [B,S_k] (1 = valid key),
 *   out [B,S_q,N*D_v]: device memory, out must not overlap q, k, v or mask.
 *   scale: 0 means 1/sqrt(D).
 *   S_q == S_k for AllRows; S_q == S_k or 1 for PooledRow (1: the single query is the
 *   pooling token's).
 *   workspace: attncal_cuda_attention_workspace_bytes(B, S_q, N) bytes of device memory,
 *   or NULL to allocate it stream-ordered (cudaMallocAsync).  Not used when
 *   params->strength == 0.
 * Limits: B, N <= 65535; S_q, S_k < 2^31; B*N*S_q < 2^32; D + D_v + ceil(S_k / basket_size)
 * floats must fit in one block's shared memory (the per-row kernel's basket sums; else
 * ATTNCAL_ERR_UNSUPPORTED, as the calibration launchers do).  Head sizes up to 128 run on the
 * tiled kernel; larger ones on the per-row kernel (correct, much slower).
 * Returns ATTNCAL_OK or an error code; attncal_cuda_last_error() says why. */
ATTNCAL_EXPORT int attncal_cuda_calibrated_attention(int dtype, const void* q, const void* k, const void* v,
                                                     const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                     int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale,
                                                     const AttncalParams* params, void* workspace, void* stream);

/* The same op computed by the per-row kernel alone (one block per query row, three
 * passes over K and V, the contract's float32 arithmetic written out directly).  For
 * cross-checking the tiled kernel on a GPU (benchmarks/gpu_check.py); slow: O(S_q*S_k)
 * reads of K and V per head.  Needs no workspace beyond what it allocates itself. */
ATTNCAL_EXPORT int attncal_cuda_calibrated_attention_reference(int dtype, const void* q, const void* k,
                                                               const void* v, const int64_t* mask, void* out,
                                                               int64_t B, int64_t S_q, int64_t S_k, int64_t N,
                                                               int64_t D, int64_t D_v, float scale,
                                                               const AttncalParams* params, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_CALIBRATED_ATTENTION_CUDA_H_ */
