// The CPUExecutionProvider kernels of every ai.attncal op, float and float16 (the projected ops float32
// only), and their registration: the calibration ops (cpu/batch_plan.h's work units), the calibrated
// attention ops (cpu/calibrated_attention.h's), and the projected calibrated attention ops
// (projected_attention.cc).  Each kernel checks attributes and shapes as the contract says, then runs
// its plan's units on ONNX Runtime's intra-op thread pool; a unit's size depends only on the shapes,
// so the results are bit-identical at any thread count.
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/batch_plan.h"
#include "cpu/calibrated_attention.h"
#include "cpu/gemm.h"
#include "cpu_jobs.h"
#include "ort_common.h"

namespace attncal_ort {
namespace cpu {

namespace {

using Ort::Custom::Tensor;

// The kernel's work units run on ORT's intra-op thread pool (ParallelFor).
template <typename T, bool Softmax>
struct ParallelJob {
  const attncal::Plan* plan;
  const T* in;
  T* out;
  const AttncalParams* params;
  static void Run(void* self, size_t i) {
    auto* job = static_cast<ParallelJob*>(self);
    job->plan->template run<Softmax>(i, job->in, job->out, *job->params);
  }
};

// Softmax = false: input 0 is probs; true: input 0 is the scores and every row gets its softmax.
template <typename T, bool AllRows, bool Softmax = false>
struct CpuCalibration {
  // float16 is handled as its raw bits; the kernel widens each row to float.
  using Raw = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  Attributes attrs;

  CpuCalibration(const OrtApi* api, const OrtKernelInfo* info) : attrs(ReadAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& probs, const Tensor<int64_t>& mask,
                      Tensor<T>& out) {
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = CheckCalibration(attrs, AllRows, Softmax, shape, mask.Shape());
    if (!st.IsOK()) return st;
    // With GetMayInplace ORT may hand back the input's buffer as the output.
    const Raw* src = reinterpret_cast<const Raw*>(probs.Data());
    Raw* dst = reinterpret_cast<Raw*>(out.Allocate(shape));
    g_computes[0].fetch_add(1);
    if (static_cast<const void*>(dst) == static_cast<const void*>(src)) g_inplace[0].fetch_add(1);
    const attncal::Plan plan(mask.Data(), shape[0], shape[1], shape[2], shape[3], attrs.params,
                             Softmax || dst != src);
    if (plan.size() == 0) return Ort::Status{nullptr};
    using Job = ParallelJob<Raw, Softmax>;
    Job job{&plan, src, dst, &attrs.params};
    return RunUnits(context, &Job::Run, plan.size(), &job, OpName(AllRows, Softmax));
  }
};

template <typename T, bool AllRows>
struct CpuCalibratedAttention {
  using Raw = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  AttentionAttributes attrs;

  CpuCalibratedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(ReadAttentionAttributes(api, info, AllRows)) {
    attncal::gemm_init();
  }

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& query, const Tensor<T>& key,
                      const Tensor<T>& value, const Tensor<int64_t>& mask,
                      std::optional<const Tensor<T>*> relative_bias, Tensor<T>& out) {
    attncal::AttentionShape shape;
    Ort::Status st = CheckAttention(attrs, AllRows, query.Shape(), key.Shape(), value.Shape(), mask.Shape(), &shape);
    if (!st.IsOK()) return st;
    const Tensor<T>* table = relative_bias.has_value() ? *relative_bias : nullptr;
    st = CheckRelativeBias(attrs.calibration.params, table != nullptr ? &table->Shape() : nullptr, shape,
                           AttentionOpName(AllRows));
    if (!st.IsOK()) return st;
    shape.scale = attrs.scale != 0.f ? attrs.scale : 1.0f / std::sqrt(static_cast<float>(shape.D));
    Raw* dst = reinterpret_cast<Raw*>(out.Allocate({shape.B, shape.S_q, shape.N * shape.D_v}));
    g_attention_computes.fetch_add(1);
    // The table in float (a float16 one widened: buckets x heads values).
    std::vector<float> widened;
    attncal::RelativeBias rel;
    if (table != nullptr) {
      const std::vector<int64_t> dims = table->Shape();
      rel.buckets = dims[0];
      rel.heads = dims[1];
      rel.max_distance = attrs.calibration.params.relative_max_distance;
      if constexpr (std::is_same<T, float>::value) {
        rel.table = table->Data();
      } else {
        widened.resize(static_cast<size_t>(rel.buckets * rel.heads));
        attncal::widen_row(reinterpret_cast<const uint16_t*>(table->Data()), widened.data(), rel.buckets * rel.heads);
        rel.table = widened.data();
      }
    }
    attncal::AttentionPlan plan(mask.Data(), shape, attrs.calibration.params, rel);
    if (plan.size() == 0) return Ort::Status{nullptr};
    return RunAttention(context, plan, reinterpret_cast<const Raw*>(query.Data()),
                        reinterpret_cast<const Raw*>(key.Data()), reinterpret_cast<const Raw*>(value.Data()), dst,
                        &attrs.calibration.params, AttentionOpName(AllRows));
  }
};

}  // namespace

void RegisterOps(Ort::CustomOpDomain& domain) {
  static const OpList ops = [] {  // on the first registration, after Ort::InitApi
    OpList v;
    AppendCalibrationAndAttentionOps<CpuCalibration, CpuCalibratedAttention>(v, "CPUExecutionProvider");
    AppendProjectedOps(v, "CPUExecutionProvider");  // float32 only
    return v;
  }();
  for (const auto& op : ops) domain.Add(op.get());
}

}  // namespace cpu
}  // namespace attncal_ort
