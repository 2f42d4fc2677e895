// The CPU calibrated-attention kernel alone (plugins/kernels/cpu/calibrated_attention.h), one thread, on the
// attention shapes of the models attncal benchmarks: what a kernel change does to the op, without the rest of
// the model around it.  Driven by benchmarks/attention_kernel.py, which builds this file against each kernel
// tree it is given and interleaves the builds round by round.
//
//   attention_kernel SHAPE ROUNDS     one line per round: "SHAPE ms HASH"
//
// The op runs uncalibrated (strength 0: every row takes the key tiles or blocks as in an uncalibrated layer) on
// random float32 inputs with no padding; HASH is an FNV-1a hash of the output's bits, so two builds that compute
// the same bits print the same hash.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/calibrated_attention.h"

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
    {"minilm-512", "all-MiniLM-L6-v2, 8 x 512, 12 heads of 32", 8, 512, 12, 12, 32, -1, -1},
    {"gemma-window", "EmbeddingGemma, 4 x 2,048, 3 heads of 256 over 1, window +-256", 4, 2048, 3, 1, 256, 256, 256},
    {"gemma-global", "EmbeddingGemma's global layer, 4 x 2,048", 4, 2048, 3, 1, 256, -1, -1},
    {"qwen3", "Qwen3, 4 x 2,048, 16 heads of 128 over 8, causal", 4, 2048, 16, 8, 128, -1, 0},
    {"modernbert-window", "ModernBERT, 4 x 2,048, 12 heads of 64, window +-64", 4, 2048, 12, 12, 64, 64, 64},
};

uint64_t fnv1a(const float* x, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(x);
  for (size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: attention_kernel SHAPE ROUNDS\n");
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
  sh.B = s->B;
  sh.S_q = sh.S_k = s->S;
  sh.N = s->N;
  sh.N_kv = s->N_kv;
  sh.D = sh.D_v = s->D;
  sh.scale = 1.0f / std::sqrt(static_cast<float>(s->D));
  sh.window_left = s->window_left;
  sh.window_right = s->window_right;
  AttncalParams p;
  std::memset(&p, 0, sizeof p);
  p.all_rows = 1;
  p.basket_size = 128;
  p.first_mode = ATTNCAL_MODE_ORIGINAL;
  p.skip_short = 1;
  p.num_heads = static_cast<int32_t>(s->N);
  p.num_kv_heads = static_cast<int32_t>(s->N_kv);
  p.window_left = static_cast<int32_t>(s->window_left);
  p.window_right = static_cast<int32_t>(s->window_right);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  std::vector<float> q(s->B * s->S * s->N * s->D), k(s->B * s->S * s->N_kv * s->D), v(k.size()), out(q.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(gen);
  const std::vector<int64_t> mask(s->B * s->S, 1);
  attncal::gemm_init();
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    attncal::calibrated_attention(q.data(), k.data(), v.data(), mask.data(), out.data(), sh, p);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s %.2f %016llx\n", s->name, ms, static_cast<unsigned long long>(fnv1a(out.data(), out.size())));
    std::fflush(stdout);
  }
  return 0;
}
