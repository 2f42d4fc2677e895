// Host test of the calibrated attention kernel's shared key tiles (plugins/kernels/cpu/calibrated_attention.h,
// AttentionPlan::share_tiles): the units of a call that share a store of packed key tiles compute the same bits as
// units that each pack their own, whichever unit packs a tile first (units in order, in reverse, and on two
// threads taking them as they come), with padding, a causal mask, grouped KV heads, and a non-finite key in a tile
// that causal rows skip.  Also which shapes get a store: several units per tile (grouped heads; no window or a
// causal mask over 8 blocks of query rows or more), and not one query head per KV head with fewer blocks, or with
// a narrow window on both sides.
// Prints one line per shape; exits non-zero on a mismatch.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cpu/calibrated_attention.h"
#include "self_attention_setup.h"  // benchmarks/

namespace {

struct Case {
  const char* name;
  int64_t B, S, N, N_kv, D, window_left, window_right, pad;  // pad: right padding of the last item
  bool nan_key;                                                // a NaN in a key of the last tile of item 0
  bool stored;                                                 // whether the plan should take a store
};

enum class Order { kForward, kReverse, kTwoThreads };

std::vector<float> run(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                       const std::vector<float>& v, const std::vector<int64_t>& mask, bool store, Order order,
                       int64_t* store_floats) {
  attncal::AttentionShape sh;
  AttncalParams p;
  attncal_bench::uncalibrated_self_attention(c.B, c.S, c.N, c.N_kv, c.D, c.window_left, c.window_right, &sh, &p);
  attncal::AttentionPlan plan(mask.data(), sh, p);
  *store_floats = plan.tile_store_floats();
  std::vector<float> tiles;
  if (store && *store_floats > 0) {
    tiles.assign(static_cast<size_t>(*store_floats), NAN);  // every float the units read was written first
    plan.share_tiles(tiles.data());
  }
  std::vector<float> out(q.size(), NAN);
  const size_t n = plan.size();
  if (order == Order::kTwoThreads) {
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) plan.run(i, q.data(), k.data(), v.data(), out.data(), p);
    };
    std::thread other(worker);
    worker();
    other.join();
  } else {
    for (size_t j = 0; j < n; ++j)
      plan.run(order == Order::kForward ? j : n - 1 - j, q.data(), k.data(), v.data(), out.data(), p);
  }
  return out;
}

}  // namespace

int main() {
  attncal::gemm_init();
  const Case cases[] = {
      {"gqa-causal", 2, 1536, 4, 2, 32, -1, 0, 300, false, true},
      {"gqa-causal-nan", 1, 1536, 4, 2, 32, -1, 0, 0, true, true},
      {"mha-causal-8-blocks", 1, 4096, 1, 1, 16, -1, 0, 100, false, true},
      {"mqa-window", 1, 2048, 3, 1, 64, 256, 256, 0, false, true},
      {"mha-3-blocks", 1, 1100, 2, 2, 16, -1, -1, 0, false, false},
      {"mha-narrow-window", 1, 2048, 2, 2, 64, 64, 64, 0, false, false},
  };
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  int failures = 0;
  for (const Case& c : cases) {
    std::vector<float> q(c.B * c.S * c.N * c.D), k(c.B * c.S * c.N_kv * c.D), v(k.size());
    for (auto* t : {&q, &k, &v})
      for (float& x : *t) x = normal(gen);
    if (c.nan_key) k[(c.S - 1) * c.N_kv * c.D] = NAN;  // the last key of item 0, KV head 0
    std::vector<int64_t> mask(c.B * c.S, 1);
    for (int64_t s = c.S - c.pad; s < c.S; ++s) mask[(c.B - 1) * c.S + s] = 0;
    int64_t floats = 0;
    const std::vector<float> own = run(c, q, k, v, mask, false, Order::kForward, &floats);
    if ((floats > 0) != c.stored && failures++ < 20)
      std::printf("%s: store of %lld floats, expected %s\n", c.name, static_cast<long long>(floats),
                  c.stored ? "one" : "none");
    int64_t nan_rows = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(own.size()); i += c.D) nan_rows += std::isnan(own[i]) ? 1 : 0;
    // A NaN key: every row of its KV head's query heads is NaN, the rows the causal mask hides it from as well (the
    // contract adds the mask to the scores, and NaN plus the mask is NaN); the other heads' rows are not.
    const int64_t expected_nan = c.nan_key ? c.S * (c.N / c.N_kv) : 0;
    if (nan_rows != expected_nan && failures++ < 20)
      std::printf("%s: %lld NaN rows, expected %lld\n", c.name, static_cast<long long>(nan_rows),
                  static_cast<long long>(expected_nan));
    for (Order order : {Order::kForward, Order::kReverse, Order::kTwoThreads}) {
      const std::vector<float> shared = run(c, q, k, v, mask, true, order, &floats);
      if (std::memcmp(shared.data(), own.data(), own.size() * sizeof(float)) != 0 && failures++ < 20)
        std::printf("%s: shared tiles (order %d) differ from each unit's own\n", c.name, static_cast<int>(order));
    }
    std::printf("%s: store %lld floats, %lld NaN rows\n", c.name, static_cast<long long>(floats),
                static_cast<long long>(nan_rows));
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
