// Reading an ai.attncal node's attributes in ONNX Runtime: the kernel-info API adapted to the one
// parser every runtime shares (common/attncal_attribute_parser.h), which refuses a missing,
// ill-typed or foreign attribute with a message naming it; the kernels report that message as
// their error status when they run.
#include <cstdint>
#include <string>

#include "common/attncal_attribute_parser.h"
#include "ort_common.h"

namespace attncal_ort {

namespace {

// What ONNX Runtime holds under `name` for this node: false when nothing.  The kernel-info API reads
// an attribute by name and type and cannot list a node's attributes, so the adapter asks for every
// name of the table (common/attncal_attributes.def): an attribute of the table that this op does not take
// (pool_last on an all-rows op, num_heads on a calibration op) is seen and refused as foreign; a name
// outside the table cannot be seen here.  A duplicated attribute never reaches a kernel: ONNX
// Runtime refuses the model when it loads it ("appeared multiple times").
bool Probe(const OrtApi* api, const OrtKernelInfo* info, const char* name, attncal::AttrValue* v) {
  auto ok = [api](OrtStatus* st) {
    if (st == nullptr) return true;
    api->ReleaseStatus(st);
    return false;
  };
  int64_t i = 0;
  float f = 0.f;
  size_t n = 0;
  if (ok(api->KernelInfoGetAttribute_int64(info, name, &i))) {
    *v = attncal::AttrValue::integer(i);
  } else if (ok(api->KernelInfoGetAttribute_float(info, name, &f))) {
    *v = attncal::AttrValue::real(f);
  } else if (ok(api->KernelInfoGetAttribute_string(info, name, nullptr, &n))) {
    *v = attncal::AttrValue::other("a string");
  } else if (ok(api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &n)) ||
             ok(api->KernelInfoGetAttributeArray_float(info, name, nullptr, &n))) {
    *v = attncal::AttrValue::other("a list");
  } else {
    return false;
  }
  return true;
}

// The node's attributes through the shared parser (common/attncal_attribute_parser.h); ONNX attribute
// types are exact, so no numeric leniency.
AttncalParams ReadNode(const OrtApi* api, const OrtKernelInfo* info, bool all_rows, bool attention,
                       std::string* error) {
  attncal::AttributeParser parser(all_rows, attention, /*lenient_numbers=*/false);
  for (int id = 0; id < ATTNCAL_ATTR_COUNT; ++id) {
    attncal::AttrValue v{};
    if (Probe(api, info, attncal::attr_name(id), &v)) parser.offer(attncal::attr_name(id), v);
  }
  AttncalParams p{};
  p.all_rows = all_rows ? 1 : 0;
  if (!parser.finish(&p)) *error = parser.error();
  return p;
}

}  // namespace

Attributes ReadAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows) {
  Attributes a;
  a.params = ReadNode(api, info, all_rows, /*attention=*/false, &a.error);
  return a;
}

AttentionAttributes ReadAttentionAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows) {
  AttentionAttributes a;
  a.calibration.params = ReadNode(api, info, all_rows, /*attention=*/true, &a.calibration.error);
  a.num_heads = a.calibration.params.num_heads;
  a.scale = a.calibration.params.scale;
  return a;
}

Ort::Status AttributeError(const Attributes& a, const char* op) {
  return Ort::Status((std::string("attncal ") + op + ": " + a.error).c_str(), ORT_INVALID_ARGUMENT);
}

}  // namespace attncal_ort
