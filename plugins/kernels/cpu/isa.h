// The instruction-set paths of the host kernels and the one that runs.
//
// On x86-64 every routine that vectorises is compiled three times, for AVX-512 (avx512f + fma), AVX2 (avx2 + fma)
// and baseline x86-64, and called through a dispatcher that reads the active path (ATTNCAL_ISA_DISPATCH).  The
// active path is the widest one this CPU runs, or the one named by the environment variable ATTNCAL_CPU_PATH
// (avx512 | avx2 | default) when the library loads, or the one set later by set_isa_path (the tests run every
// path this CPU supports in one process).  A path the CPU lacks is refused, never run: the library's
// RegisterCustomOps returns isa_error() and the setter returns false.
//
// Why our own dispatch and not GCC's target_clones: the clones' resolver reads the CPU once, at relocation, so no
// test could run the AVX2 or baseline code on an AVX-512 machine, and a target_clones "avx2" clone has no FMA
// (AVX2 does not imply it): its multiply-adds rounded twice where the AVX-512 clone's were fused, so the two paths
// gave different results for the same input.  Here both FMA paths ask for FMA, so GCC contracts the same
// multiply-adds in both, and the two give the same bits (test_the_fma_paths_give_the_same_bits); baseline x86-64 has no
// FMA, and its results differ from theirs by rounding only.
//
// Elsewhere (aarch64, or ATTNCAL_NO_CLONES) there is one path, "default", compiled for the build's target.
#ifndef ATTNCAL_CPU_ISA_H_
#define ATTNCAL_CPU_ISA_H_

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace attncal {

enum class IsaPath : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER) && !defined(ATTNCAL_NO_CLONES)
#define ATTNCAL_ISA_PATHS 1
#else
#define ATTNCAL_ISA_PATHS 0
#endif

constexpr const char* kIsaPathEnv = "ATTNCAL_CPU_PATH";

inline const char* isa_name(IsaPath p) {
  return p == IsaPath::kAvx512 ? "avx512" : p == IsaPath::kAvx2 ? "avx2" : "default";
}

// Whether this CPU (and this build) runs path p.
inline bool isa_supported(IsaPath p) {
#if ATTNCAL_ISA_PATHS
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  if (p == IsaPath::kAvx512) return __builtin_cpu_supports("avx512f") && fma;
  if (p == IsaPath::kAvx2) return __builtin_cpu_supports("avx2") && fma;
#endif
  return p == IsaPath::kDefault;
}

inline IsaPath isa_best() {
  return isa_supported(IsaPath::kAvx512) ? IsaPath::kAvx512
         : isa_supported(IsaPath::kAvx2) ? IsaPath::kAvx2
                                         : IsaPath::kDefault;
}

// The path named `name`, in *out; false for a name that is no path.
inline bool isa_parse(const char* name, IsaPath* out) {
  for (IsaPath p : {IsaPath::kAvx512, IsaPath::kAvx2, IsaPath::kDefault})
    if (std::strcmp(name, isa_name(p)) == 0) {
      *out = p;
      return true;
    }
  return false;
}

namespace isa_detail {

// The active path (an IsaPath) and, when ATTNCAL_CPU_PATH was refused, why (the best path runs meanwhile).
struct Selection {
  std::atomic<int> path{static_cast<int>(isa_best())};
  char error[160] = {};

  Selection() {
    const char* want = std::getenv(kIsaPathEnv);
    IsaPath p;
    if (want == nullptr || want[0] == '\0') return;
    if (!isa_parse(want, &p)) {
      std::snprintf(error, sizeof error, "%s=%.40s is not a CPU path: use avx512, avx2 or default", kIsaPathEnv,
                    want);
    } else if (!isa_supported(p)) {
      std::snprintf(error, sizeof error, "%s=%s: this CPU (or build) lacks that path; it runs %s", kIsaPathEnv,
                    want, isa_name(isa_best()));
    } else {
      path.store(static_cast<int>(p), std::memory_order_relaxed);
    }
  }
};

inline Selection& selection() {
  static Selection s;
  return s;
}

}  // namespace isa_detail

// The path the dispatched routines take now.
inline IsaPath isa_path() {
  return static_cast<IsaPath>(isa_detail::selection().path.load(std::memory_order_relaxed));
}

// Why ATTNCAL_CPU_PATH was refused, or nullptr.
inline const char* isa_error() {
  const char* e = isa_detail::selection().error;
  return e[0] != '\0' ? e : nullptr;
}

// Runs path p from now on; false, changing nothing, when this CPU lacks it.  For tests and benchmarks: a
// computation that is running when the path changes may take either path in each of its routines.
inline bool set_isa_path(IsaPath p) {
  if (!isa_supported(p)) return false;
  isa_detail::selection().path.store(static_cast<int>(p), std::memory_order_relaxed);
  return true;
}

// ATTNCAL_ISA_DISPATCH(ret, name, (params), (args)) defines `name` from `name##_isa`, an ATTNCAL_ISA_BODY function
// with the same parameters: compiled once per path and called through the active one.  Works at namespace scope
// and in a class (static member functions).
#define ATTNCAL_ISA_BODY __attribute__((always_inline)) inline static

#if ATTNCAL_ISA_PATHS
#define ATTNCAL_ISA_SELECT(name, args)                                  \
  switch (::attncal::isa_path()) {                                      \
    case ::attncal::IsaPath::kAvx512:                                   \
      return name##_avx512 args;                                        \
    case ::attncal::IsaPath::kAvx2:                                     \
      return name##_avx2 args;                                          \
    default:                                                            \
      return name##_default args;                                       \
  }
#define ATTNCAL_ISA_DISPATCH(ret, name, params, args)                                                  \
  [[maybe_unused]] __attribute__((target("avx512f,fma"))) static ret name##_avx512 params {             \
    return name##_isa args;                                                                            \
  }                                                                                                    \
  [[maybe_unused]] __attribute__((target("avx2,fma"))) static ret name##_avx2 params {                  \
    return name##_isa args;                                                                            \
  }                                                                                                    \
  [[maybe_unused]] static ret name##_default params { return name##_isa args; }                          \
  [[maybe_unused]] static ret name params { ATTNCAL_ISA_SELECT(name, args) }
#else
#define ATTNCAL_ISA_DISPATCH(ret, name, params, args) \
  [[maybe_unused]] static ret name params { return name##_isa args; }
#endif

}  // namespace attncal

#endif  // ATTNCAL_CPU_ISA_H_
