// What the CPU kernels of the library share: running a plan's work units on ONNX Runtime's intra-op
// thread pool, and the job of the calibrated attention units (the plain and the projected op both run
// cpu/calibrated_attention.h's AttentionPlan).
#ifndef ATTNCAL_ORT_CPU_JOBS_H_
#define ATTNCAL_ORT_CPU_JOBS_H_

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>

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

// Memory from the session's CPU arena for the length of a Compute: ORT keeps the arena's pages from one run to
// the next, so a kernel's workspace is not faulted in anew on every call (a fresh allocation of tens of MiB
// costs about as much as what the packed key tiles save).  Ort::Allocator::Alloc throws where there is no room.
class ArenaBuffer {
 public:
  ArenaBuffer(OrtKernelContext* context, size_t bytes)
      : alloc_(Ort::KernelContext(context).GetAllocator(*Ort::MemoryInfo::CreateCpu(OrtArenaAllocator,
                                                                                   OrtMemTypeDefault))),
        data_(alloc_.Alloc(bytes)) {}
  ~ArenaBuffer() { alloc_.Free(data_); }
  ArenaBuffer(const ArenaBuffer&) = delete;
  ArenaBuffer& operator=(const ArenaBuffer&) = delete;
  float* floats() const { return static_cast<float*>(data_); }

 private:
  Ort::Allocator alloc_;
  void* data_;
};

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

// Runs an attention plan's units.  Long float32 rows share their packed key tiles through a store in the arena
// (AttentionPlan::share_tiles); where the arena has no room for it, each unit packs its own, which computes the
// same bits.
template <typename T>
Ort::Status RunAttention(OrtKernelContext* context, attncal::AttentionPlan& plan, const T* q, const T* k, const T* v,
                         T* out, const AttncalParams* params, const char* op) {
  std::optional<ArenaBuffer> store;
  if constexpr (std::is_same<T, float>::value) {
    if (const int64_t floats = plan.tile_store_floats(); floats > 0) {
      try {
        store.emplace(context, sizeof(float) * static_cast<size_t>(floats));
        plan.share_tiles(store->floats());
      } catch (const Ort::Exception&) {
        store.reset();
      }
    }
  }
  AttentionJob<T> job{&plan, q, k, v, out, params};
  return RunUnits(context, &AttentionJob<T>::Run, plan.size(), &job, op);
}

// Appends the projected calibrated attention ops' kernels (projected_attention.cc) on execution provider
// `ep`: part of RegisterOps (cpu_ops.cc), the CPU provider's one registration.
void AppendProjectedOps(OpList& ops, const char* ep);

}  // namespace cpu
}  // namespace attncal_ort

#endif  // ATTNCAL_ORT_CPU_JOBS_H_
