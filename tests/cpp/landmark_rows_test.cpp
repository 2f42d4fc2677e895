// Host test of the marked rows and the own key (marked_rows, isolate_self: landmark pooling) in the CPU kernels
// of plugins/kernels/cpu/: the calibration op (batch_plan.h: calibrate, in place and out of place), the
// Softmax-fused op (softmax_calibrate) and the calibrated attention op (calibrated_attention.h, short rows in
// whole-row blocks and long rows over key tiles with the marked rows gathered), against a reference in double
// written here from the contract (attncal/graphs/contract.py, "Marked rows"): only the rows whose mask value is
// ATTNCAL_ROW_MARK are calibrated, each row's own key leaves its basket and takes the self share (in the first or
// last key's place where it is that key).  Random attributes and masks (both padding sides, holes); unmarked
// rows must come back bit for bit.  Run once per instruction-set path (tests/support/cpu.py).  Prints one summary
// line; exits non-zero on a failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/attncal_params.h"
#include "cpu/batch_plan.h"
#include "cpu/calibrated_attention.h"

namespace {

std::mt19937 gen(11);

int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen); }

// One row of the spec in double: a = the row's probabilities (K keys), mask = the item's mask row, q = the row.
// False where the spec leaves the row alone.
bool reference_row(const std::vector<double>& a, const int64_t* mask, int64_t K, int64_t q, const AttncalParams& p,
                   std::vector<double>* out) {
  int64_t start = -1, end = -1;
  for (int64_t k = 0; k < K; ++k)
    if (mask[k] != 0) {
      if (start < 0) start = k;
      end = k;
    }
  if (start < 0 || p.strength == 0.f) return false;
  const int64_t c0 = start + p.isolate_first, C = end - start + 1 - p.isolate_first - p.isolate_last;
  const int64_t S = p.basket_size;
  if (C <= 0 || (p.skip_short && C < S)) return false;
  std::vector<double> z(K);
  for (int64_t k = 0; k < K; ++k) z[k] = mask[k] != 0 ? a[k] : 0.0;
  struct Iso {
    int64_t pos;
    int mode;
    double weight;
  };
  std::vector<Iso> iso;
  if (p.isolate_first && !(p.isolate_self && q == start)) iso.push_back({start, p.first_mode, p.first_weight});
  if (p.isolate_last && !(p.isolate_self && q == end)) iso.push_back({end, p.last_mode, p.last_weight});
  std::vector<double> content(z.begin() + c0, z.begin() + c0 + C);
  if (p.isolate_self) {
    if (q >= c0 && q < c0 + C) content[q - c0] = 0.0;
    iso.push_back({q, p.self_mode, p.self_weight});
  }
  const int64_t n = (C + S - 1) / S;
  const double t = static_cast<double>(n + static_cast<int64_t>(iso.size()));
  std::vector<double> cal(K, 0.0);
  for (int64_t b = 0; b < n; ++b) {
    double A = 0.0;
    for (int64_t j = b * S; j < std::min(C, (b + 1) * S); ++j) A += content[j];
    for (int64_t j = b * S; j < std::min(C, (b + 1) * S); ++j) cal[c0 + j] = A != 0.0 ? content[j] / A / t : 0.0;
  }
  bool non_equal = false;
  double shares = 0.0;
  std::vector<double> share(iso.size());
  for (size_t i = 0; i < iso.size(); ++i) {
    share[i] = iso[i].mode == ATTNCAL_MODE_EQUAL ? 1.0 / t : iso[i].mode == ATTNCAL_MODE_ORIGINAL ? z[iso[i].pos]
                                                                                                  : iso[i].weight;
    non_equal = non_equal || iso[i].mode != ATTNCAL_MODE_EQUAL;
    shares += share[i];
  }
  if (non_equal) {
    double content_sum = 0.0;
    for (double c : cal) content_sum += c;
    if (content_sum != 0.0)
      for (double& c : cal) c *= std::max(0.0, 1.0 - shares) / content_sum;
  }
  for (size_t i = 0; i < iso.size(); ++i) cal[iso[i].pos] = share[i];
  double total = 0.0;
  for (double c : cal) total += c;
  out->assign(K, 0.0);
  for (int64_t k = 0; k < K; ++k)
    (*out)[k] = mask[k] != 0 ? p.strength * (total != 0.0 ? cal[k] / total : cal[k]) + (1.0 - p.strength) * z[k]
                             : 0.0;
  return true;
}

AttncalParams random_params() {
  AttncalParams p{};
  p.all_rows = 1;
  p.marked_rows = 1;
  p.isolate_self = uniform() < 0.8;
  p.basket_size = std::vector<int>{1, 2, 3, 4, 8}[uniform_int(0, 4)];
  p.strength = uniform() < 0.2 ? 1.f : static_cast<float>(uniform());
  p.isolate_first = uniform() < 0.6;
  p.isolate_last = uniform() < 0.3;
  p.first_mode = uniform_int(0, 2);
  p.last_mode = uniform_int(0, 2);
  p.self_mode = uniform_int(0, 2);
  p.first_weight = static_cast<float>(0.3 * uniform());
  p.last_weight = static_cast<float>(0.3 * uniform());
  p.self_weight = static_cast<float>(0.3 * uniform());
  p.skip_short = uniform() < 0.5;
  p.window_left = p.window_right = -1;
  return p;
}

// A mask row of K keys: one run of valid keys on a random side, now and then a hole, a few rows marked (the
// first and last valid keys now and then for sure).
std::vector<int64_t> random_mask(int64_t B, int64_t K, double marked) {
  std::vector<int64_t> m(static_cast<size_t>(B * K), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = uniform_int(0, static_cast<int>(K));
    const int64_t lo = uniform() < 0.5 ? 0 : K - n;
    for (int64_t k = lo; k < lo + n; ++k) m[b * K + k] = uniform() < marked ? ATTNCAL_ROW_MARK : 1;
    if (n > 0 && uniform() < 0.3) m[b * K + lo] = ATTNCAL_ROW_MARK;
    if (n > 0 && uniform() < 0.3) m[b * K + lo + n - 1] = ATTNCAL_ROW_MARK;
    if (n > 4 && uniform() < 0.1) m[b * K + lo + uniform_int(1, static_cast<int>(n) - 2)] = 0;
  }
  return m;
}

struct Tally {
  int64_t rows = 0, calibrated = 0, failures = 0;
  double worst = 0.0;
  void fail(const char* what, int64_t b, int64_t q, double err) {
    if (++failures <= 10) std::printf("%s: item %lld row %lld error %.3g\n", what, (long long)b, (long long)q, err);
  }
};

// The calibration op and the Softmax-fused op on [B,H,K,K].
void check_calibration_ops(Tally& tally) {
  const AttncalParams p = random_params();
  const int64_t B = uniform_int(1, 6), H = uniform_int(1, 2), K = uniform_int(1, 24);
  const std::vector<int64_t> mask = random_mask(B, K, std::vector<double>{0.05, 0.2, 0.6}[uniform_int(0, 2)]);
  std::vector<float> scores(static_cast<size_t>(B * H * K * K)), probs(scores.size());
  std::normal_distribution<float> normal(0.f, 2.f);
  for (float& s : scores) s = normal(gen);
  for (int64_t r = 0; r < B * H * K; ++r) {  // the softmax in double, rounded to float
    double m = -1e300, sum = 0.0;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, static_cast<double>(scores[r * K + k]));
    for (int64_t k = 0; k < K; ++k) sum += std::exp(scores[r * K + k] - m);
    for (int64_t k = 0; k < K; ++k) probs[r * K + k] = static_cast<float>(std::exp(scores[r * K + k] - m) / sum);
  }
  std::vector<float> in_place = probs, out(probs.size()), fused(probs.size());
  attncal::calibrate(in_place.data(), in_place.data(), mask.data(), B, H, K, K, p);
  attncal::calibrate(probs.data(), out.data(), mask.data(), B, H, K, K, p);
  attncal::softmax_calibrate(scores.data(), fused.data(), mask.data(), B, H, K, K, p);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < K; ++q) {
        const int64_t off = ((b * H + h) * K + q) * K;
        std::vector<double> a(probs.begin() + off, probs.begin() + off + K), want;
        std::vector<double> soft(K);
        double m = -1e300, sum = 0.0;
        for (int64_t k = 0; k < K; ++k) m = std::max(m, static_cast<double>(scores[off + k]));
        for (int64_t k = 0; k < K; ++k) sum += std::exp(scores[off + k] - m);
        for (int64_t k = 0; k < K; ++k) soft[k] = std::exp(scores[off + k] - m) / sum;
        ++tally.rows;
        const bool cal = mask[b * K + q] == ATTNCAL_ROW_MARK && reference_row(a, mask.data() + b * K, K, q, p, &want);
        if (!cal) {
          if (std::memcmp(&in_place[off], &probs[off], sizeof(float) * K) != 0 ||
              std::memcmp(&out[off], &probs[off], sizeof(float) * K) != 0)
            tally.fail("an unmarked row changed", b, q, 0.0);
          for (int64_t k = 0; k < K; ++k)
            if (std::fabs(fused[off + k] - soft[k]) > 1e-6) tally.fail("softmax of an unmarked row", b, q, 1.0);
          continue;
        }
        ++tally.calibrated;
        std::vector<double> want_soft;
        reference_row(soft, mask.data() + b * K, K, q, p, &want_soft);
        for (int64_t k = 0; k < K; ++k) {
          const double e = std::max({std::fabs(in_place[off + k] - want[k]), std::fabs(out[off + k] - want[k]),
                                     std::fabs(fused[off + k] - want_soft[k])});
          tally.worst = std::max(tally.worst, e);
          if (!(e <= 1e-6)) {
            tally.fail("calibrated row", b, q, e);
            break;
          }
        }
      }
}

// The calibrated attention op, float32: Q, K, V [B,S,N*D]; short rows (whole-row blocks) and long ones (key
// tiles, the marked rows gathered into blocks).
void check_attention(Tally& tally, bool long_rows) {
  AttncalParams p = random_params();
  p.num_heads = 1;
  const int64_t B = long_rows ? 1 : uniform_int(1, 4), S = long_rows ? uniform_int(1100, 1400) : uniform_int(1, 24);
  const int64_t N = 1, D = 8;
  const std::vector<int64_t> mask = random_mask(B, S, long_rows ? 0.01 : 0.3);
  std::vector<float> q(static_cast<size_t>(B * S * N * D)), k(q.size()), v(q.size()), ctx(q.size());
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& x : q) x = normal(gen);
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);
  attncal::AttentionShape shape{};
  shape.B = B;
  shape.S_q = shape.S_k = S;
  shape.N = N;
  shape.D = shape.D_v = D;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(D));
  shape.window_left = shape.window_right = -1;
  attncal::calibrated_attention(q.data(), k.data(), v.data(), mask.data(), ctx.data(), shape, p);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < S; ++r) {
      if (long_rows && mask[b * S + r] != ATTNCAL_ROW_MARK && uniform() > 0.02) continue;  // a sample
      std::vector<double> s(S), probs(S), want;
      double m = -1e300, sum = 0.0;
      for (int64_t j = 0; j < S; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[(b * S + r) * D + d]) * k[(b * S + j) * D + d];
        s[j] = dot * shape.scale + (mask[b * S + j] != 0 ? 0.0 : -3.4028234663852886e38);
        m = std::max(m, s[j]);
      }
      for (int64_t j = 0; j < S; ++j) sum += std::exp(s[j] - m);
      for (int64_t j = 0; j < S; ++j) probs[j] = std::exp(s[j] - m) / sum;
      ++tally.rows;
      if (mask[b * S + r] == ATTNCAL_ROW_MARK && reference_row(probs, mask.data() + b * S, S, r, p, &want)) {
        ++tally.calibrated;
        probs = want;
      }
      for (int64_t d = 0; d < D; ++d) {
        double c = 0.0;
        for (int64_t j = 0; j < S; ++j) c += probs[j] * v[(b * S + j) * D + d];
        const double e = std::fabs(ctx[(b * S + r) * D + d] - c);
        tally.worst = std::max(tally.worst, e);
        if (!(e <= 2e-5)) {  // float32 scores and sums over up to 1,400 keys
          tally.fail(long_rows ? "attention, long rows" : "attention", b, r, e);
          break;
        }
      }
    }
}

}  // namespace

int main() {
  attncal::gemm_init();
  Tally tally;
  for (int i = 0; i < 1500; ++i) check_calibration_ops(tally);
  for (int i = 0; i < 300; ++i) check_attention(tally, false);
  for (int i = 0; i < 6; ++i) check_attention(tally, true);
  std::printf("%lld rows checked, %lld calibrated, max abs err %.3g, %lld failure(s)\n", (long long)tally.rows,
              (long long)tally.calibrated, tally.worst, (long long)tally.failures);
  return tally.failures == 0 ? 0 : 1;
}
