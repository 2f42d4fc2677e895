// The CUDA provider's registration in a build without nvcc: the library then carries the CPU kernels
// only (attncal_has_cuda() returns 0), and a CUDA session inlines the ops' function bodies.
#include "ort_common.h"

namespace attncal_ort {
namespace cuda {

const bool kBuilt = false;

void RegisterOps(Ort::CustomOpDomain&) {}

}  // namespace cuda
}  // namespace attncal_ort
