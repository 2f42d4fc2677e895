// CUDAExecutionProvider kernels: thin adapters from the Lite custom-op API to
// the CUDA launchers (kernels/calibration_cuda.h, kernels/calibrated_attention_cuda.h),
// on ORT's compute stream:
// PooledRowCalibration / AllRowsCalibration (input: probs) call
// attncal_cuda_calibrate; SoftmaxPooledRowCalibration /
// SoftmaxAllRowsCalibration (input: scores, the softmax's input) call
// attncal_cuda_softmax_calibrate; PooledRowCalibratedAttention /
// AllRowsCalibratedAttention (query, key, value, attention_mask) call
// attncal_cuda_calibrated_attention.  float and float16 each.
//
// The attention ops get no in-place map (their output is the context, not a
// rewritten input): AllOps in attncal_ort.cc gives them InferAttentionContext
// instead of AllowInplace, by name.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include "attncal_ort_common.h"
#include "attention_shape.h"  // attncal::AttentionShape, filled by CheckAttentionShapes
#include "calibrated_attention_cuda.h"
#include "calibration_cuda.h"

namespace attncal_ort {

const bool kHasCuda = true;

namespace {

using Ort::Custom::Tensor;

template <typename T, bool AllRows, bool Softmax>
struct CudaCalibration {
  Attributes attrs;

  CudaCalibration(const OrtApi* api, const OrtKernelInfo* info) : attrs(ReadAttributes(api, info, AllRows)) {}

  // probs: the attention probabilities, or for the Softmax* ops the scores.
  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& probs, const Tensor<int64_t>& mask,
                      Tensor<T>& out) {
    const char* op = OpName(AllRows, Softmax);
    if (!attrs.error.empty()) return AttributeError(attrs, op);
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = CheckShapes(shape, mask.Shape(), Softmax ? "scores" : "probs");
    if (!st.IsOK()) return st;
    T* dst = out.Allocate(shape);
    void* stream = Ort::KernelContext(context).GetGPUComputeStream();
    g_computes[1].fetch_add(1);
    if (static_cast<const void*>(dst) == static_cast<const void*>(probs.Data())) g_inplace[1].fetch_add(1);
    const int dtype = std::is_same<T, float>::value ? ATTNCAL_DTYPE_FLOAT32 : ATTNCAL_DTYPE_FLOAT16;
    const int rc = (Softmax ? attncal_cuda_softmax_calibrate : attncal_cuda_calibrate)(
        dtype, probs.Data(), dst, mask.Data(), shape[0], shape[1], shape[2], shape[3], &attrs.params, nullptr, stream);
    if (rc != ATTNCAL_OK) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): " + attncal_cuda_last_error()).c_str(),
                         rc == ATTNCAL_ERR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }
};

// Whether two byte ranges overlap (the launcher needs out apart from every input).
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && x < y + b_bytes && y < x + a_bytes;
}

// PooledRowCalibratedAttention / AllRowsCalibratedAttention: shapes and attributes are checked as
// the CPU kernels check them (CheckAttentionShapes, ReadAttentionAttributes), then one launcher call.
// The workspace (about 4 bytes per query row and head) is allocated stream-ordered by the
// launcher, as the calibration ops' is.
template <typename T, bool AllRows>
struct CudaCalibratedAttention {
  AttentionAttributes attrs;

  CudaCalibratedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(ReadAttentionAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& query, const Tensor<T>& key,
                      const Tensor<T>& value, const Tensor<int64_t>& mask, Tensor<T>& out) {
    const char* op = AttentionOpName(AllRows);
    if (!attrs.calibration.error.empty()) return AttributeError(attrs.calibration, op);
    attncal::AttentionShape sh;
    Ort::Status st = CheckAttentionShapes(query.Shape(), key.Shape(), value.Shape(), mask.Shape(), AllRows,
                                          attrs.num_heads, &sh);
    if (!st.IsOK()) return st;
    T* dst = out.Allocate({sh.B, sh.S_q, sh.N * sh.D_v});
    const size_t es = sizeof(T);
    const size_t out_bytes = static_cast<size_t>(sh.B * sh.S_q * sh.N * sh.D_v) * es;
    if (Overlaps(dst, out_bytes, query.Data(), static_cast<size_t>(sh.B * sh.S_q * sh.N * sh.D) * es) ||
        Overlaps(dst, out_bytes, key.Data(), static_cast<size_t>(sh.B * sh.S_k * sh.N * sh.D) * es) ||
        Overlaps(dst, out_bytes, value.Data(), static_cast<size_t>(sh.B * sh.S_k * sh.N * sh.D_v) * es)) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): the context buffer overlaps an input; this op "
                                                        "must not run in place")
                             .c_str(),
                         ORT_FAIL);
    }
    void* stream = Ort::KernelContext(context).GetGPUComputeStream();
    const int dtype = std::is_same<T, float>::value ? ATTNCAL_DTYPE_FLOAT32 : ATTNCAL_DTYPE_FLOAT16;
    const int rc = attncal_cuda_calibrated_attention(dtype, query.Data(), key.Data(), value.Data(), mask.Data(), dst,
                                                     sh.B, sh.S_q, sh.S_k, sh.N, sh.D, sh.D_v, attrs.scale,
                                                     &attrs.calibration.params, nullptr, stream);
    if (rc != ATTNCAL_OK) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): " + attncal_cuda_last_error()).c_str(),
                         rc == ATTNCAL_ERR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }
};

template <typename T, bool AllRows>
void AppendAttention(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<CudaCalibratedAttention<T, AllRows>>(
      AttentionOpName(AllRows), "CUDAExecutionProvider", version, version));
}

template <typename T, bool AllRows, bool Softmax>
void Append(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<CudaCalibration<T, AllRows, Softmax>>(
      OpName(AllRows, Softmax), "CUDAExecutionProvider", version, version));
}

}  // namespace

void AppendCudaOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version) {
  Append<float, false, false>(ops, version);  // PooledRowCalibration
  Append<Ort::Float16_t, false, false>(ops, version);
  Append<float, true, false>(ops, version);  // AllRowsCalibration
  Append<Ort::Float16_t, true, false>(ops, version);
  Append<float, false, true>(ops, version);  // SoftmaxPooledRowCalibration
  Append<Ort::Float16_t, false, true>(ops, version);
  Append<float, true, true>(ops, version);  // SoftmaxAllRowsCalibration
  Append<Ort::Float16_t, true, true>(ops, version);
  AppendAttention<float, false>(ops, version);  // PooledRowCalibratedAttention
  AppendAttention<Ort::Float16_t, false>(ops, version);
  AppendAttention<float, true>(ops, version);  // AllRowsCalibratedAttention
  AppendAttention<Ort::Float16_t, true>(ops, version);
}

}  // namespace attncal_ort
