// ONNX Runtime custom-op library for the calibration op contract:
// domain ai.attncal, version 1, PooledRowCalibration and AllRowsCalibration,
// float and float16, on CPUExecutionProvider (always) and
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
#include <vector>

#include "attncal_ort_common.h"
#include "calibration_cpu.h"

namespace attncal_ort {

std::atomic<uint64_t> g_computes[2];

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

Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask) {
  if (probs.size() != 4) {
    return Ort::Status(("attncal: probs must have rank 4 [B,H,Q,K], got rank " + std::to_string(probs.size())).c_str(),
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

Ort::Status AttributeError(const Attributes& a, const char* op) {
  return Ort::Status((std::string("attncal ") + op + ": " + a.error).c_str(), ORT_INVALID_ARGUMENT);
}

}  // namespace attncal_ort

namespace {

using attncal_ort::Attributes;
using Ort::Custom::OrtLiteCustomOp;
using Ort::Custom::Tensor;

inline float load_f(float v) { return v; }
inline float load_h(Ort::Float16_t v) { return v.ToFloat(); }
inline float store_f(float v) { return v; }
inline Ort::Float16_t store_h(float v) { return Ort::Float16_t(v); }

template <typename T, bool AllRows>
struct CpuCalibration {
  Attributes attrs;

  CpuCalibration(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(attncal_ort::ReadAttributes(api, info, AllRows)) {}

  Ort::Status Compute(const Tensor<T>& probs, const Tensor<int64_t>& mask, Tensor<T>& out) {
    const char* op = AllRows ? "AllRowsCalibration" : "PooledRowCalibration";
    if (!attrs.error.empty()) return attncal_ort::AttributeError(attrs, op);
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = attncal_ort::CheckShapes(shape, mask.Shape());
    if (!st.IsOK()) return st;
    T* dst = out.Allocate(shape);
    attncal_ort::g_computes[0].fetch_add(1);
    if constexpr (std::is_same<T, float>::value) {
      attncal::calibrate(probs.Data(), dst, mask.Data(), shape[0], shape[1], shape[2], shape[3], attrs.params, load_f,
                         store_f);
    } else {
      attncal::calibrate(probs.Data(), dst, mask.Data(), shape[0], shape[1], shape[2], shape[3], attrs.params, load_h,
                         store_h);
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
    attncal_ort::AppendCudaOps(v, kVersion);
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

ATTNCAL_ORT_EXPORT int attncal_has_cuda(void) { return attncal_ort::kHasCuda ? 1 : 0; }

}  // extern "C"
