// CUDAExecutionProvider kernels: thin adapters from the Lite custom-op API to
// the CUDA launchers (kernels/calibration_cuda.h), on ORT's compute stream:
// PooledRowCalibration / AllRowsCalibration (input: probs) call
// attncal_cuda_calibrate; SoftmaxPooledRowCalibration /
// SoftmaxAllRowsCalibration (input: scores, the softmax's input) call
// attncal_cuda_softmax_calibrate.  float and float16 each.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <string>

#include "attncal_ort_common.h"
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
}

}  // namespace attncal_ort
