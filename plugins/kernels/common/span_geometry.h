// The geometry of one batch item's calibration: the one definition that the CPU kernels
// (cpu/batch_plan.h, cpu/calibrated_attention.h) and the CUDA kernels (cuda/calibration_kernels.cuh,
// cuda/attention_*.cuh) share, so that every backend selects the same rows and baskets (the spec:
// attncal.calibration.oracle; the contract: attncal/graphs/contract.py).
//
//   Span      the valid keys of the item's mask row: [start, end], and whether masked keys (holes)
//             lie inside it
//   RowPlan   what every calibrated row of the item shares: the content [c0, c0 + C) (the span
//             minus the isolated first/last keys), its n baskets, and t = n + the isolated keys
//   ItemPlan  the span, the row plan and which query rows the op calibrates: [q_lo, q_hi] (with marked_rows,
//             those of them marked in the mask: row_calibrated), and where each row's own key sits (own_key)
//
// The CPU kernels compute a Span on the host (span_of); the CUDA launchers compute it on the device
// into the span workspace (cuda/cuda_common.cuh: span_kernel), one record of kSpanInts ints per
// item, read back with span_at.  Both CUDA launchers (the calibration ops' and the calibrated
// attention ops') use this one layout.
#ifndef ATTNCAL_SPAN_GEOMETRY_H_
#define ATTNCAL_SPAN_GEOMETRY_H_

#include <stddef.h>
#include <stdint.h>

#include "common/attncal_params.h"
#include "common/host_device.h"

namespace attncal {

// Valid span of one mask row: [start, end] (start = end = -1: no valid key), and whether it has
// masked holes.
struct Span {
  int64_t start = -1;
  int64_t end = -1;
  bool holes = false;
};

// The span of mask_row[0, K) (host side).
inline Span span_of(const int64_t* mask_row, int64_t K) {
  Span s;
  int64_t count = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (mask_row[k] != 0) {
      if (s.start < 0) s.start = k;
      s.end = k;
      ++count;
    }
  }
  s.holes = s.start >= 0 && count != s.end - s.start + 1;
  return s;
}

// Row geometry shared by every calibrated row of one batch item.
struct RowPlan {
  int64_t c0 = 0, C = 0, n = 0;
  double t = 1.0;
};

// False when the spec leaves the rows of this item untouched (no valid key, strength 0, no content,
// or an item shorter than one basket with skip_short).
ATTNCAL_HD inline bool plan_rows(const Span& s, const AttncalParams& p, RowPlan* plan) {
  if (s.start < 0 || p.strength == 0.0f) return false;
  const int64_t length = s.end - s.start + 1;
  const int64_t n_iso = p.isolate_first + p.isolate_last;
  plan->c0 = s.start + p.isolate_first;
  plan->C = length - n_iso;
  if (plan->C <= 0 || (p.skip_short && plan->C < p.basket_size)) return false;
  plan->n = (plan->C + p.basket_size - 1) / p.basket_size;
  plan->t = static_cast<double>(plan->n + n_iso);
  return true;
}

// One batch item: its geometry and which query rows are calibrated (inclusive; empty, q_lo > q_hi,
// when the item is not active).
struct ItemPlan {
  Span s;
  RowPlan rp;
  bool active = false;
  int64_t q_lo = 0, q_hi = -1;
};

// The plan of an item with span s in an op with Q query rows: every valid query row of an all-rows
// op (self-attention: query row q is token q), the pooling row of a pooled op; Q == 1 (row
// placement) means the single row is the pooling row itself.
ATTNCAL_HD inline ItemPlan plan_item(const Span& s, const AttncalParams& p, int64_t Q) {
  ItemPlan it;
  it.s = s;
  it.active = plan_rows(it.s, p, &it.rp);
  if (!it.active) return it;
  if (p.all_rows) {
    it.q_lo = it.s.start;
    it.q_hi = it.s.end < Q - 1 ? it.s.end : Q - 1;
  } else {
    it.q_lo = it.q_hi = (Q == 1) ? 0 : (p.pool_last ? it.s.end : it.s.start);
    if (it.q_lo >= Q) it.q_hi = it.q_lo - 1;
  }
  it.active = it.q_lo <= it.q_hi;
  return it;
}

// Whether query row q of item `it` is calibrated: one of the rows plan_item gives and, with marked_rows, marked
// ATTNCAL_ROW_MARK in the item's row of attention_mask (`mask_row`; the contract's "Marked rows").
ATTNCAL_HD inline bool row_calibrated(const ItemPlan& it, const AttncalParams& p, const int64_t* mask_row, int64_t q) {
  return it.active && q >= it.q_lo && q <= it.q_hi && (!p.marked_rows || mask_row[q] == ATTNCAL_ROW_MARK);
}

// Where the own key of calibrated row q (key q: its pooling token) sits, ATTNCAL_OWN_*: NONE without isolate_self;
// FIRST / LAST where it is the isolated first / last key (it takes the self share in that key's place); else
// CONTENT (it leaves its basket, and t counts it as one more isolated key).
ATTNCAL_HD inline int own_key(const Span& s, const AttncalParams& p, int64_t q) {
  if (!p.isolate_self) return ATTNCAL_OWN_NONE;
  if (p.isolate_first && q == s.start) return ATTNCAL_OWN_FIRST;
  if (p.isolate_last && q == s.end) return ATTNCAL_OWN_LAST;
  return ATTNCAL_OWN_CONTENT;
}

// ------------------------------------------------------------------ the CUDA span workspace
// kSpanInts ints per batch item: start, end (-1 both when the item has no valid key), holes (0/1).
constexpr int kSpanInts = 3;

ATTNCAL_HD inline Span span_at(const int* spans, int64_t b) {
  Span s;
  s.start = spans[kSpanInts * b];
  s.end = spans[kSpanInts * b + 1];
  s.holes = spans[kSpanInts * b + 2] != 0;
  return s;
}

// Bytes of the span records of B items (at least one record, so that the size is never 0).
inline size_t span_workspace_bytes(int64_t B) {
  return static_cast<size_t>(B > 0 ? B : 1) * kSpanInts * sizeof(int);
}

}  // namespace attncal

#endif  // ATTNCAL_SPAN_GEOMETRY_H_
