// ONNX Runtime custom-op library for the calibration op contract:
// domain ai.attncal, version 1, PooledRowCalibration and AllRowsCalibration
// and their Softmax-fused forms (SoftmaxPooledRowCalibration,
// SoftmaxAllRowsCalibration: input 0 is the scores), the calibrated attention
// ops (projected or not), float and float16, on CPUExecutionProvider (always)
// and CUDAExecutionProvider (when built with CUDA).  Load it with
// SessionOptions.register_custom_ops_library(path); ORT then runs these
// kernels instead of inlining the model-local function of the same name.
//
// Bad inputs (wrong rank, mask shape mismatch, invalid attributes) come back
// as an ORT error status; nothing here throws across the C boundary.
//
// This file is the entry point only: RegisterCustomOps creates the domain and lets each execution
// provider register its kernels (ort/cpu/cpu_ops.cc, ort/cuda/cuda_ops.cc or ort/cuda/no_cuda.cc),
// and the debug counters the kernels increment are defined here beside their exported readers.
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "common/relative_position.h"
#include "cpu/gemm.h"  // kGemmBackend
#include "cpu/isa.h"
#include "ort_common.h"

namespace attncal_ort {

std::atomic<uint64_t> g_computes[2];
std::atomic<uint64_t> g_inplace[2];
std::atomic<uint64_t> g_attention_computes{0};
std::atomic<uint64_t> g_packed_projections{0};

}  // namespace attncal_ort

namespace {

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
  if (const char* error = attncal::isa_error()) return api->CreateStatus(ORT_INVALID_ARGUMENT, error);
  try {
    Ort::CustomOpDomain domain{attncal_ort::kDomain};
    attncal_ort::cpu::RegisterOps(domain);
    attncal_ort::cuda::RegisterOps(domain);
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

// How many times the CPU calibrated attention kernel ran (projected or not).
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_attention_count(void) { return attncal_ort::g_attention_computes.load(); }

// How many projected calibrated attention runs projected with the packed weight (cpu/packed_gemm.h).
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_packed_projection_count(void) {
  return attncal_ort::g_packed_projections.load();
}

// The GEMM the CPU calibrated attention kernel was built with ("openblas", "eigen" or "builtin").
ATTNCAL_ORT_EXPORT const char* attncal_gemm_backend(void) { return attncal::kGemmBackend; }

// The relative position buckets the kernels use, for offsets first, first + 1, ..., first + count - 1 (the
// tests compare them with torch's and the Python twin's); -1 when the bucket function has no value there.
ATTNCAL_ORT_EXPORT int attncal_relative_buckets(int64_t buckets, int64_t max_distance, int64_t first, int64_t count,
                                                int64_t* out) {
  if (!attncal::relative_buckets_valid(buckets, max_distance)) return -1;
  const float span = attncal::relative_log_span(buckets, max_distance);
  for (int64_t i = 0; i < count; ++i) out[i] = attncal::relative_bucket(first + i, buckets, span);
  return 0;
}

// The instruction-set path the CPU kernels take (cpu/isa.h): "avx512", "avx2" or "default".
ATTNCAL_ORT_EXPORT const char* attncal_cpu_path(void) { return attncal::isa_name(attncal::isa_path()); }

// Whether this CPU runs the path named `name`.
ATTNCAL_ORT_EXPORT int attncal_cpu_path_supported(const char* name) {
  attncal::IsaPath p;
  return name != nullptr && attncal::isa_parse(name, &p) && attncal::isa_supported(p) ? 1 : 0;
}

// Makes the CPU kernels take the path named `name` from now on (tests and benchmarks: every path in one
// process); 0 on success, -1 (nothing changed) for a name that is no path or one this CPU lacks.
ATTNCAL_ORT_EXPORT int attncal_set_cpu_path(const char* name) {
  attncal::IsaPath p;
  return name != nullptr && attncal::isa_parse(name, &p) && attncal::set_isa_path(p) ? 0 : -1;
}

ATTNCAL_ORT_EXPORT int attncal_has_cuda(void) { return attncal_ort::cuda::kBuilt ? 1 : 0; }

}  // extern "C"
