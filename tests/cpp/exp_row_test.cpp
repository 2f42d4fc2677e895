// Host test of the softmax's exp in plugins/kernels/cpu/exp.h: exp_shifted_row (the version for this
// CPU: 8 lanes at a time then a scalar tail, or GCC's own vectorised loop with AVX-512) against exp in double over the whole range it serves, x - max in
// [-110, 0], and the special values: exactly 1 at 0 (the row maximum: the softmax sum is >= 1), exactly 0 below
// -104 and at -inf, NaN for NaN, subnormal results kept.  Every value is placed both in a vector lane and in
// the tail, and the two must agree bit for bit: a vector body (AVX-512's takes its power of two with
// vscalefps) computes the scalar formula, not a neighbour of it.  Prints one summary line; exits non-zero on a
// mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/exp.h"

int main() {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-110.f, 0.f);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> values = {0.f, -0.f, -1e-30f, -0.5f, -0.6931472f, -1.f, -87.3f, -87.4f, -100.f, -103.97f,
                               -103.99f, -104.f, -104.01f, -150.f, -1e30f, -inf, nan};
  for (int i = 0; i < 20000; ++i) values.push_back(u(gen));
  int failures = 0, checked = 0;
  double worst_rel = 0.0;
  // A row of 29 floats: each value once at position 11 (inside a vector step) and once at 26 (the 8-lane
  // form's tail).
  for (float v : values) {
    std::vector<float> x(16 + 13, -1.f), y(x.size());
    x[11] = v;
    x[26] = v;
    attncal::exp_shifted_row(x.data(), y.data(), static_cast<int64_t>(x.size()), 0.f);
    if (v == v && std::memcmp(&y[11], &y[26], sizeof(float)) != 0) {
      if (++failures <= 10) std::printf("exp(%.9g): lane %.9g, tail %.9g\n", v, y[11], y[26]);
    }
    for (size_t at : {size_t{11}, size_t{26}}) {
      const float got = y[at];
      bool ok;
      if (v != v) {
        ok = got != got;
      } else if (v < -104.f) {
        ok = got == 0.f;
      } else if (v == 0.f) {
        ok = got == 1.f;
      } else {
        const double want = std::exp(static_cast<double>(v));
        const double err = std::fabs(static_cast<double>(got) - want);
        if (want >= std::numeric_limits<float>::min()) {
          worst_rel = std::fmax(worst_rel, err / want);
          ok = err <= 4e-7 * want;
        } else {
          ok = err <= std::ldexp(1.0, -149);  // one subnormal step
        }
      }
      ++checked;
      if (!ok) {
        if (++failures <= 10) std::printf("exp(%.9g) at %zu: got %.9g\n", v, at, got);
      }
    }
  }
  std::printf("%d values checked, worst relative error %.3g, %d failure(s)\n", checked, worst_rel, failures);
  return failures == 0 ? 0 : 1;
}
