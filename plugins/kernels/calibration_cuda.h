/* Host-callable C ABI of the CUDA calibration kernel (used by the ORT CUDA
 * kernel, the TensorRT plugin and, through ctypes, benchmarks/gpu_check.py). */
#ifndef ATTNCAL_CALIBRATION_CUDA_H_
#define ATTNCAL_CALIBRATION_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "attncal_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ATTNCAL_EXPORT __declspec(dllexport)
#else
#define ATTNCAL_EXPORT __attribute__((visibility("default")))
#endif

/* Bytes of device scratch the launcher needs for a batch of B items. */
ATTNCAL_EXPORT size_t attncal_cuda_workspace_bytes(int64_t B);

/* Calibrates probs[B,H,Q,K] (dtype ATTNCAL_DTYPE_*) into out on `stream`
 * (a cudaStream_t; NULL = the legacy default stream).  out may alias probs
 * (in place); otherwise the input is copied first and the calibrated rows are
 * overwritten.  mask is int64[B,K] on the device.  workspace: device memory of
 * attncal_cuda_workspace_bytes(B) bytes, or NULL to allocate it stream-ordered.
 * Returns ATTNCAL_OK or an error code; attncal_cuda_last_error() says why. */
ATTNCAL_EXPORT int attncal_cuda_calibrate(int dtype, const void* probs, void* out, const int64_t* mask, int64_t B,
                                          int64_t H, int64_t Q, int64_t K, const AttncalParams* params,
                                          void* workspace, void* stream);

/* The reason for the last failure on the calling thread ("" when none). */
ATTNCAL_EXPORT const char* attncal_cuda_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_CALIBRATION_CUDA_H_ */
