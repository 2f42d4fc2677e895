// The row scalars a thread keeps from its last calibrated row (cpu/row_calibration.h: row_scalars) never change a
// row's bits: every row of an item, calibrated in turn with one scratch (as a unit of the kernels runs them), equals
// the same row calibrated with a fresh scratch, which computes attncal_row_scalars anew.  Over attribute sets where
// the scalars are the same for every row (no isolated or own keys) and where each row's own probabilities enter them
// (isolated first and last keys of the original weight, an own key, an empty basket), for the fused softmax form and the
// probabilities form, with and without holes in the mask.  Prints "N rows, M failure(s)".
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/batch_plan.h"

namespace {

struct Case {
  int isolate_first, isolate_last, first_mode, last_mode, isolate_self;
  float strength;
};

}  // namespace

int main() {
  const Case cases[] = {
      {0, 0, ATTNCAL_MODE_ORIGINAL, ATTNCAL_MODE_EQUAL, 0, 0.5f},    // mean pooling's: the same scalars every row
      {1, 0, ATTNCAL_MODE_ORIGINAL, ATTNCAL_MODE_EQUAL, 0, 0.5f},    // cls-soft: each row's first probability
      {1, 1, ATTNCAL_MODE_ORIGINAL, ATTNCAL_MODE_ORIGINAL, 0, 0.3f},  // and its last one
      {1, 1, ATTNCAL_MODE_EQUAL, ATTNCAL_MODE_FIXED, 0, 1.0f},
      {1, 0, ATTNCAL_MODE_EQUAL, ATTNCAL_MODE_EQUAL, 1, 0.5f},        // an own key per row
  };
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  long rows = 0, failures = 0;
  for (const Case& c : cases)
    for (int holes = 0; holes < 2; ++holes)
      for (int64_t K : {40, 300, 700}) {
        AttncalParams p;
        std::memset(&p, 0, sizeof p);
        p.all_rows = 1;
        p.basket_size = 128;
        p.skip_short = 0;
        p.strength = c.strength;
        p.isolate_first = c.isolate_first;
        p.isolate_last = c.isolate_last;
        p.first_mode = c.first_mode;
        p.last_mode = c.last_mode;
        p.last_weight = 0.1f;
        p.isolate_self = c.isolate_self;
        p.marked_rows = c.isolate_self;
        p.self_mode = ATTNCAL_MODE_ORIGINAL;
        std::vector<int64_t> mask(K, 1);
        if (holes)
          for (int64_t k = 5; k < K - 5; k += 9) mask[k] = 0;
        std::vector<attncal::ItemPlan> items;
        std::vector<float> keep;
        std::vector<const float*> keep_of;
        attncal::plan_items(mask.data(), 1, K, K, p, &items, &keep, &keep_of);
        const attncal::ItemPlan& it = items[0];
        std::vector<float> x(K), warm(K), cold(K);
        attncal::Scratch shared;
        for (int fused = 0; fused < 2; ++fused)
          for (int64_t q = it.q_lo; q <= it.q_hi; ++q) {
            if (c.isolate_self && mask[q] == 0) continue;  // a row that sees no own key is not a marked row
            for (float& v : x) v = 3.0f * normal(gen);
            if (q % 3 == 0 && K > 256)  // an empty basket on every third row: nonempty moves from row to row
              for (int64_t k = 128; k < 258; ++k) x[k] = -1e4f;
            if (!fused) attncal::softmax_row(x.data(), x.data(), K);
            attncal::Scratch fresh;
            if (fused) {
              attncal::softmax_calibrate_row(x.data(), warm.data(), K, q, it, keep_of[0], p, shared);
              attncal::softmax_calibrate_row(x.data(), cold.data(), K, q, it, keep_of[0], p, fresh);
            } else {
              attncal::calibrate_row(x.data(), warm.data(), K, q, it, keep_of[0], p, shared);
              attncal::calibrate_row(x.data(), cold.data(), K, q, it, keep_of[0], p, fresh);
            }
            ++rows;
            if (std::memcmp(warm.data(), cold.data(), sizeof(float) * K) != 0) {
              if (++failures <= 5)
                std::printf("differs: case %d holes %d K %ld fused %d row %ld\n", static_cast<int>(&c - cases), holes,
                            static_cast<long>(K), fused, static_cast<long>(q));
            }
          }
      }
  std::printf("%ld rows, %ld failure(s)\n", rows, failures);
  return failures == 0 && rows > 1000 ? 0 : 1;
}
