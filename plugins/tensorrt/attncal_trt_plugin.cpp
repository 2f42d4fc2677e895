// TensorRT IPluginV3 plugin for the calibration ops: a thin adapter over the
// CUDA launchers (kernels/cuda/calibration_cuda.h).  Four op types:
// PooledRowCalibration and AllRowsCalibration (input 0: the attention
// probabilities; attncal_cuda_calibrate) and SoftmaxPooledRowCalibration and
// SoftmaxAllRowsCalibration (input 0: the softmax's input scores; the softmax
// and the calibration in one pass, attncal_cuda_softmax_calibrate).  Two
// creators per op type, with the op's name and version "1": one in namespace ""
// (what the ONNX parser looks up by default) and one in namespace "ai.attncal"
// (the op's domain, for nodes that carry plugin_namespace="ai.attncal"), so 8
// creators.  TensorRT >= 10.7 prefers a registered plugin over the model-local
// function of the same op name.  Built with ATTNCAL_TRT_WITH_ATTENTION (as CMake
// builds libattncal_trt_plugin.so), getCreators also lists the 4 creators of the
// calibrated attention ops (attncal_trt_attention_plugin.cpp): 12 in all.  The
// attribute fields are read by attncal_trt_fields.h (the shared parser), and what
// the plugin and creator classes of both files have alike is in
// attncal_trt_plugin_base.h.
//
// The build capability is IPluginV3OneBuildV2 (TensorRT >= 10.3): output 0 may
// alias input 0 (getAliasedInput(0) == 0), since every launcher works in place.
// TensorRT only asks, and only aliases, when the builder config enables
// PreviewFeature::kALIASED_PLUGIN_IO_10_03; otherwise the output is a separate
// buffer and the launchers run out of place.
//
// CI compiles this file against the public TensorRT 10.5.0 and 11.1 headers and
// runs its TensorRT-facing logic in a host test (tests/test_native_trt.py); no
// engine is built there (no libnvinfer, no GPU).  CMake builds the plugin when
// TensorRT is found or ATTNCAL_TENSORRT_INCLUDE_DIR names headers.
#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <vector>

#include "attncal_trt_fields.h"
#include "attncal_trt_plugin_base.h"
#include "cuda/calibration_cuda.h"

using namespace nvinfer1;

#ifdef ATTNCAL_TRT_WITH_ATTENTION
// attncal_trt_attention_plugin.cpp: the calibrated attention ops' creators, listed by getCreators below
// so that one library (one getCreators) serves every op of the contract.
namespace attncal_trt {
IPluginCreatorInterface* const* attention_creators(int32_t& nbCreators);
}
#endif

namespace {

using attncal_trt::kDomain;

constexpr char const* kOps[] = {"PooledRowCalibration", "AllRowsCalibration", "SoftmaxPooledRowCalibration",
                                "SoftmaxAllRowsCalibration"};

bool is_all_rows(char const* op) {
  return !strcmp(op, "AllRowsCalibration") || !strcmp(op, "SoftmaxAllRowsCalibration");
}
bool is_softmax(char const* op) { return !strncmp(op, "Softmax", 7); }

// Capabilities, identity, the single output, the fields to serialise and attachToContext:
// attncal_trt_plugin_base.h.
class CalibrationPlugin : public attncal_trt::PluginBase<IPluginV3OneBuildV2> {
 public:
  // name: the op type (one of kOps); p.all_rows must match it.
  CalibrationPlugin(std::string name, std::string ns, AttncalParams p)
      : PluginBase(std::move(name), std::move(ns)), p_(p), softmax_(is_softmax(name_.c_str())) {
    set_fields(p_, /*attention=*/false);
  }

  // IPluginV3
  IPluginV3* clone() noexcept override { return new (std::nothrow) CalibrationPlugin(name_, ns_, p_); }

  // IPluginV3OneBuildV2: output 0 may be written into input 0's buffer (the
  // launchers work in place).  Called, and effective, only when the builder
  // enables PreviewFeature::kALIASED_PLUGIN_IO_10_03.
  int32_t getAliasedInput(int32_t outputIndex) noexcept override { return outputIndex == 0 ? 0 : -1; }

  // IPluginV3OneBuild
  int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t nbOutputs) noexcept override {
    return nbInputs == 2 && nbOutputs == 1 ? 0 : -1;
  }
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != 1 || nbInputs != 2) return -1;
    outputTypes[0] = inputTypes[0];
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
                          int32_t nbOutputs, IExprBuilder&) noexcept override {
    if (nbInputs != 2 || nbOutputs != 1 || inputs[0].nbDims != 4 || inputs[1].nbDims != 2) return -1;
    outputs[0] = inputs[0];
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t, int32_t) noexcept override {
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    if (pos == 0) return d.type == DataType::kFLOAT || d.type == DataType::kHALF;
    if (pos == 1) return d.type == DataType::kINT64;
    return d.type == inOut[0].desc.type;  // output
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t, DynamicPluginTensorDesc const*,
                          int32_t) const noexcept override {
    return attncal_cuda_workspace_bytes(inputs[0].max.d[0]);
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t) noexcept override {
    if (nbInputs != 2 || in[0].dims.nbDims != 4 || in[1].dims.nbDims != 2) return -1;
    if (in[1].dims.d[0] != in[0].dims.d[0] || in[1].dims.d[1] != in[0].dims.d[3]) return -1;
    return 0;
  }
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
    Dims const& d = inputDesc[0].dims;
    const int dtype = inputDesc[0].type == DataType::kHALF ? ATTNCAL_DTYPE_FLOAT16 : ATTNCAL_DTYPE_FLOAT32;
    return (softmax_ ? attncal_cuda_softmax_calibrate : attncal_cuda_calibrate)(
        dtype, inputs[0], outputs[0], static_cast<int64_t const*>(inputs[1]), d.d[0], d.d[1], d.d[2], d.d[3], &p_,
        workspace, stream);
  }

 private:
  AttncalParams p_;
  bool softmax_;  // Softmax* op: input 0 is the scores
};

// Identity and field names (the calibration fields): attncal_trt_plugin_base.h.
class CalibrationCreator : public attncal_trt::CreatorBase {
 public:
  CalibrationCreator(char const* op, char const* ns) : CreatorBase(op, ns, is_all_rows(op), /*attention=*/false) {}
  IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    AttncalParams p;
    if (!parse(fc, &p)) return nullptr;  // refused: the reason is reported (attncal_trt_last_error)
    return new (std::nothrow) CalibrationPlugin(op_, ns_, p);
  }
};

}  // namespace

// Entry points for IPluginRegistry::loadLibrary / trtexec --dynamicPlugins.
// The finder is kept: a refused createPlugin logs its reason through it (attncal_trt_fields.h).
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder* finder) {
  attncal_trt::logger_finder() = finder;
}

// Why this thread's last createPlugin refused its fields, naming them ("" after one that succeeded).
extern "C" __attribute__((visibility("default"))) char const* attncal_trt_last_error(void) {
  return attncal_trt::last_error().c_str();
}

extern "C" __attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static CalibrationCreator pooled_default(kOps[0], ""), all_default(kOps[1], "");
  static CalibrationCreator pooled_domain(kOps[0], kDomain), all_domain(kOps[1], kDomain);
  static CalibrationCreator sm_pooled_default(kOps[2], ""), sm_all_default(kOps[3], "");
  static CalibrationCreator sm_pooled_domain(kOps[2], kDomain), sm_all_domain(kOps[3], kDomain);
  static IPluginCreatorInterface* const creators[] = {&pooled_default,    &all_default,    &pooled_domain,
                                                      &all_domain,        &sm_pooled_default, &sm_all_default,
                                                      &sm_pooled_domain,  &sm_all_domain};
  constexpr int32_t n = static_cast<int32_t>(sizeof creators / sizeof creators[0]);
#ifdef ATTNCAL_TRT_WITH_ATTENTION
  static std::vector<IPluginCreatorInterface*> const all = [] {
    std::vector<IPluginCreatorInterface*> v(creators, creators + n);
    int32_t na = 0;
    IPluginCreatorInterface* const* attention = attncal_trt::attention_creators(na);
    v.insert(v.end(), attention, attention + na);
    return v;
  }();
  nbCreators = static_cast<int32_t>(all.size());
  return all.data();
#else
  nbCreators = n;
  return creators;
#endif
}

// Static registration when the library is simply loaded (trtexec --staticPlugins, ctypes.CDLL in polygraphy).
namespace {
struct RegisterOnLoad {
  RegisterOnLoad() {
    int32_t n = 0;
    IPluginCreatorInterface* const* list = getCreators(n);
    IPluginRegistry* registry = getPluginRegistry();
    for (int32_t i = 0; registry != nullptr && i < n; ++i) {
      // Every creator of the list is an IPluginCreatorV3One (calibration and attention alike).
      auto* c = static_cast<IPluginCreatorV3One*>(list[i]);
      registry->registerCreator(*list[i], c->getPluginNamespace());
    }
  }
} g_register_on_load;
}  // namespace
