// What the ONNX Runtime custom-op library's parts share: the op names of the contract, reading a
// node's attributes (ort_attributes.cc), the shape checks and output shape inference
// (ort_shapes.cc), the debug counters (defined with their exported readers in attncal_ort.cc), and
// the one registration entry per execution provider:
//   cpu::RegisterOps   ort/cpu/cpu_ops.cc     every op on CPUExecutionProvider
//   cuda::RegisterOps  ort/cuda/cuda_ops.cc   the CUDA kernels on CUDAExecutionProvider, or
//                      ort/cuda/no_cuda.cc    nothing, in a build without nvcc
// attncal_ort.cc, the library's entry point, only creates the domain and calls them.
#ifndef ATTNCAL_ORT_COMMON_H_
#define ATTNCAL_ORT_COMMON_H_

// Every part of the library calls Ort::InitApi through the entry point (RegisterCustomOps) before it
// uses the C++ API, so no part initialises it at load time.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/attention_shape.h"
#include "common/attncal_params.h"

#define ATTNCAL_ORT_EXPORT __attribute__((visibility("default")))

namespace attncal_ort {

constexpr const char* kDomain = "ai.attncal";
constexpr int kVersion = 1;  // start_ver = end_ver = 1: the contract is version 1 of the domain

// The contract op type of a kernel (for messages and registration).
constexpr const char* OpName(bool all_rows, bool softmax) {
  return softmax ? (all_rows ? "SoftmaxAllRowsCalibration" : "SoftmaxPooledRowCalibration")
                 : (all_rows ? "AllRowsCalibration" : "PooledRowCalibration");
}

constexpr const char* AttentionOpName(bool all_rows) {
  return all_rows ? "AllRowsCalibratedAttention" : "PooledRowCalibratedAttention";
}

constexpr const char* ProjectedOpName(bool all_rows) {
  return all_rows ? "AllRowsCalibratedProjectedAttention" : "PooledRowCalibratedProjectedAttention";
}

// ------------------------------------------------------------------ attributes (ort_attributes.cc)
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
Ort::Status AttributeError(const Attributes& a, const char* op);

// ------------------------------------------------------------------ shapes (ort_shapes.cc)
// `input`: the name of input 0 in messages ("probs", or "scores" for the Softmax-fused ops).
Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask,
                        const char* input = "probs");
// Checks query/key/value/mask shapes against the contract (num_heads, num_kv_heads and the window from `p`);
// fills `shape` (scale left to the caller).
Ort::Status CheckAttentionShapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                 const std::vector<int64_t>& v, const std::vector<int64_t>& mask, bool all_rows,
                                 const AttncalParams& p, attncal::AttentionShape* shape);
// The projected ops' input [B,S,H_in], weight [H_in,3*N*D], bias [3*N*D] and mask [B,S]; fills `shape`
// (the packed Q|K|V layout: row strides 3*N*D) and the input's hidden size.
Ort::Status CheckProjectedShapes(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                 const std::vector<int64_t>& b, const std::vector<int64_t>& mask, const AttncalParams& p,
                                 attncal::AttentionShape* shape, int64_t* hidden_in);

// The calibrated attention ops' optional relative position bias: `table` (the relative_bias input's shape,
// or nullptr when the node has none) against the relative_max_distance attribute and the checked `shape`:
// [num_buckets, N] with a valid bucket function (common/relative_position.h), self-attention, and the input
// present exactly when the attribute is set.  `op` names the op in the message.
Ort::Status CheckRelativeBias(const AttncalParams& p, const std::vector<int64_t>* table,
                              const attncal::AttentionShape& shape, const char* op);

// What every kernel checks before it computes, in this order: the node's attributes (the error
// ReadAttributes recorded), then the shapes.  The message names the op (OpName, AttentionOpName).
Ort::Status CheckCalibration(const Attributes& attrs, bool all_rows, bool softmax, const std::vector<int64_t>& input,
                             const std::vector<int64_t>& mask);
Ort::Status CheckAttention(const AttentionAttributes& attrs, bool all_rows, const std::vector<int64_t>& q,
                           const std::vector<int64_t>& k, const std::vector<int64_t>& v,
                           const std::vector<int64_t>& mask, attncal::AttentionShape* shape);

// What an op's output shape inference is, set when it is registered: the calibration ops may compute
// in place (output 0 reuses input 0); the calibrated attention ops' output is the context, inferred
// from query and value (kAttention) or from the input and the weight (kProjected), never in place.
enum class OpKind { kCalibration, kAttention, kProjected };
void SetShapeInference(Ort::Custom::OrtLiteCustomOp* op, OpKind kind);

// The ops a provider registers, created once and kept for the process: ONNX Runtime holds the ops of
// every session's domain by pointer.
using OpList = std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>;

// Appends op `Kernel` (a Lite custom-op struct: a constructor from the kernel info and a Compute) as
// `name` on execution provider `ep`, with the shape inference of its kind.
template <typename Kernel>
void Append(OpList& ops, const char* name, const char* ep, OpKind kind) {
  Ort::Custom::OrtLiteCustomOp* op = Ort::Custom::CreateLiteCustomOp<Kernel>(name, ep, kVersion, kVersion);
  SetShapeInference(op, kind);
  ops.emplace_back(op);
}

// Appends, on `ep`, the float and float16 kernels of the four calibration ops (Calibration<T, all_rows,
// softmax>) and of the two calibrated attention ops (Attention<T, all_rows>): the op set every provider
// of the library has, in one order.
template <template <typename, bool, bool> class Calibration, template <typename, bool> class Attention>
void AppendCalibrationAndAttentionOps(OpList& v, const char* ep) {
  using F16 = Ort::Float16_t;
  const OpKind calibration = OpKind::kCalibration, attention = OpKind::kAttention;
  Append<Calibration<float, false, false>>(v, OpName(false, false), ep, calibration);
  Append<Calibration<F16, false, false>>(v, OpName(false, false), ep, calibration);
  Append<Calibration<float, true, false>>(v, OpName(true, false), ep, calibration);
  Append<Calibration<F16, true, false>>(v, OpName(true, false), ep, calibration);
  Append<Calibration<float, false, true>>(v, OpName(false, true), ep, calibration);
  Append<Calibration<F16, false, true>>(v, OpName(false, true), ep, calibration);
  Append<Calibration<float, true, true>>(v, OpName(true, true), ep, calibration);
  Append<Calibration<F16, true, true>>(v, OpName(true, true), ep, calibration);
  Append<Attention<float, false>>(v, AttentionOpName(false), ep, attention);
  Append<Attention<F16, false>>(v, AttentionOpName(false), ep, attention);
  Append<Attention<float, true>>(v, AttentionOpName(true), ep, attention);
  Append<Attention<F16, true>>(v, AttentionOpName(true), ep, attention);
}

// ------------------------------------------------------------------ debug counters (attncal_ort.cc)
extern std::atomic<uint64_t> g_computes[2];  // calibration-op runs: [0] CPU, [1] CUDA
extern std::atomic<uint64_t> g_inplace[2];   // of those, the runs where ORT gave out == probs
extern std::atomic<uint64_t> g_attention_computes;  // CPU calibrated attention runs (projected or not)
extern std::atomic<uint64_t> g_packed_projections;  // projected runs that projected with the packed weight

// ------------------------------------------------------------------ one registration per provider
namespace cpu {
// Adds the CPUExecutionProvider kernels of every op of the domain (created once, kept for the process).
void RegisterOps(Ort::CustomOpDomain& domain);
}  // namespace cpu

namespace cuda {
extern const bool kBuilt;  // whether the library carries the CUDA kernels
// Adds the CUDAExecutionProvider kernels (nothing in a build without CUDA).
void RegisterOps(Ort::CustomOpDomain& domain);
}  // namespace cuda

}  // namespace attncal_ort

#endif  // ATTNCAL_ORT_COMMON_H_
