// CUDAExecutionProvider kernels: thin adapters from the Lite custom-op API to
// the CUDA launcher (kernels/calibration_cuda.h), on ORT's compute stream.
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

template <typename T, bool AllRows>
struct CudaCalibration {
  Attributes attrs;

  CudaCalibration(const OrtApi* api, const OrtKernelInfo* info) : attrs(ReadAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& probs, const Tensor<int64_t>& mask,
                      Tensor<T>& out) {
    const char* op = AllRows ? "AllRowsCalibration" : "PooledRowCalibration";
    if (!attrs.error.empty()) return AttributeError(attrs, op);
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = CheckShapes(shape, mask.Shape());
    if (!st.IsOK()) return st;
    T* dst = out.Allocate(shape);
    void* stream = Ort::KernelContext(context).GetGPUComputeStream();
    g_computes[1].fetch_add(1);
    if (static_cast<const void*>(dst) == static_cast<const void*>(probs.Data())) g_inplace[1].fetch_add(1);
    const int dtype = std::is_same<T, float>::value ? ATTNCAL_DTYPE_FLOAT32 : ATTNCAL_DTYPE_FLOAT16;
    const int rc = attncal_cuda_calibrate(dtype, probs.Data(), dst, mask.Data(), shape[0], shape[1], shape[2],
                                          shape[3], &attrs.params, nullptr, stream);
    if (rc != ATTNCAL_OK) {
      return Ort::Status((std::string("attncal ") + op + " (CUDA): " + attncal_cuda_last_error()).c_str(),
                         rc == ATTNCAL_ERR_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }
};

}  // namespace

void AppendCudaOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops, int version) {
  const char* ep = "CUDAExecutionProvider";
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<CudaCalibration<float, false>>("PooledRowCalibration", ep, version, version));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<CudaCalibration<Ort::Float16_t, false>>("PooledRowCalibration", ep,
                                                                                           version, version));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<CudaCalibration<float, true>>("AllRowsCalibration", ep, version, version));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<CudaCalibration<Ort::Float16_t, true>>("AllRowsCalibration", ep,
                                                                                          version, version));
}

}  // namespace attncal_ort
