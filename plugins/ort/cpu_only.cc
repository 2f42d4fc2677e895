// CPU-only build: no CUDA kernels to register.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include "attncal_ort_common.h"

namespace attncal_ort {
const bool kHasCuda = false;
void AppendCudaOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>&, int) {}
}  // namespace attncal_ort
