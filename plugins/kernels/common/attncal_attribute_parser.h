// The one reader of an ai.attncal node's attributes, shared by the ONNX Runtime custom ops
// (ort/ort_attributes.cc) and the TensorRT plugins (tensorrt/attncal_trt_fields.h).  Each of those
// adapts its API's attribute access to it: an adapter offers every attribute it finds (offer),
// then asks for the result (finish).  The table it checks against is common/attncal_attributes.def.
//
// Why one parser: the rules are written once, so no backend can accept a node another refuses.
// It keeps a bitmask of the attributes seen, so a node is judged by which names it carries, not by
// how many (a count lets a stray or duplicated field stand in for a missing one, and the op would
// then run with that attribute at zero: with strength 0, calibration silently off).  Refused,
// with a message naming each field at fault, missing ones first:
//   missing     a REQUIRED attribute of the op is absent;
//   duplicated  an attribute is offered twice;
//   foreign     a name that is not an attribute of this op (another op's, or none of the table's);
//   ill-typed   a value of the wrong kind (an adapter reports what it found: an integer, a float, or
//               something else, e.g. a string or a list), or an integer outside int32;
//   invalid     values outside the contract (attncal_validate_params; the attention ops' num_heads, scale,
//               num_kv_heads and windows here).
// An OPTIONAL attribute the node lacks takes its default.
#ifndef ATTNCAL_ATTRIBUTE_PARSER_H_
#define ATTNCAL_ATTRIBUTE_PARSER_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/attncal_params.h"

namespace attncal {

enum class AttrType { kINT, kFLOAT };

// Op families, as bits: which ops an attribute belongs to (the table's `ops` column) and which op a
// parser reads for.
enum : unsigned {
  kOpPooled = 1u,             // PooledRowCalibration, SoftmaxPooledRowCalibration
  kOpAllRows = 2u,            // AllRowsCalibration, SoftmaxAllRowsCalibration
  kOpPooledAttention = 4u,    // PooledRowCalibratedAttention, PooledRowCalibratedProjectedAttention
  kOpAllRowsAttention = 8u,   // AllRowsCalibratedAttention, AllRowsCalibratedProjectedAttention
};
constexpr unsigned kOpsALL = kOpPooled | kOpAllRows | kOpPooledAttention | kOpAllRowsAttention;
constexpr unsigned kOpsPOOLED = kOpPooled | kOpPooledAttention;
constexpr unsigned kOpsATTENTION = kOpPooledAttention | kOpAllRowsAttention;

constexpr unsigned op_family(bool all_rows, bool attention) {
  return attention ? (all_rows ? kOpAllRowsAttention : kOpPooledAttention) : (all_rows ? kOpAllRows : kOpPooled);
}

struct AttrSpec {
  const char* name;
  AttrType type;
  unsigned ops;   // kOp* bits of the ops that take it
  bool required;  // false: OPTIONAL, a node may lack it
  double dflt;    // the value of an OPTIONAL attribute a node lacks
};

constexpr bool kAttrREQUIRED = true, kAttrOPTIONAL = false;

// The table, indexed by ATTNCAL_ATTR_ID_<name>.
constexpr AttrSpec kAttributes[ATTNCAL_ATTR_COUNT] = {
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) {#name, AttrType::k##type, kOps##ops, kAttr##presence, dflt},
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
};
static_assert(ATTNCAL_ATTR_COUNT <= 32, "the seen-set is a 32-bit mask");

constexpr const char* attr_name(int id) { return kAttributes[id].name; }

inline bool takes(int id, unsigned family) { return (kAttributes[id].ops & family) != 0; }

// The id of attribute `name`, or -1 for a name the table does not hold.
inline int find_attribute(const char* name) {
  for (int i = 0; name != nullptr && i < ATTNCAL_ATTR_COUNT; ++i)
    if (!std::strcmp(kAttributes[i].name, name)) return i;
  return -1;
}

// The address of attribute `id`'s member in p (typed by the table); null for the other type.
inline int32_t* int_member(AttncalParams& p, int id) {
  switch (id) {
#define ATTNCAL_INT_CASE_INT(name) \
  case ATTNCAL_ATTR_ID_##name:     \
    return &p.name;
#define ATTNCAL_INT_CASE_FLOAT(name)
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) ATTNCAL_INT_CASE_##type(name)
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
#undef ATTNCAL_INT_CASE_INT
#undef ATTNCAL_INT_CASE_FLOAT
    default: return nullptr;
  }
}
inline float* float_member(AttncalParams& p, int id) {
  switch (id) {
#define ATTNCAL_FLOAT_CASE_FLOAT(name) \
  case ATTNCAL_ATTR_ID_##name:         \
    return &p.name;
#define ATTNCAL_FLOAT_CASE_INT(name)
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) ATTNCAL_FLOAT_CASE_##type(name)
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
#undef ATTNCAL_FLOAT_CASE_INT
#undef ATTNCAL_FLOAT_CASE_FLOAT
    default: return nullptr;
  }
}

// What an adapter found under a name.
struct AttrValue {
  enum Kind { kInteger, kFloat, kOther } kind;
  int64_t i;   // kInteger
  double f;    // kFloat
  const char* what;  // kOther: what it was, for the message ("a string", "2 values", ...)
  static AttrValue integer(int64_t v) { return {kInteger, v, 0.0, nullptr}; }
  static AttrValue real(double v) { return {kFloat, 0, v, nullptr}; }
  static AttrValue other(const char* what) { return {kOther, 0, 0.0, what}; }
};

class AttributeParser {
 public:
  // all_rows, attention: which op the node is (op_family).  lenient_numbers: accept a number of the other kind where its value
  // is exact (an integral float for an INT attribute, an integer for a FLOAT one).  TensorRT's fields
  // come in whatever numeric width the ONNX parser chose, so its adapter is lenient; ONNX attributes
  // have exact types, so ONNX Runtime's is not.
  AttributeParser(bool all_rows, bool attention, bool lenient_numbers)
      : family_(op_family(all_rows, attention)), lenient_(lenient_numbers) {
    params_ = AttncalParams{};
    params_.all_rows = all_rows ? 1 : 0;
  }

  // One attribute of the node.  Problems are collected, not fatal: finish() reports them all.
  void offer(const char* name, const AttrValue& v) {
    const int id = find_attribute(name);
    if (id < 0 || !takes(id, family_)) {
      add(foreign_, std::string("'") + (name ? name : "(null)") + "'");
      return;
    }
    const uint32_t bit = 1u << id;
    if (seen_ & bit) {
      add(duplicated_, std::string("'") + name + "'");
      return;
    }
    seen_ |= bit;
    std::string why;
    if (!store(id, v, &why)) add(ill_typed_, std::string("'") + name + "' " + why);
  }

  // Whether the node carries attribute `id` (offered, well-typed or not).
  bool seen(int id) const { return (seen_ >> id) & 1u; }

  // The attributes, or false with error() set.
  bool finish(AttncalParams* out) {
    std::string missing;
    for (int id = 0; id < ATTNCAL_ATTR_COUNT; ++id) {
      if (!takes(id, family_) || seen(id)) continue;
      if (kAttributes[id].required) {
        add(missing, std::string("'") + kAttributes[id].name + "'");
      } else if (int32_t* s = int_member(params_, id)) {
        *s = static_cast<int32_t>(kAttributes[id].dflt);
      } else if (float* s = float_member(params_, id)) {
        *s = static_cast<float>(kAttributes[id].dflt);
      }
    }
    error_.clear();
    append("missing attribute", missing);
    append("duplicated attribute", duplicated_);
    append("attribute this op does not take:", foreign_);
    append("ill-typed attribute", ill_typed_);
    if (!error_.empty()) return false;
    char msg[200];
    if (attncal_validate_params(&params_, msg, sizeof msg) != ATTNCAL_OK) {
      error_ = msg;
      return false;
    }
    if (family_ & kOpsATTENTION) {
      if (params_.num_heads < 1) {
        error_ = std::string(attr_name(ATTNCAL_ATTR_ID_num_heads)) + " must be >= 1, got " +
                 std::to_string(params_.num_heads);
        return false;
      }
      if (!std::isfinite(params_.scale) || params_.scale < 0.f) {
        error_ = std::string(attr_name(ATTNCAL_ATTR_ID_scale)) +
                 " must be finite and >= 0 (0 = 1/sqrt(head_size)), got " + std::to_string(params_.scale);
        return false;
      }
      const int32_t kv = params_.num_kv_heads;
      if (kv < 0 || (kv > 0 && params_.num_heads % kv != 0)) {
        error_ = std::string(attr_name(ATTNCAL_ATTR_ID_num_kv_heads)) + " must divide " +
                 attr_name(ATTNCAL_ATTR_ID_num_heads) + "=" + std::to_string(params_.num_heads) +
                 " (0 = num_heads), got " + std::to_string(kv);
        return false;
      }
      if (params_.window_left < -1 || params_.window_right < -1) {
        error_ = std::string(attr_name(ATTNCAL_ATTR_ID_window_left)) + " and " +
                 attr_name(ATTNCAL_ATTR_ID_window_right) + " must be >= 0, or -1 for no limit; got " +
                 std::to_string(params_.window_left) + " and " + std::to_string(params_.window_right);
        return false;
      }
      if (params_.relative_max_distance < 0) {
        error_ = std::string(attr_name(ATTNCAL_ATTR_ID_relative_max_distance)) +
                 " must be >= 1, or 0 for no relative position bias; got " +
                 std::to_string(params_.relative_max_distance);
        return false;
      }
    }
    *out = params_;
    return true;
  }

  const std::string& error() const { return error_; }

 private:
  static void add(std::string& list, const std::string& item) { list += (list.empty() ? "" : ", ") + item; }
  void append(const std::string& what, const std::string& list) {
    if (list.empty()) return;
    error_ += (error_.empty() ? "" : "; ") + what + " " + list;
  }

  bool store(int id, const AttrValue& v, std::string* why) {
    if (v.kind == AttrValue::kOther) {
      *why = std::string("must be ") + (kAttributes[id].type == AttrType::kINT ? "an integer" : "a float") +
             ", got " + (v.what ? v.what : "another type");
      return false;
    }
    if (int32_t* s = int_member(params_, id)) {
      int64_t x = v.i;
      if (v.kind == AttrValue::kFloat) {
        if (!lenient_) return (*why = "must be an integer, got a float"), false;
        if (!(v.f == std::floor(v.f)) || !(std::fabs(v.f) < 9.2e18))
          return (*why = "must be an integer, got " + std::to_string(v.f)), false;
        x = static_cast<int64_t>(v.f);
      }
      if (x < INT32_MIN || x > INT32_MAX) return (*why = "is out of the int32 range: " + std::to_string(x)), false;
      *s = static_cast<int32_t>(x);
      return true;
    }
    float* s = float_member(params_, id);
    if (v.kind == AttrValue::kInteger) {
      if (!lenient_) return (*why = "must be a float, got an integer"), false;
      *s = static_cast<float>(v.i);
      return true;
    }
    *s = static_cast<float>(v.f);
    return true;
  }

  unsigned family_;
  bool lenient_;
  AttncalParams params_;
  uint32_t seen_ = 0;
  std::string duplicated_, foreign_, ill_typed_, error_;
};

}  // namespace attncal

#endif  // ATTNCAL_ATTRIBUTE_PARSER_H_
