// The CPU calibrated-attention kernel alone (plugins/kernels/cpu/calibrated_attention.h), one thread, on the
// attention shapes of the models attncal benchmarks: what a kernel change does to the op, without the rest of
// the model around it.  Driven by benchmarks/attention_kernel.py, which builds this file against each kernel
// tree it is given and interleaves the builds round by round.
//
//   attention_kernel SHAPE ROUNDS [POOLING [CLOCK]]     one line per round: "SHAPE ms HASH"
//
// The rounds run the op's work units serially as the ORT kernel runs them on its pool, with what the kernel keeps
// from call to call kept here too: a store of packed key tiles where the tree has one (ORT's arena keeps its
// pages from run to run; a fresh one per call would time the page faults).  The driver times the second round.
// POOLING `off` (the default) runs the op uncalibrated (strength 0: every row takes the key tiles or blocks as in an
// uncalibrated layer); `mean` calibrates every row (mean pooling: no isolated key); `cls` calibrates the first token's row (the pooled-row op) and `landmark` the row of a
// landmark closing each chunk of 128 tokens (the all-rows op with marked rows and their own keys isolated), both
// with the published defaults (cls-soft, lambda 0.5, baskets of 128).  Random float32 inputs with no padding; HASH
// is an FNV-1a hash of the output's bits, so two builds that compute the same bits print the same hash.  CLOCK `wall`
// (the default) times a round by the wall clock, `cpu` by the process's CPU time: the program runs one thread, so
// that is its time on a core, which other jobs on a shared machine inflate less than the wall clock.
#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/calibrated_attention.h"
#include "self_attention_setup.h"

namespace {

struct Shape {
  const char* name;
  const char* what;
  int64_t B, S, N, N_kv, D, window_left, window_right;
};

// Each model's attention at the batch its benchmark runs (docs/performance.md).
constexpr Shape kShapes[] = {
    {"xlmr-2048", "XLM-R shape, 8 x 2,048, 4 heads of 64", 8, 2048, 4, 4, 64, -1, -1},
    {"xlmr-8192", "XLM-R shape, 1 x 8,192", 1, 8192, 4, 4, 64, -1, -1},
    {"minilm-128", "all-MiniLM-L6-v2, 8 x 128, 12 heads of 32", 8, 128, 12, 12, 32, -1, -1},
    {"minilm-256", "all-MiniLM-L6-v2, 8 x 256, 12 heads of 32", 8, 256, 12, 12, 32, -1, -1},
    {"minilm-512", "all-MiniLM-L6-v2, 8 x 512, 12 heads of 32", 8, 512, 12, 12, 32, -1, -1},
    {"gemma-window", "EmbeddingGemma, 4 x 2,048, 3 heads of 256 over 1, window +-256", 4, 2048, 3, 1, 256, 256, 256},
    {"gemma-global", "EmbeddingGemma's global layer, 4 x 2,048", 4, 2048, 3, 1, 256, -1, -1},
    {"qwen3", "Qwen3, 4 x 2,048, 16 heads of 128 over 8, causal", 4, 2048, 16, 8, 128, -1, 0},
    {"modernbert-window", "ModernBERT, 4 x 2,048, 12 heads of 64, window +-64", 4, 2048, 12, 12, 64, 64, 64},
};

// The plan's store of packed key tiles, in `store` (kept across rounds); a kernel tree without one has nothing to
// share (older trees: this file builds against any tree the driver is given).
template <typename Plan>
auto share_tiles(Plan& plan, std::vector<float>& store, int) -> decltype(plan.share_tiles(nullptr), void()) {
  if (plan.tile_store_floats() <= 0) return;
  if (static_cast<int64_t>(store.size()) < plan.tile_store_floats())
    store.resize(static_cast<size_t>(plan.tile_store_floats()));
  plan.share_tiles(store.data());
}
template <typename Plan>
void share_tiles(Plan&, std::vector<float>&, long) {}

// Landmark rows (marked_rows, isolate_self), where the tree has them: false for an older tree.
template <typename P>
auto mark_landmarks(P& p, int) -> decltype(p.marked_rows, bool()) {
  p.marked_rows = 1;
  p.isolate_self = 1;
  p.self_mode = ATTNCAL_MODE_ORIGINAL;
  return true;
}
template <typename P>
bool mark_landmarks(P&, long) {
  return false;
}

constexpr int64_t kLandmarkEvery = 128;  // one landmark closing each chunk of 128 tokens
// ATTNCAL_ROW_MARK (common/attncal_params.h), written as its value so that this file builds against older trees.
constexpr int64_t kRowMark = 2;

// The calibration of `pooling` on the uncalibrated call's attributes (false: an unknown pooling, or landmark rows
// on a tree without them); the mask marks the landmarks' rows.
bool calibrate(const std::string& pooling, int64_t B, int64_t S, AttncalParams* p, std::vector<int64_t>* mask) {
  if (pooling == "off") return true;
  p->strength = 0.5f;
  if (pooling == "mean") return true;  // every row, no isolated key: mean pooling's defaults
  p->isolate_first = 1;
  if (pooling == "cls") {
    p->all_rows = 0;
    return true;
  }
  if (pooling != "landmark" || !mark_landmarks(*p, 0)) return false;
  p->first_mode = ATTNCAL_MODE_EQUAL;  // the first token is not the landmark rows' pooling token
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = kLandmarkEvery - 1; i < S; i += kLandmarkEvery) (*mask)[b * S + i] = kRowMark;
  return true;
}

uint64_t fnv1a(const float* x, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(x);
  for (size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: attention_kernel SHAPE ROUNDS [off|mean|cls|landmark [wall|cpu]]\n");
    return 2;
  }
  const std::string clock = argc == 5 ? argv[4] : "wall";
  if (clock != "wall" && clock != "cpu") {
    std::fprintf(stderr, "attention_kernel: CLOCK must be wall or cpu, got %s\n", clock.c_str());
    return 2;
  }
  const Shape* s = nullptr;
  for (const Shape& c : kShapes)
    if (std::string(argv[1]) == c.name) s = &c;
  if (s == nullptr) {
    std::fprintf(stderr, "attention_kernel: no shape %s\n", argv[1]);
    return 2;
  }
  const int rounds = std::atoi(argv[2]);
  attncal::AttentionShape sh;
  AttncalParams p;
  attncal_bench::uncalibrated_self_attention(s->B, s->S, s->N, s->N_kv, s->D, s->window_left, s->window_right, &sh,
                                             &p);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  std::vector<float> q(s->B * s->S * s->N * s->D), k(s->B * s->S * s->N_kv * s->D), v(k.size()), out(q.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(gen);
  std::vector<int64_t> mask(s->B * s->S, 1);
  const std::string pooling = argc == 4 ? argv[3] : "off";
  if (!calibrate(pooling, s->B, s->S, &p, &mask)) {
    std::fprintf(stderr, "attention_kernel: no pooling %s in this kernel tree (off, mean, cls, landmark)\n", pooling.c_str());
    return 2;
  }
  attncal::gemm_init();
  std::vector<float> store;
  const auto now_ms = [&clock] {
    if (clock == "wall")
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
  };
  for (int r = 0; r < rounds; ++r) {
    const double t0 = now_ms();
    attncal::AttentionPlan plan(mask.data(), sh, p);
    share_tiles(plan, store, 0);
    for (size_t i = 0; i < plan.size(); ++i) plan.run(i, q.data(), k.data(), v.data(), out.data(), p);
    const double ms = now_ms() - t0;
    std::printf("%s %.2f %016llx\n", s->name, ms, static_cast<unsigned long long>(fnv1a(out.data(), out.size())));
    std::fflush(stdout);
  }
  return 0;
}
