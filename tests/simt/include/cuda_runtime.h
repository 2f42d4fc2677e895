// Stand-in for CUDA's cuda_runtime.h (tests/simt): the SIMT runtime (simt/runtime.h), the PTX models
// (simt/ptx.h) and the host API the launchers call, on a simulated device whose opt-in shared memory and
// SM count are set by simt_configure_device (runtime.cpp).  Device memory is host memory; every launch
// runs to completion before it returns, and an error it hit is what cudaGetLastError reports.
#ifndef SIMT_CUDA_RUNTIME_H_
#define SIMT_CUDA_RUNTIME_H_

#include <cstddef>

#include "simt/ptx.h"
#include "simt/runtime.h"

typedef struct CUstream_st* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes;  // static shared memory: 0 in the simulator (not measured per kernel)
  int maxThreadsPerBlock;
  int maxDynamicSharedSizeBytes;
};

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);  // the simulator's own message for a failed launch
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func);
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value);
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();

#endif  // SIMT_CUDA_RUNTIME_H_
