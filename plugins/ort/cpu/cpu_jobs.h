// What the CPU kernels of the library share: running a plan's work units on ONNX Runtime's intra-op
// thread pool, and the job of the calibrated attention units (the plain and the projected op both run
// cpu/calibrated_attention.h's AttentionPlan).
#ifndef ATTNCAL_ORT_CPU_JOBS_H_
#define ATTNCAL_ORT_CPU_JOBS_H_

#include <cstddef>
#include <string>

#include "common/attncal_params.h"
#include "cpu/calibrated_attention.h"
#include "ort_common.h"

namespace attncal_ort {
namespace cpu {

// Runs n work units: inline when there is one, else on ORT's intra-op thread pool (ParallelFor).
inline Ort::Status RunUnits(OrtKernelContext* context, void (*run)(void*, size_t), size_t n, void* job,
                            const char* op) {
  if (n == 1) {
    run(job, 0);
    return Ort::Status{nullptr};
  }
  try {
    Ort::KernelContext(context).ParallelFor(run, n, 0, job);
  } catch (const Ort::Exception& e) {
    return Ort::Status((std::string("attncal ") + op + ": " + e.what()).c_str(), ORT_FAIL);
  }
  return Ort::Status{nullptr};
}

// The calibrated attention ops: units of (item, head, block of query rows) on the intra-op pool.
template <typename T>
struct AttentionJob {
  const attncal::AttentionPlan* plan;
  const T *q, *k, *v;
  T* out;
  const AttncalParams* params;
  static void Run(void* self, size_t i) {
    auto* job = static_cast<AttentionJob*>(self);
    job->plan->run(i, job->q, job->k, job->v, job->out, *job->params);
  }
};

// Appends the projected calibrated attention ops' kernels (projected_attention.cc) on execution provider
// `ep`: part of RegisterOps (cpu_ops.cc), the CPU provider's one registration.
void AppendProjectedOps(OpList& ops, const char* ep);

}  // namespace cpu
}  // namespace attncal_ort

#endif  // ATTNCAL_ORT_CPU_JOBS_H_
