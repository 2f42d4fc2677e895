// The CUDAExecutionProvider kernels: thin adapters from the Lite custom-op API to the CUDA launchers
// (kernels/cuda/calibration_cuda.h, kernels/cuda/calibrated_attention_cuda.h), on ORT's compute stream,
// and their registration:
// PooledRowCalibration / AllRowsCalibration (input: probs) call attncal_cuda_calibrate;
// SoftmaxPooledRowCalibration / SoftmaxAllRowsCalibration (input: scores, the softmax's input) call
// attncal_cuda_softmax_calibrate; PooledRowCalibratedAttention / AllRowsCalibratedAttention (query,
// key, value, attention_mask, and the optional relative_bias table) call
// attncal_cuda_calibrated_attention.  float and float16 each.
//
// The calibration ops may run in place (OpKind::kCalibration: ORT may give output 0 the buffer of
// input 0); the attention ops' output is the context, never a rewritten input (OpKind::kAttention).
// Compiled wherever nvcc is found; run only on a GPU machine (none where this library is tested).
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/attention_shape.h"  // attncal::AttentionShape, filled by CheckAttention
#include "cuda/calibrated_attention_cuda.h"
#include "cuda/calibration_cuda.h"
#include "ort_common.h"

namespace attncal_ort {
namespace cuda {

const bool kBuilt = true;

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
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = CheckCalibration(attrs, AllRows, Softmax, shape, mask.Shape());
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
// the CPU kernels check them (ReadAttentionAttributes, CheckAttention: key and value with num_kv_heads
// heads, a window only with S_q == S_k; CheckRelativeBias: the relative_bias table [num_buckets, N]
// exactly with relative_max_distance, and S_q == S_k), then one launcher call, which reads the geometry
// from the params and the table (in T, as given) from the device.  The workspace (about 4 bytes per
// query row and head, and the bias per head and offset) is allocated stream-ordered by the launcher,
// as the calibration ops' is.
template <typename T, bool AllRows>
struct CudaCalibratedAttention {
  AttentionAttributes attrs;

  CudaCalibratedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(ReadAttentionAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& query, const Tensor<T>& key,
                      const Tensor<T>& value, const Tensor<int64_t>& mask,
                      std::optional<const Tensor<T>*> relative_bias, Tensor<T>& out) {
    const char* op = AttentionOpName(AllRows);
    attncal::AttentionShape sh;
    Ort::Status st = CheckAttention(attrs, AllRows, query.Shape(), key.Shape(), value.Shape(), mask.Shape(), &sh);
    if (!st.IsOK()) return st;
    const Tensor<T>* table = relative_bias.has_value() ? *relative_bias : nullptr;
    st = CheckRelativeBias(attrs.calibration.params, table != nullptr ? &table->Shape() : nullptr, sh, op);
    if (!st.IsOK()) return st;
    T* dst = out.Allocate({sh.B, sh.S_q, sh.N * sh.D_v});
    const size_t es = sizeof(T);
    const size_t out_bytes = static_cast<size_t>(sh.B * sh.S_q * sh.N * sh.D_v) * es;
    const int64_t kv = sh.kv_heads();  // key and value hold N_kv heads (GQA)
    if (Overlaps(dst, out_bytes, query.Data(), static_cast<size_t>(sh.B * sh.S_q * sh.N * sh.D) * es) ||
        Overlaps(dst, out_bytes, key.Data(), static_cast<size_t>(sh.B * sh.S_k * kv * sh.D) * es) ||
        Overlaps(dst, out_bytes, value.Data(), static_cast<size_t>(sh.B * sh.S_k * kv * sh.D_v) * es)) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): the context buffer overlaps an input; this op "
                                                        "must not run in place")
                             .c_str(),
                         ORT_FAIL);
    }
    void* stream = Ort::KernelContext(context).GetGPUComputeStream();
    const int dtype = std::is_same<T, float>::value ? ATTNCAL_DTYPE_FLOAT32 : ATTNCAL_DTYPE_FLOAT16;
    // The bias table in T on the device, as the node gives it: the launcher reads it in that type.
    const void* rel = table != nullptr ? static_cast<const void*>(table->Data()) : nullptr;
    const int64_t buckets = table != nullptr ? table->Shape()[0] : 0;
    const int rc = attncal_cuda_calibrated_attention(dtype, query.Data(), key.Data(), value.Data(), mask.Data(), dst,
                                                     sh.B, sh.S_q, sh.S_k, sh.N, sh.D, sh.D_v, attrs.scale, rel,
                                                     buckets, &attrs.calibration.params, nullptr, stream);
    if (rc != ATTNCAL_OK) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): " + attncal_cuda_last_error()).c_str(),
                         rc == ATTNCAL_ERR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }
};

}  // namespace

void RegisterOps(Ort::CustomOpDomain& domain) {
  static const OpList ops = [] {  // on the first registration, after Ort::InitApi
    OpList v;
    AppendCalibrationAndAttentionOps<CudaCalibration, CudaCalibratedAttention>(v, "CUDAExecutionProvider");
    return v;
  }();
  for (const auto& op : ops) domain.Add(op.get());
}

}  // namespace cuda
}  // namespace attncal_ort
