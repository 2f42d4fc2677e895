// Declarations shared by the CPU and CUDA halves of the ORT custom-op library.
#ifndef ATTNCAL_ORT_COMMON_H_
#define ATTNCAL_ORT_COMMON_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attncal_params.h"

#define ATTNCAL_ORT_EXPORT __attribute__((visibility("default")))

namespace attncal_ort {

// The contract op type of a kernel (for messages and registration).
constexpr const char* OpName(bool all_rows, bool softmax) {
  return softmax ? (all_rows ? "SoftmaxAllRowsCalibration" : "SoftmaxPooledRowCalibration")
                 : (all_rows ? "AllRowsCalibration" : "PooledRowCalibration");
}

struct Attributes {
  AttncalParams params;
  std::string error;  // non-empty: the node's attributes break the contract
};

Attributes ReadAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows);
// `input`: the name of input 0 in messages ("probs", or "scores" for the Softmax-fused ops).
Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask,
                        const char* input = "probs");
Ort::Status AttributeError(const Attributes& a, const char* op);

extern std::atomic<uint64_t> g_computes[2];  // [0] CPU, [1] CUDA
extern std::atomic<uint64_t> g_inplace[2];   // computes where ORT gave out == probs
void AllowInplace(Ort::Custom::OrtLiteCustomOp* op);
extern const bool kHasCuda;

// Adds the CUDAExecutionProvider kernels (no-op in a CPU-only build).
void AppendCudaOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version);

}  // namespace attncal_ort

#endif  // ATTNCAL_ORT_COMMON_H_
