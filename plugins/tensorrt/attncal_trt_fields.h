// The calibration attributes as TensorRT plugin fields, shared by the calibration plugin
// (attncal_trt_plugin.cpp) and the calibrated-attention plugin (attncal_trt_attention_plugin.cpp)
// so that both read the contract's attributes the same way: whatever numeric width the ONNX
// parser used (int32/int64/float32/float64), every field required except `layer`
// (informational), values checked by attncal_validate_params.
#ifndef ATTNCAL_TRT_FIELDS_H_
#define ATTNCAL_TRT_FIELDS_H_

#include <NvInferRuntime.h>

#include <cstring>

#include "attncal_params.h"

namespace attncal_trt {

constexpr char const* kVersion = "1";
constexpr char const* kDomain = "ai.attncal";

struct FieldSpec {
  char const* name;
  bool is_float;
};
// The calibration op's attributes, in the contract's order (pool_last: pooled ops only).
constexpr FieldSpec kFields[] = {{"pool_last", false},    {"basket_size", false},  {"strength", true},
                                 {"isolate_first", false}, {"isolate_last", false}, {"first_mode", false},
                                 {"last_mode", false},     {"first_weight", true},  {"last_weight", true},
                                 {"skip_short", false},    {"layer", false}};

inline int32_t* int_slot(AttncalParams& p, char const* name) {
  if (!strcmp(name, "pool_last")) return &p.pool_last;
  if (!strcmp(name, "basket_size")) return &p.basket_size;
  if (!strcmp(name, "isolate_first")) return &p.isolate_first;
  if (!strcmp(name, "isolate_last")) return &p.isolate_last;
  if (!strcmp(name, "first_mode")) return &p.first_mode;
  if (!strcmp(name, "last_mode")) return &p.last_mode;
  if (!strcmp(name, "skip_short")) return &p.skip_short;
  return nullptr;
}

inline float* float_slot(AttncalParams& p, char const* name) {
  if (!strcmp(name, "strength")) return &p.strength;
  if (!strcmp(name, "first_weight")) return &p.first_weight;
  if (!strcmp(name, "last_weight")) return &p.last_weight;
  return nullptr;
}

// The numeric value of a one-element field; false for an empty field or a non-numeric type.
inline bool field_number(nvinfer1::PluginField const& f, double* v) {
  if (f.length < 1 || f.data == nullptr) return false;
  switch (f.type) {
    case nvinfer1::PluginFieldType::kINT32: *v = *static_cast<int32_t const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kINT64: *v = static_cast<double>(*static_cast<int64_t const*>(f.data)); return true;
    case nvinfer1::PluginFieldType::kFLOAT32: *v = *static_cast<float const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kFLOAT64: *v = *static_cast<double const*>(f.data); return true;
    default: return false;
  }
}

// Reads the calibration attributes (other fields are ignored); false on a missing or ill-typed
// field or invalid values.
inline bool parse_fields(nvinfer1::PluginFieldCollection const* fc, bool all_rows, AttncalParams* out) {
  AttncalParams p{};
  p.all_rows = all_rows;
  int seen = 0;
  for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
    nvinfer1::PluginField const& f = fc->fields[i];
    double v;
    if (f.name == nullptr || !field_number(f, &v)) continue;
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

}  // namespace attncal_trt

#endif  // ATTNCAL_TRT_FIELDS_H_
