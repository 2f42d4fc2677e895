// ONNX Runtime custom-op library for the calibration op contract:
// domain ai.attncal, version 1, PooledRowCalibration and AllRowsCalibration
// and their Softmax-fused forms (SoftmaxPooledRowCalibration,
// SoftmaxAllRowsCalibration: input 0 is the scores), float and float16, on CPUExecutionProvider (always) and
// CUDAExecutionProvider (when built with CUDA).  Load it with
// SessionOptions.register_custom_ops_library(path); ORT then runs these
// kernels instead of inlining the model-local function of the same name.
//
// Bad inputs (wrong rank, mask shape mismatch, invalid attributes) come back
// as an ORT error status; nothing here throws across the C boundary.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "attncal_ort_common.h"
#include "calibration_cpu.h"

namespace attncal_ort {

std::atomic<uint64_t> g_computes[2];
std::atomic<uint64_t> g_inplace[2];

OrtStatusPtr ORT_API_CALL InferSameAsProbs(const OrtCustomOp*, OrtShapeInferContext* ctx);

// Output 0 may reuse input 0 (probs): the op rewrites rows of the attention
// probabilities, so in place saves a [B,H,Q,K] buffer and, for the pooled
// op, all but B*H rows of traffic.  ORT frees the arrays with ReleaseMayInplace.
size_t ORT_API_CALL MayInplace(int** input_index, int** output_index) {
  *input_index = new int[1]{0};
  *output_index = new int[1]{0};
  return 1;
}

void ORT_API_CALL ReleaseMayInplace(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

// Shape inference and the in-place map, for every op of the library.
void AllowInplace(Ort::Custom::OrtLiteCustomOp* op) {
  op->InferOutputShapeFn = &InferSameAsProbs;
  op->GetMayInplace = &MayInplace;
  op->ReleaseMayInplace = &ReleaseMayInplace;
}

Attributes ReadAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows) {
  Attributes a;
  a.params = AttncalParams{};
  a.params.all_rows = all_rows ? 1 : 0;
  auto get_int = [&](const char* name, int32_t* dst) {
    if (!a.error.empty()) return;
    int64_t v = 0;
    OrtStatus* st = api->KernelInfoGetAttribute_int64(info, name, &v);
    if (st != nullptr) {
      api->ReleaseStatus(st);
      a.error = std::string("missing or non-integer attribute '") + name + "'";
      return;
    }
    if (v < INT32_MIN || v > INT32_MAX) {
      a.error = std::string("attribute '") + name + "' is out of range";
      return;
    }
    *dst = static_cast<int32_t>(v);
  };
  auto get_float = [&](const char* name, float* dst) {
    if (!a.error.empty()) return;
    OrtStatus* st = api->KernelInfoGetAttribute_float(info, name, dst);
    if (st != nullptr) {
      api->ReleaseStatus(st);
      a.error = std::string("missing or non-float attribute '") + name + "'";
    }
  };
  if (!all_rows) get_int("pool_last", &a.params.pool_last);
  get_int("basket_size", &a.params.basket_size);
  get_float("strength", &a.params.strength);
  get_int("isolate_first", &a.params.isolate_first);
  get_int("isolate_last", &a.params.isolate_last);
  get_int("first_mode", &a.params.first_mode);
  get_int("last_mode", &a.params.last_mode);
  get_float("first_weight", &a.params.first_weight);
  get_float("last_weight", &a.params.last_weight);
  get_int("skip_short", &a.params.skip_short);
  int32_t layer = 0;
  get_int("layer", &layer);  // informational, but part of the contract
  if (a.error.empty()) {
    char msg[200];
    if (attncal_validate_params(&a.params, msg, sizeof msg) != ATTNCAL_OK) a.error = msg;
  }
  return a;
}

Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask, const char* input) {
  if (probs.size() != 4) {
    return Ort::Status(
        (std::string("attncal: ") + input + " must have rank 4 [B,H,Q,K], got rank " + std::to_string(probs.size()))
            .c_str(),
        ORT_INVALID_ARGUMENT);
  }
  if (mask.size() != 2 || mask[0] != probs[0] || mask[1] != probs[3]) {
    std::string got = "[";
    for (size_t i = 0; i < mask.size(); ++i) got += (i ? "," : "") + std::to_string(mask[i]);
    got += "]";
    return Ort::Status(("attncal: attention_mask must be [B,K]=[" + std::to_string(probs[0]) + "," +
                        std::to_string(probs[3]) + "], got " + got)
                           .c_str(),
                       ORT_INVALID_ARGUMENT);
  }
  return Ort::Status{nullptr};
}

// Output 0 has probs' type and shape (symbolic dims included).  Known output
// shapes are what lets ORT's planner reuse the probs buffer: GetMayInplace
// needs equal sizes.  Written against the C API because the C++ helper
// (ShapeInferContext::SetOutputShape) drops symbolic dims in ORT 1.32.  A rank
// other than 4 is left to Compute, which reports it.
//
// An unknown dim without a name (common inside exported graphs, e.g. the
// [B,H,1,K] scores that row placement builds with Expand/GatherElements)
// reaches us as -1 with an empty symbolic name, and SetOutputTypeShape would
// write it back as the *known* value -1: downstream inference then folds
// Shape() to a constant [-1,...] and a later Expand fails with "invalid expand
// shape".  The C API cannot express an anonymous unknown dim, so in that case
// the output is left without a shape (ORT infers it at run time).  Nothing is
// lost: the planner only reuses a buffer when every dim is a known value or a
// named symbol on both sides, which an anonymous dim never is.
OrtStatusPtr ORT_API_CALL InferSameAsProbs(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  size_t n = 0, rank = 0;
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputCount(ctx, &n)) return st;
  if (n < 1) return nullptr;
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &info)) return st;
  if (OrtStatusPtr st = api.GetDimensionsCount(info, &rank)) return st;
  if (rank != 4) return nullptr;
  int64_t dims[4] = {0, 0, 0, 0};
  const char* names[4] = {nullptr, nullptr, nullptr, nullptr};
  if (OrtStatusPtr st = api.GetDimensions(info, dims, rank)) return st;
  if (OrtStatusPtr st = api.GetSymbolicDimensions(info, names, rank)) return st;
  for (size_t i = 0; i < rank; ++i) {
    if (dims[i] < 0 && (names[i] == nullptr || names[i][0] == '\0')) return nullptr;
  }
  return api.ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

Ort::Status AttributeError(const Attributes& a, const char* op) {
  return Ort::Status((std::string("attncal ") + op + ": " + a.error).c_str(), ORT_INVALID_ARGUMENT);
}

}  // namespace attncal_ort

namespace {

using attncal_ort::Attributes;
using Ort::Custom::OrtLiteCustomOp;
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

  CpuCalibration(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(attncal_ort::ReadAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& probs, const Tensor<int64_t>& mask,
                      Tensor<T>& out) {
    const char* op = attncal_ort::OpName(AllRows, Softmax);
    if (!attrs.error.empty()) return attncal_ort::AttributeError(attrs, op);
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = attncal_ort::CheckShapes(shape, mask.Shape(), Softmax ? "scores" : "probs");
    if (!st.IsOK()) return st;
    // With GetMayInplace ORT may hand back the input's buffer as the output.
    const Raw* src = reinterpret_cast<const Raw*>(probs.Data());
    Raw* dst = reinterpret_cast<Raw*>(out.Allocate(shape));
    attncal_ort::g_computes[0].fetch_add(1);
    if (static_cast<const void*>(dst) == static_cast<const void*>(src)) attncal_ort::g_inplace[0].fetch_add(1);
    const attncal::Plan plan(mask.Data(), shape[0], shape[1], shape[2], shape[3], attrs.params,
                             Softmax || dst != src);
    if (plan.size() == 0) return Ort::Status{nullptr};
    using Job = ParallelJob<Raw, Softmax>;
    Job job{&plan, src, dst, &attrs.params};
    if (plan.size() == 1) {
      Job::Run(&job, 0);
      return Ort::Status{nullptr};
    }
    try {
      Ort::KernelContext(context).ParallelFor(&Job::Run, plan.size(), 0, &job);
    } catch (const Ort::Exception& e) {
      return Ort::Status((std::string("attncal ") + op + ": " + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }
};

const char* kDomain = "ai.attncal";
constexpr int kVersion = 1;

std::vector<std::unique_ptr<OrtLiteCustomOp>>& AllOps() {
  static std::vector<std::unique_ptr<OrtLiteCustomOp>> ops = [] {
    std::vector<std::unique_ptr<OrtLiteCustomOp>> v;
    const char* cpu = "CPUExecutionProvider";
    // start_ver = end_ver = 1: the contract is version 1 of the domain.
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, false>>("PooledRowCalibration", cpu, kVersion,
                                                                                 kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, false>>("PooledRowCalibration", cpu,
                                                                                          kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, true>>("AllRowsCalibration", cpu, kVersion,
                                                                                kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, true>>("AllRowsCalibration", cpu,
                                                                                         kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, false, true>>(
        "SoftmaxPooledRowCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, false, true>>(
        "SoftmaxPooledRowCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, true, true>>(
        "SoftmaxAllRowsCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, true, true>>(
        "SoftmaxAllRowsCalibration", cpu, kVersion, kVersion));
    attncal_ort::AppendCudaOps(v, kVersion);
    for (auto& op : v) attncal_ort::AllowInplace(op.get());
    return v;
  }();
  return ops;
}

std::mutex g_domains_mutex;
std::vector<Ort::CustomOpDomain>& Domains() {
  static std::vector<Ort::CustomOpDomain> domains;
  return domains;
}

}  // namespace

extern "C" {

ATTNCAL_ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // The loading runtime is older than the headers; nothing else can be used.
    return nullptr;
  }
  Ort::InitApi(api);
  try {
    Ort::CustomOpDomain domain{kDomain};
    for (auto& op : AllOps()) domain.Add(op.get());
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(g_domains_mutex);
    Domains().push_back(std::move(domain));  // must outlive the sessions
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

// Debug counters, read through ctypes by the tests: how many times a native
// kernel ran (provider 0 = CPU, 1 = CUDA).  They prove that ORT executed the
// library's kernel rather than the inlined function body.
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_compute_count(int provider) {
  return (provider == 0 || provider == 1) ? attncal_ort::g_computes[provider].load() : 0;
}

// How many of those runs computed in place (ORT reused the probs buffer).
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_inplace_count(int provider) {
  return (provider == 0 || provider == 1) ? attncal_ort::g_inplace[provider].load() : 0;
}

ATTNCAL_ORT_EXPORT int attncal_has_cuda(void) { return attncal_ort::kHasCuda ? 1 : 0; }

}  // extern "C"
