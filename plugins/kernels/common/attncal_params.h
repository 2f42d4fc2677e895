/* The ai.attncal ops' attributes as one plain C struct, shared by the CPU
 * implementation, the CUDA launchers, the ORT custom ops and the TensorRT
 * plugin, so that every backend validates and reads them the same way.
 *
 * The members are generated from attncal_attributes.def (the one definition of
 * the attributes): all_rows (which calibration the op applies; not an attribute,
 * the op type says it), then every INT attribute, then every FLOAT attribute, each
 * in the table's order.  The layout is a C ABI: Python's ctypes mirror
 * (attncal/runtime/attributes_def.py) is built from the same table, so the two
 * cannot drift apart.  Attributes an op does not take stay at their zero value
 * (pool_last on the all-rows ops; num_heads and scale on the calibration ops).
 *
 * Contract: attncal/graphs/contract.py.  Reading a node's attributes into this
 * struct, with its refusals: common/attncal_attribute_parser.h. */
#ifndef ATTNCAL_PARAMS_H_
#define ATTNCAL_PARAMS_H_

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { ATTNCAL_MODE_EQUAL = 0, ATTNCAL_MODE_ORIGINAL = 1, ATTNCAL_MODE_FIXED = 2 };
/* The attention_mask value of a valid token whose query row is calibrated, read with marked_rows = 1 (landmark,
 * multi-CLS and Mean@k pooling; attncal.calibration.config.ROW_MARK). */
enum { ATTNCAL_ROW_MARK = 2 };
/* Where a calibrated row's own key sits (isolate_self; common/span_geometry.h: own_key): not isolated, the
 * isolated first key, the isolated last key, or a content key taken out of its basket. */
enum { ATTNCAL_OWN_NONE = 0, ATTNCAL_OWN_FIRST = 1, ATTNCAL_OWN_LAST = 2, ATTNCAL_OWN_CONTENT = 3 };
enum { ATTNCAL_DTYPE_FLOAT32 = 0, ATTNCAL_DTYPE_FLOAT16 = 1, ATTNCAL_DTYPE_BFLOAT16 = 2 };

/* Status codes of the C ABI (0 = success). */
enum {
  ATTNCAL_OK = 0,
  ATTNCAL_ERR_INVALID_ARGUMENT = 1,
  ATTNCAL_ERR_UNSUPPORTED = 2,
  ATTNCAL_ERR_CUDA = 3
};

/* One id per attribute, in the table's order: ATTNCAL_ATTR_ID_<name>, then ATTNCAL_ATTR_COUNT. */
enum {
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) ATTNCAL_ATTR_ID_##name,
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
  ATTNCAL_ATTR_COUNT
};

/* The attribute names, indexed by id. */
static const char* const attncal_attr_names[ATTNCAL_ATTR_COUNT] = {
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) #name,
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
};

/* The member of one attribute of type `type` (INT or FLOAT), or nothing for the other type. */
#define ATTNCAL_MEMBER_INT_INT(name) int32_t name;
#define ATTNCAL_MEMBER_INT_FLOAT(name)
#define ATTNCAL_MEMBER_FLOAT_INT(name)
#define ATTNCAL_MEMBER_FLOAT_FLOAT(name) float name;

typedef struct AttncalParams {
  int32_t all_rows; /* 1 = an all-rows op, 0 = a pooled-row op: from the op type */
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) ATTNCAL_MEMBER_INT_##type(name)
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) ATTNCAL_MEMBER_FLOAT_##type(name)
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
} AttncalParams;

#undef ATTNCAL_MEMBER_INT_INT
#undef ATTNCAL_MEMBER_INT_FLOAT
#undef ATTNCAL_MEMBER_FLOAT_INT
#undef ATTNCAL_MEMBER_FLOAT_FLOAT

/* Checks the calibration values (what every op takes; num_heads and scale are the attention ops'
 * and checked where those are read, attncal_attribute_parser.h); on failure writes a one-line
 * reason, naming the attribute, into msg. */
static inline int attncal_validate_params(const AttncalParams* p, char* msg, size_t msg_len) {
  const char* const* n = attncal_attr_names;
  char buf[200];
  buf[0] = '\0';
  if (p->basket_size < 1) {
    snprintf(buf, sizeof buf, "%s must be >= 1, got %d", n[ATTNCAL_ATTR_ID_basket_size], (int)p->basket_size);
  } else if (p->first_mode < 0 || p->first_mode > 2) {
    snprintf(buf, sizeof buf, "%s must be 0 (equal), 1 (original) or 2 (fixed), got %d", n[ATTNCAL_ATTR_ID_first_mode],
             (int)p->first_mode);
  } else if (p->last_mode < 0 || p->last_mode > 2) {
    snprintf(buf, sizeof buf, "%s must be 0 (equal), 1 (original) or 2 (fixed), got %d", n[ATTNCAL_ATTR_ID_last_mode],
             (int)p->last_mode);
  } else if (!(p->strength >= 0.0f && p->strength <= 1.0f)) {
    snprintf(buf, sizeof buf, "%s must be in [0, 1], got %g", n[ATTNCAL_ATTR_ID_strength], (double)p->strength);
  } else if ((p->pool_last | p->isolate_first | p->isolate_last | p->skip_short | p->all_rows) & ~1) {
    snprintf(buf, sizeof buf, "%s, %s, %s and %s must be 0 or 1", n[ATTNCAL_ATTR_ID_pool_last],
             n[ATTNCAL_ATTR_ID_isolate_first], n[ATTNCAL_ATTR_ID_isolate_last], n[ATTNCAL_ATTR_ID_skip_short]);
  } else if ((p->marked_rows | p->isolate_self) & ~1) {
    snprintf(buf, sizeof buf, "%s and %s must be 0 or 1", n[ATTNCAL_ATTR_ID_marked_rows],
             n[ATTNCAL_ATTR_ID_isolate_self]);
  } else if (p->self_mode < 0 || p->self_mode > 2) {
    snprintf(buf, sizeof buf, "%s must be 0 (equal), 1 (original) or 2 (fixed), got %d", n[ATTNCAL_ATTR_ID_self_mode],
             (int)p->self_mode);
  } else if (!p->all_rows && (p->marked_rows | p->isolate_self)) {
    snprintf(buf, sizeof buf, "%s and %s are the all-rows ops' (a pooled-row op calibrates its one row)",
             n[ATTNCAL_ATTR_ID_marked_rows], n[ATTNCAL_ATTR_ID_isolate_self]);
  } else if (p->isolate_self && !p->marked_rows) {
    snprintf(buf, sizeof buf, "%s needs %s = 1 (the own key of a marked row)", n[ATTNCAL_ATTR_ID_isolate_self],
             n[ATTNCAL_ATTR_ID_marked_rows]);
  }
  if (buf[0] == '\0') return ATTNCAL_OK;
  if (msg != NULL && msg_len > 0) snprintf(msg, msg_len, "%s", buf);
  return ATTNCAL_ERR_INVALID_ARGUMENT;
}

#ifdef __cplusplus
}
#endif
#endif /* ATTNCAL_PARAMS_H_ */
