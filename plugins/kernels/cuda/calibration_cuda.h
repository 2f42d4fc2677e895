/* Host-callable C ABI of the CUDA calibration kernels (used by the ORT CUDA
 * kernels, the TensorRT plugin and, through ctypes, benchmarks/gpu_check.py).
 *
 * Rows that are fully masked or not finite (the op contract,
 * attncal/graphs/contract.py): the ops follow the graph they replace.
 *  - attncal_cuda_softmax_calibrate computes ONNX Softmax: scores that are all
 *    the dtype's lowest finite value (how transformers masks) give 1/K at every
 *    key, and a calibrated such row is then calibrated as usual (masked keys are
 *    excluded by the mask, not by the scores); scores that are all -inf, or
 *    hold a NaN or +inf, give NaN at every key (ONNX Runtime's Softmax and
 *    torch.softmax do the same), calibrated row or not.  Partly -inf rows are
 *    ordinary: exp(-inf) = 0.
 *  - attncal_cuda_calibrate: a calibrated row holding a NaN or an infinity at
 *    any key comes back NaN at every key, masked keys included; rows that are
 *    not calibrated are left as they are (in place) or copied bit for bit,
 *    NaN included.
 *  No NaN becomes finite, no finite row becomes NaN, and no row's NaN reaches
 *  another row.  The one-pass calibrated attention kernel states its own rule
 *  (calibrated_attention_cuda.h, the contract in attncal/graphs/contract.py).
 *
 * The kernels are cuda/calibration_kernels.cuh, the launchers calibration_cuda.cu.
 * Compiled with nvcc for sm_80 and sm_90; run only on a GPU machine. */
#ifndef ATTNCAL_CUDA_CALIBRATION_CUDA_H_
#define ATTNCAL_CUDA_CALIBRATION_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "common/attncal_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ATTNCAL_EXPORT __declspec(dllexport)
#else
#define ATTNCAL_EXPORT __attribute__((visibility("default")))
#endif

/* Bytes of device scratch either launcher needs for a batch of B items: the span records of
 * common/span_geometry.h (3 ints per item). */
ATTNCAL_EXPORT size_t attncal_cuda_workspace_bytes(int64_t B);

/* PooledRowCalibration / AllRowsCalibration (params->all_rows): calibrates
 * probs[B,H,Q,K] (dtype ATTNCAL_DTYPE_*) into out on `stream` (a cudaStream_t;
 * NULL = the legacy default stream).  out may alias probs (in place: only the
 * calibrated rows are read and written); otherwise out must not overlap probs,
 * and one kernel writes every row of out (calibrated rows computed, the others
 * copied), so the tensor is read and written once with no separate copy.
 * mask is int64[B,K] on the device.  workspace: device memory of
 * attncal_cuda_workspace_bytes(B) bytes, or NULL to allocate it stream-ordered
 * (not needed, and not allocated, when params->strength == 0).
 * Limits: B, H <= 65535; Q, K < 2^31 (else ATTNCAL_ERR_UNSUPPORTED).  A row's
 * ceil(K / basket_size) basket values are kept in shared memory where they fit
 * and recomputed where they do not (same result), so no basket size is refused.
 * Returns ATTNCAL_OK or an error code; attncal_cuda_last_error() says why. */
ATTNCAL_EXPORT int attncal_cuda_calibrate(int dtype, const void* probs, void* out, const int64_t* mask, int64_t B,
                                          int64_t H, int64_t Q, int64_t K, const AttncalParams* params,
                                          void* workspace, void* stream);

/* SoftmaxPooledRowCalibration / SoftmaxAllRowsCalibration (params->all_rows):
 * out = calibration(Softmax(scores, axis=-1), mask), where scores[B,H,Q,K] are
 * the attention logits after scaling and the additive mask.  Every row gets the
 * softmax (max-subtracted, in float32; a row of equal finite scores gives 1/K,
 * a row of -inf scores NaN, as above); the
 * rows the calibration spec selects are calibrated as attncal_cuda_calibrate
 * does on the softmax output, in the same pass.  params->strength == 0 is a
 * plain softmax.  Same conventions, limits, workspace and errors as
 * attncal_cuda_calibrate; out may alias scores (in place) or must not overlap it. */
ATTNCAL_EXPORT int attncal_cuda_softmax_calibrate(int dtype, const void* scores, void* out, const int64_t* mask,
                                                  int64_t B, int64_t H, int64_t Q, int64_t K,
                                                  const AttncalParams* params, void* workspace, void* stream);

/* The reason for the last failure on the calling thread ("" when none). */
ATTNCAL_EXPORT const char* attncal_cuda_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_CUDA_CALIBRATION_CUDA_H_ */
