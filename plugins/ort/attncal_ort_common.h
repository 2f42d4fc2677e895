// Declarations shared by the CPU and CUDA halves of the ORT custom-op library.
#ifndef ATTNCAL_ORT_COMMON_H_
#define ATTNCAL_ORT_COMMON_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attention_shape.h"
#include "attncal_params.h"

#define ATTNCAL_ORT_EXPORT __attribute__((visibility("default")))

namespace attncal_ort {

// The contract op type of a kernel (for messages and registration).
constexpr const char* OpName(bool all_rows, bool softmax) {
  return softmax ? (all_rows ? "SoftmaxAllRowsCalibration" : "SoftmaxPooledRowCalibration")
                 : (all_rows ? "AllRowsCalibration" : "PooledRowCalibration");
}

constexpr const char* AttentionOpName(bool all_rows) {
  return all_rows ? "AllRowsCalibratedAttention" : "PooledRowCalibratedAttention";
}

struct Attributes {
  AttncalParams params;
  std::string error;  // non-empty: the node's attributes break the contract
};

Attributes ReadAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows);

// The calibrated attention ops' attributes: the calibration's plus num_heads and scale (0 = 1/sqrt(D)).
struct AttentionAttributes {
  Attributes calibration;  // calibration.error also reports a bad num_heads or scale
  int64_t num_heads = 0;
  float scale = 0.f;
};
AttentionAttributes ReadAttentionAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows);
// `input`: the name of input 0 in messages ("probs", or "scores" for the Softmax-fused ops).
Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask,
                        const char* input = "probs");
Ort::Status AttributeError(const Attributes& a, const char* op);

extern std::atomic<uint64_t> g_computes[2];  // [0] CPU, [1] CUDA
extern std::atomic<uint64_t> g_inplace[2];   // computes where ORT gave out == probs
extern std::atomic<uint64_t> g_attention_computes;  // CPU calibrated attention runs
void AllowInplace(Ort::Custom::OrtLiteCustomOp* op);
extern const bool kHasCuda;

// Adds the CUDAExecutionProvider kernels (no-op in a CPU-only build).  The caller then gives every
// op its shape inference: the calibration ops may compute in place (AllowInplace), the calibrated
// attention ops (IsAttentionOp) get InferAttentionContext and never run in place.
void AppendCudaOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version);
inline bool IsAttentionOp(const char* name) {
  const std::string n(name);
  return n == AttentionOpName(false) || n == AttentionOpName(true);
}
OrtStatusPtr ORT_API_CALL InferAttentionContext(const OrtCustomOp* op, OrtShapeInferContext* ctx);
// One input's type/shape as shape inference sees it: `ok` when the input exists and has the expected rank
// (<= 3); dims are -1 and names non-empty where a dim is symbolic.
struct InputShape {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  int64_t dims[3] = {0, 0, 0};
  const char* names[3] = {nullptr, nullptr, nullptr};
  bool ok = false;
};
OrtStatusPtr ReadInputShape(OrtShapeInferContext* ctx, size_t index, size_t rank, InputShape* shape);
// Writes output 0 as a rank-3 tensor of `type_of`'s element type with these dims and symbolic names; writes
// nothing when a dim is unknown without a name (ORT then infers it at run time).
OrtStatusPtr SetContextShape(OrtShapeInferContext* ctx, const OrtTensorTypeAndShapeInfo* type_of,
                             const int64_t (&dims)[3], const char* const (&names)[3]);
// Checks query/key/value/mask shapes against the contract; fills `shape` (scale left to the caller).
Ort::Status CheckAttentionShapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                 const std::vector<int64_t>& v, const std::vector<int64_t>& mask, bool all_rows,
                                 int64_t num_heads, attncal::AttentionShape* shape);

}  // namespace attncal_ort

#endif  // ATTNCAL_ORT_COMMON_H_
