// The relative position bias of the calibrated attention ops (T5's encoder, MPNet): the bucket of a
// key-minus-query offset, and the bias a head adds at each offset.  The contract and the Python twin
// (used by the oracle and the export's check of a graph's bias): attncal/graphs/contract.py,
// attncal/calibration/relative_position.py.
//
// The bucket is T5's bidirectional function, in the float32 steps torch takes (the argument of the
// logarithm and the product in float32, log(max_distance / exact) in double rounded to float), so that
// a kernel's buckets are the model's: truncating a float to an integer makes every rounding step count.
#ifndef ATTNCAL_RELATIVE_POSITION_H_
#define ATTNCAL_RELATIVE_POSITION_H_

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "common/attncal_params.h"
#include "common/host_device.h"

namespace attncal {

// The bias table of one op call: table[bucket * heads + h] (float; the ORT op widens float16), or none.
struct RelativeBias {
  const float* table = nullptr;
  int64_t buckets = 0, heads = 0, max_distance = 0;

  bool enabled() const { return table != nullptr; }
};

// Whether `buckets` and `max_distance` give the function a value at every offset: at least 4 buckets,
// and a max distance past the exact buckets (else a log of 0, or a division by log(1)).
ATTNCAL_HD inline bool relative_buckets_valid(int64_t buckets, int64_t max_distance) {
  return buckets >= 4 && max_distance > buckets / 4;
}

// A call's relative position bias against the contract, in the order every backend checks it: the attribute
// not negative, the table given exactly when the attribute is set, a bucket function with a value at every
// offset, self-attention.  `table`: whether the call has one, of `buckets` rows.  On failure writes the one-line
// reason into msg and returns false (the ORT ops and the CUDA launcher report the same messages).
inline bool relative_bias_ok(bool table, int64_t buckets, int64_t max_distance, int64_t S_q, int64_t S_k, char* msg,
                             size_t len) {
  const char* attr = attncal_attr_names[ATTNCAL_ATTR_ID_relative_max_distance];
  const long long md = max_distance;
  if (md < 0) {
    snprintf(msg, len, "%s must be >= 1, or 0 for no relative position bias; got %lld", attr, md);
  } else if (!table && md > 0) {
    snprintf(msg, len, "%s=%lld needs the relative_bias input (the bias table)", attr, md);
  } else if (table && md == 0) {
    snprintf(msg, len, "the relative_bias input needs %s > 0", attr);
  } else if (table && !relative_buckets_valid(buckets, max_distance)) {
    snprintf(msg, len, "a relative position bias needs at least 4 buckets and %s above num_buckets / 4; got %lld "
             "buckets and %lld", attr, static_cast<long long>(buckets), md);
  } else if (table && S_q != S_k) {
    snprintf(msg, len, "a relative position bias needs S_q == S_k (self-attention); got S_q=%lld, S_k=%lld",
             static_cast<long long>(S_q), static_cast<long long>(S_k));
  } else {
    return true;
  }
  return false;
}

// log(max_distance / exact) as the model's code computes it: in double, then rounded to float.
ATTNCAL_HD inline float relative_log_span(int64_t buckets, int64_t max_distance) {
  const int64_t exact = buckets / 2 / 2;
  return static_cast<float>(log(static_cast<double>(max_distance) / static_cast<double>(exact)));
}

// The bucket of key-minus-query offset `offset` (relative_buckets_valid must hold; `log_span` from
// relative_log_span).
ATTNCAL_HD inline int64_t relative_bucket(int64_t offset, int64_t buckets, float log_span) {
  const int64_t half = buckets / 2, exact = half / 2;
  const int64_t n = offset < 0 ? -offset : offset;
  const int64_t side = offset > 0 ? half : 0;
  if (n < exact) return side + n;
  // The float32 logarithm correctly rounded (through double), so that host and device agree: a device logf
  // one unit off at n = 2 * exact, where the product is exactly an integer, would truncate to the bucket below.
  const float ratio = static_cast<float>(n) / static_cast<float>(exact);
  const float steps = static_cast<float>(log(static_cast<double>(ratio))) / log_span * static_cast<float>(half - exact);
  const int64_t large = exact + static_cast<int64_t>(steps);
  return side + (large < half - 1 ? large : half - 1);
}

}  // namespace attncal

#endif  // ATTNCAL_RELATIVE_POSITION_H_
