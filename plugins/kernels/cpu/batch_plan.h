// The batch driver of the host calibration ops: which rows of a call are calibrated (plan_items,
// through common/span_geometry.h's plan_item, the rule every backend shares), and the split of the
// call into work units that ONNX Runtime's intra-op pool runs in any order (ort/cpu/cpu_ops.cc); the
// row math is cpu/row_calibration.h.
//
// Why it is shaped like this:
// * The work is split into units of whole rows whose size depends only on the shapes; a row is always
//   computed the same way by one thread, so results do not depend on the thread count.
// * In place (out == probs), only calibrated rows are read and written; out of place, untouched rows
//   are copied in the same pass, row range by row range, never as a separate copy of the whole tensor.
#ifndef ATTNCAL_CPU_BATCH_PLAN_H_
#define ATTNCAL_CPU_BATCH_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/attncal_params.h"
#include "common/span_geometry.h"
#include "cpu/row_calibration.h"

namespace attncal {

// Per-item geometry of a call: the items' plans (which items are calibrated, which query rows), and,
// only for a calibrated item whose mask has holes inside its valid span, a 0/1 float mask of its keys
// (in keep, pointed to by keep_of[b]; null for every other item): the host's form of the holes, which
// the row routines multiply by.  Shared by the calibration ops (Plan) and the calibrated attention op
// (AttentionPlan).
inline void plan_items(const int64_t* mask, int64_t B, int64_t Q, int64_t K, const AttncalParams& p,
                       std::vector<ItemPlan>* items, std::vector<float>* keep, std::vector<const float*>* keep_of) {
  items->assign(static_cast<size_t>(B), ItemPlan{});
  keep_of->assign(static_cast<size_t>(B), nullptr);
  keep->clear();
  bool any_holes = false;
  for (int64_t b = 0; b < B; ++b) {
    ItemPlan& it = (*items)[b];
    it = plan_item(span_of(mask + b * K, K), p, Q);
    any_holes = any_holes || (it.active && it.s.holes);
  }
  if (!any_holes) return;
  keep->assign(static_cast<size_t>(B * K), 0.f);  // never resized again: the pointers below stay valid
  for (int64_t b = 0; b < B; ++b) {
    const ItemPlan& it = (*items)[b];
    if (!it.active || !it.s.holes) continue;
    for (int64_t k = 0; k < K; ++k) (*keep)[b * K + k] = mask[b * K + k] != 0 ? 1.f : 0.f;
    (*keep_of)[b] = keep->data() + b * K;
  }
}

// A unit of work: query rows [q0, q1) of heads [h0, h1) of batch item b.
struct Unit {
  int64_t b, h0, h1, q0, q1;
};

// Whole-call plan: per-item geometry and the work units.  Built once per
// call by the calling thread; the units then run in any order on any thread.
class Plan {
 public:
  static constexpr int64_t kUnitElems = 32768;  // ~128 KiB of float32 per unit

  // every_row: units cover every row (out of place: untouched rows are copied; fused with the
  // softmax: every row gets its softmax); otherwise only the calibrated rows.
  Plan(const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K, const AttncalParams& p, bool every_row)
      : B_(B), H_(H), Q_(Q), K_(K), mask_(mask), items_(static_cast<size_t>(B)) {
    if (B * H * Q * K == 0) return;
    plan_items(mask, B, Q, K, p, &items_, &keep_, &keep_of_);
    for (int64_t b = 0; b < B; ++b) {
      const ItemPlan& it = items_[b];
      int64_t r0 = 0, r1 = Q;
      if (!every_row) {
        if (!it.active) continue;
        r0 = it.q_lo;
        r1 = it.q_hi + 1;
      }
      const int64_t per_head = (r1 - r0) * K;
      if (per_head >= kUnitElems) {
        const int64_t rows = std::max<int64_t>(1, kUnitElems / K);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t q = r0; q < r1; q += rows) units_.push_back({b, h, h + 1, q, std::min(q + rows, r1)});
      } else {
        const int64_t heads = std::max<int64_t>(1, kUnitElems / std::max<int64_t>(1, per_head));
        for (int64_t h = 0; h < H; h += heads) units_.push_back({b, h, std::min(h + heads, H), r0, r1});
      }
    }
  }

  size_t size() const { return units_.size(); }

  // Runs unit i: calibrates its calibrated rows, copies the others when out != in.  With
  // Softmax, `in` holds scores: every row of the unit gets its softmax, calibrated rows as well.
  // With marked_rows, the rows of [c0, c1) that the mask does not mark are left alone (copied out of place).
  template <bool Softmax, typename T>
  void run(size_t i, const T* in, T* out, const AttncalParams& p) const {
    const Unit& u = units_[i];
    const ItemPlan& it = items_[u.b];
    const float* keep = keep_of_[u.b];
    const int64_t* mask_row = mask_ + u.b * K_;
    const int64_t c0 = it.active ? std::max(u.q0, it.q_lo) : u.q1;
    const int64_t c1 = it.active ? std::min(u.q1, it.q_hi + 1) : u.q1;
    const size_t row_bytes = sizeof(T) * static_cast<size_t>(K_);
    Scratch& sc = thread_scratch();
    for (int64_t h = u.h0; h < u.h1; ++h) {
      const int64_t base = (u.b * H_ + h) * Q_;
      if (Softmax) {
        for (int64_t q = u.q0; q < u.q1; ++q) {
          const int64_t off = (base + q) * K_;
          if (q >= c0 && q < c1 && row_calibrated(it, p, mask_row, q)) {
            softmax_calibrate_row(in + off, out + off, K_, q, it, keep, p, sc);
          } else {
            softmax_row(in + off, out + off, K_, sc);
          }
        }
        continue;
      }
      if (out != in) {  // untouched row ranges before and after the calibrated ones
        const int64_t pre_end = std::min(u.q1, std::max(u.q0, c0));
        if (pre_end > u.q0)
          std::memcpy(out + (base + u.q0) * K_, in + (base + u.q0) * K_, row_bytes * (pre_end - u.q0));
        const int64_t post_begin = std::max(u.q0, std::max(c0, c1));
        if (u.q1 > post_begin)
          std::memcpy(out + (base + post_begin) * K_, in + (base + post_begin) * K_, row_bytes * (u.q1 - post_begin));
      }
      for (int64_t q = c0; q < c1; ++q) {
        const int64_t off = (base + q) * K_;
        if (row_calibrated(it, p, mask_row, q)) {
          calibrate_row(in + off, out + off, K_, q, it, keep, p, sc);
        } else if (out != in) {
          std::memcpy(out + off, in + off, row_bytes);
        }
      }
    }
  }

 private:
  int64_t B_, H_, Q_, K_;
  const int64_t* mask_;  // the call's attention_mask [B,K]: the marked rows (row_calibrated)
  std::vector<ItemPlan> items_;
  std::vector<float> keep_;
  std::vector<const float*> keep_of_;
  std::vector<Unit> units_;
};

// Calibrates probs[B,H,Q,K] into out (which may alias probs), serially.  T is
// float or uint16_t (float16 bits).  The ORT kernel runs the same Plan units
// on the intra-op thread pool.
template <typename T>
void calibrate(const T* probs, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
               const AttncalParams& p) {
  const Plan plan(mask, B, H, Q, K, p, out != probs);
  for (size_t i = 0; i < plan.size(); ++i) plan.run<false>(i, probs, out, p);
}

// The Softmax-fused op: out = calibrate(softmax(scores)); out may alias scores.
template <typename T>
void softmax_calibrate(const T* scores, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                       const AttncalParams& p) {
  const Plan plan(mask, B, H, Q, K, p, true);
  for (size_t i = 0; i < plan.size(); ++i) plan.run<true>(i, scores, out, p);
}

}  // namespace attncal

#endif  // ATTNCAL_CPU_BATCH_PLAN_H_
