// TensorRT IPluginV3 plugin for the calibration ops: a thin adapter over the
// CUDA launchers (kernels/calibration_cuda.h).  Four op types:
// PooledRowCalibration and AllRowsCalibration (input 0: the attention
// probabilities; attncal_cuda_calibrate) and SoftmaxPooledRowCalibration and
// SoftmaxAllRowsCalibration (input 0: the softmax's input scores; the softmax
// and the calibration in one pass, attncal_cuda_softmax_calibrate).  Two
// creators per op type, with the op's name and version "1": one in namespace ""
// (what the ONNX parser looks up by default) and one in namespace "ai.attncal"
// (the op's domain, for nodes that carry plugin_namespace="ai.attncal"), so 8
// creators.  TensorRT >= 10.7 prefers a registered plugin over the model-local
// function of the same op name.
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

#include "calibration_cuda.h"

using namespace nvinfer1;

namespace {

constexpr char const* kVersion = "1";
constexpr char const* kDomain = "ai.attncal";
constexpr char const* kOps[] = {"PooledRowCalibration", "AllRowsCalibration", "SoftmaxPooledRowCalibration",
                                "SoftmaxAllRowsCalibration"};

bool is_all_rows(char const* op) {
  return !strcmp(op, "AllRowsCalibration") || !strcmp(op, "SoftmaxAllRowsCalibration");
}
bool is_softmax(char const* op) { return !strncmp(op, "Softmax", 7); }

struct FieldSpec {
  char const* name;
  bool is_float;
};
constexpr FieldSpec kFields[] = {{"pool_last", false},    {"basket_size", false},  {"strength", true},
                                 {"isolate_first", false}, {"isolate_last", false}, {"first_mode", false},
                                 {"last_mode", false},     {"first_weight", true},  {"last_weight", true},
                                 {"skip_short", false},    {"layer", false}};

int32_t* int_slot(AttncalParams& p, char const* name) {
  if (!strcmp(name, "pool_last")) return &p.pool_last;
  if (!strcmp(name, "basket_size")) return &p.basket_size;
  if (!strcmp(name, "isolate_first")) return &p.isolate_first;
  if (!strcmp(name, "isolate_last")) return &p.isolate_last;
  if (!strcmp(name, "first_mode")) return &p.first_mode;
  if (!strcmp(name, "last_mode")) return &p.last_mode;
  if (!strcmp(name, "skip_short")) return &p.skip_short;
  return nullptr;
}

float* float_slot(AttncalParams& p, char const* name) {
  if (!strcmp(name, "strength")) return &p.strength;
  if (!strcmp(name, "first_weight")) return &p.first_weight;
  if (!strcmp(name, "last_weight")) return &p.last_weight;
  return nullptr;
}

// Reads the attributes whatever numeric width the parser used; false on a
// missing/ill-typed field or invalid values.
bool parse_fields(PluginFieldCollection const* fc, bool all_rows, AttncalParams* out) {
  AttncalParams p{};
  p.all_rows = all_rows;
  int seen = 0;
  for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    if (f.length < 1 || f.data == nullptr) continue;
    double v;
    switch (f.type) {
      case PluginFieldType::kINT32: v = *static_cast<int32_t const*>(f.data); break;
      case PluginFieldType::kINT64: v = static_cast<double>(*static_cast<int64_t const*>(f.data)); break;
      case PluginFieldType::kFLOAT32: v = *static_cast<float const*>(f.data); break;
      case PluginFieldType::kFLOAT64: v = *static_cast<double const*>(f.data); break;
      default: continue;
    }
    if (int32_t* s = int_slot(p, f.name)) {
      *s = static_cast<int32_t>(v);
      ++seen;
    } else if (float* s = float_slot(p, f.name)) {
      *s = static_cast<float>(v);
      ++seen;
    }
  }
  if (seen < (all_rows ? 9 : 10)) return false;
  if (attncal_validate_params(&p, nullptr, 0) != ATTNCAL_OK) return false;
  *out = p;
  return true;
}

class CalibrationPlugin : public IPluginV3,
                          public IPluginV3OneCore,
                          public IPluginV3OneBuildV2,
                          public IPluginV3OneRuntime {
 public:
  // name: the op type (one of kOps); p.all_rows must match it.
  CalibrationPlugin(std::string name, std::string ns, AttncalParams p)
      : name_(std::move(name)), ns_(std::move(ns)), p_(p), softmax_(is_softmax(name_.c_str())) {
    int i = 0;
    for (FieldSpec const& fs : kFields) {
      if (p_.all_rows && !strcmp(fs.name, "pool_last")) continue;
      if (!strcmp(fs.name, "layer")) continue;
      if (fs.is_float) {
        fields_[i++] = PluginField(fs.name, float_slot(p_, fs.name), PluginFieldType::kFLOAT32, 1);
      } else {
        fields_[i++] = PluginField(fs.name, int_slot(p_, fs.name), PluginFieldType::kINT32, 1);
      }
    }
    fc_.nbFields = i;
    fc_.fields = fields_;
  }

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override { return new (std::nothrow) CalibrationPlugin(name_, ns_, p_); }

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override { return name_.c_str(); }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return ns_.c_str(); }

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
  int32_t getNbOutputs() const noexcept override { return 1; }
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
  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
  PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &fc_; }

 private:
  std::string name_, ns_;
  AttncalParams p_;
  bool softmax_;  // Softmax* op: input 0 is the scores
  PluginField fields_[16];
  PluginFieldCollection fc_{};
};

class CalibrationCreator : public IPluginCreatorV3One {
 public:
  CalibrationCreator(char const* op, char const* ns) : op_(op), ns_(ns), all_rows_(is_all_rows(op)) {
    for (FieldSpec const& fs : kFields) {
      if (all_rows_ && !strcmp(fs.name, "pool_last")) continue;
      names_.emplace_back(fs.name, nullptr, fs.is_float ? PluginFieldType::kFLOAT32 : PluginFieldType::kINT32, 1);
    }
    fc_.nbFields = static_cast<int32_t>(names_.size());
    fc_.fields = names_.data();
  }
  IPluginV3* createPlugin(char const* name, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    AttncalParams p;
    if (!parse_fields(fc, all_rows_, &p)) return nullptr;  // missing or invalid attributes
    (void)name;
    return new (std::nothrow) CalibrationPlugin(op_, ns_, p);
  }
  PluginFieldCollection const* getFieldNames() noexcept override { return &fc_; }
  char const* getPluginName() const noexcept override { return op_.c_str(); }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return ns_.c_str(); }

 private:
  std::string op_, ns_;
  bool all_rows_;
  std::vector<PluginField> names_;
  PluginFieldCollection fc_{};
};

}  // namespace

// Entry points for IPluginRegistry::loadLibrary / trtexec --dynamicPlugins.
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder*) {}

extern "C" __attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static CalibrationCreator pooled_default(kOps[0], ""), all_default(kOps[1], "");
  static CalibrationCreator pooled_domain(kOps[0], kDomain), all_domain(kOps[1], kDomain);
  static CalibrationCreator sm_pooled_default(kOps[2], ""), sm_all_default(kOps[3], "");
  static CalibrationCreator sm_pooled_domain(kOps[2], kDomain), sm_all_domain(kOps[3], kDomain);
  static IPluginCreatorInterface* const creators[] = {&pooled_default,    &all_default,    &pooled_domain,
                                                      &all_domain,        &sm_pooled_default, &sm_all_default,
                                                      &sm_pooled_domain,  &sm_all_domain};
  nbCreators = static_cast<int32_t>(sizeof creators / sizeof creators[0]);
  return creators;
}

// Static registration when the library is simply loaded (trtexec --staticPlugins, ctypes.CDLL in polygraphy).
namespace {
struct RegisterOnLoad {
  RegisterOnLoad() {
    int32_t n = 0;
    IPluginCreatorInterface* const* list = getCreators(n);
    IPluginRegistry* registry = getPluginRegistry();
    for (int32_t i = 0; registry != nullptr && i < n; ++i) {
      auto* c = static_cast<CalibrationCreator*>(list[i]);
      registry->registerCreator(*list[i], c->getPluginNamespace());
    }
  }
} g_register_on_load;
}  // namespace
