// The ai.attncal attributes as TensorRT plugin fields, shared by the calibration plugin
// (attncal_trt_plugin.cpp) and the calibrated-attention plugin (attncal_trt_attention_plugin.cpp):
// TensorRT's adapter to the shared parser (kernels/common/attncal_attribute_parser.h), which refuses a
// missing, duplicated, ill-typed or foreign field, and the creators' field names and the plugins'
// fields to serialise, both generated from the attribute table (kernels/common/attncal_attributes.def).
//
// Numbers are read in whatever width the ONNX parser used (int8/16/32/64, float32/64), an integer
// field also from an integral float (the parser is lenient, see AttributeParser).  A refusal is
// createPlugin returning null; its reason, naming the fields, goes to TensorRT's logger when the
// library was given one (setLoggerFinder) and is kept for attncal_trt_last_error.
#ifndef ATTNCAL_TRT_FIELDS_H_
#define ATTNCAL_TRT_FIELDS_H_

#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/attncal_attribute_parser.h"
#include "common/attncal_params.h"

namespace attncal_trt {

constexpr char const* kVersion = "1";
constexpr char const* kDomain = "ai.attncal";

// What a field holds, for the parser.
inline attncal::AttrValue field_value(nvinfer1::PluginField const& f) {
  using attncal::AttrValue;
  using T = nvinfer1::PluginFieldType;
  if (f.data == nullptr || f.length < 1) return AttrValue::other("no value");
  if (f.length != 1) return AttrValue::other("a list");
  switch (f.type) {
    case T::kINT8: return AttrValue::integer(*static_cast<int8_t const*>(f.data));
    case T::kINT16: return AttrValue::integer(*static_cast<int16_t const*>(f.data));
    case T::kINT32: return AttrValue::integer(*static_cast<int32_t const*>(f.data));
    case T::kINT64: return AttrValue::integer(*static_cast<int64_t const*>(f.data));
    case T::kFLOAT32: return AttrValue::real(*static_cast<float const*>(f.data));
    case T::kFLOAT64: return AttrValue::real(*static_cast<double const*>(f.data));
    case T::kCHAR: return AttrValue::other("a string");
    default: return AttrValue::other("a field of a non-numeric type");
  }
}

// The two node attributes by which ONNX-TensorRT routes a node to a creator (not the op's own):
// passed over, never refused as foreign.
inline bool is_routing_field(char const* name) {
  return name != nullptr && (!strcmp(name, "plugin_namespace") || !strcmp(name, "plugin_version"));
}

// The reason this thread's last refused createPlugin gave (see attncal_trt_last_error).
inline std::string& last_error() {
  thread_local std::string e;
  return e;
}

// The logger finder TensorRT gave the library (setLoggerFinder), or null.
inline nvinfer1::ILoggerFinder*& logger_finder() {
  static nvinfer1::ILoggerFinder* finder = nullptr;
  return finder;
}

// Records why `op`'s fields were refused and tells TensorRT's logger, if there is one.
inline void report_refusal(char const* op, std::string const& why) {
  last_error() = std::string("attncal ") + op + ": " + why;
  if (nvinfer1::ILoggerFinder* f = logger_finder()) {
    if (nvinfer1::ILogger* logger = f->findLogger()) logger->log(nvinfer1::ILogger::Severity::kERROR, last_error().c_str());
  }
}

// Reads op's attributes (attention: a calibrated attention op) from fc; false, with *error naming the
// fields at fault, on a missing, duplicated, ill-typed or foreign field or an invalid value.
inline bool parse_fields(nvinfer1::PluginFieldCollection const* fc, bool all_rows, bool attention, AttncalParams* out,
                         std::string* error) {
  attncal::AttributeParser parser(all_rows, attention, /*lenient_numbers=*/true);
  for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
    nvinfer1::PluginField const& f = fc->fields[i];
    if (is_routing_field(f.name)) continue;
    parser.offer(f.name, field_value(f));
  }
  if (parser.finish(out)) return true;
  *error = parser.error();
  return false;
}

// The field names a creator lists: every attribute op takes, in the table's order, int32 or float32.
inline std::vector<nvinfer1::PluginField> field_names(bool all_rows, bool attention) {
  std::vector<nvinfer1::PluginField> v;
  const unsigned family = attncal::op_family(all_rows, attention);
  for (int id = 0; id < ATTNCAL_ATTR_COUNT; ++id) {
    if (!attncal::takes(id, family)) continue;
    const bool is_float = attncal::kAttributes[id].type == attncal::AttrType::kFLOAT;
    v.emplace_back(attncal::attr_name(id), nullptr,
                   is_float ? nvinfer1::PluginFieldType::kFLOAT32 : nvinfer1::PluginFieldType::kINT32, 1);
  }
  return v;
}

// The fields a plugin serialises, pointing into p (a member of the plugin): every REQUIRED attribute
// op takes, and every OPTIONAL one whose value is not its default, in the table's order, so that a
// runtime plugin re-created from these fields computes what the built one did (the attention ops'
// geometry: num_kv_heads, window_left, window_right, relative_max_distance).  layer is never kept: it is
// informational, and a runtime plugin gets its default.
inline std::vector<nvinfer1::PluginField> fields_of(AttncalParams& p, bool attention) {
  std::vector<nvinfer1::PluginField> v;
  const unsigned family = attncal::op_family(p.all_rows != 0, attention);
  for (int id = 0; id < ATTNCAL_ATTR_COUNT; ++id) {
    const attncal::AttrSpec& a = attncal::kAttributes[id];
    if (!attncal::takes(id, family) || id == ATTNCAL_ATTR_ID_layer) continue;
    float* s = attncal::float_member(p, id);
    if (!a.required && (s != nullptr ? *s : static_cast<double>(*attncal::int_member(p, id))) == a.dflt) continue;
    if (s != nullptr) {
      v.emplace_back(attncal::attr_name(id), s, nvinfer1::PluginFieldType::kFLOAT32, 1);
    } else {
      v.emplace_back(attncal::attr_name(id), attncal::int_member(p, id), nvinfer1::PluginFieldType::kINT32, 1);
    }
  }
  return v;
}

}  // namespace attncal_trt

#endif  // ATTNCAL_TRT_FIELDS_H_
