// Host test of plugins/kernels/cpu/packed_gemm.h: both micro-kernels (AVX-512, panels of 32; AVX2, panels of
// 16; each where this CPU runs it) against a float64 reference, on shapes that cut the 8- or 6-row blocks,
// the 256-row and 192-k blocks and the last panel short, and on panel ranges (the ORT kernel's column tiles).
// Also: every element is the same whichever panel range computes it (results independent of the tiling), and
// packed_gemm without a bias, accumulating onto y (the attention's context over key tiles), against the
// reference, with each row computed alone equal bit for bit to the same row computed among all M; the keys of
// an attention tile packed transposed, and a range of k.
// Prints one line per kernel; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/packed_gemm.h"

int main() {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  int failures = 0, kernels = 0;
  for (int64_t width : {32, 16}) {
    attncal::PackedWeight probe;
    std::vector<float> one(1, 1.f);
    if (!probe.Pack(one.data(), 1, 1, 1, width)) {
      std::printf("panel width %lld: no kernel on this CPU or in this build, skipped\n",
                  static_cast<long long>(width));
      continue;
    }
    ++kernels;
    double worst = 0.0;
    int cases = 0;
    const int64_t shapes[][3] = {{1, 1, 1}, {1, 384, 1152}, {7, 5, 33}, {8, 40, 31}, {70, 384, 1152},
                                 {97, 17, 96}, {200, 48, 100}, {255, 3, 47}, {13, 1, 65},
                                 {9, 400, 70}, {300, 193, 40}};  // the last two: blocks of k cut short
    for (const auto& shape : shapes) {
      const int64_t M = shape[0], K = shape[1], N = shape[2];
      std::vector<float> x(M * K), w(K * N), bias(N), y(M * N, NAN), tiled(M * N, NAN);
      for (auto& v : x) v = u(gen);
      for (auto& v : w) v = u(gen);
      for (auto& v : bias) v = u(gen);
      attncal::PackedWeight pw;
      if (!pw.Pack(w.data(), K, N, N, width) || pw.panel_width() != width) {
        std::printf("panel width %lld: Pack declined\n", static_cast<long long>(width));
        return 1;
      }
      const int64_t panels = (N + width - 1) / width;
      attncal::packed_gemm_bias(pw, M, x.data(), K, bias.data(), 0, panels, y.data(), N);
      const int64_t splits[2][2] = {{0, M / 2}, {M / 2, M}};  // rows in two parts, two panels per tile
      for (int64_t p0 = 0; p0 < panels; p0 += 2)
        for (const auto& part : splits)
          if (part[1] > part[0])
            attncal::packed_gemm_bias(pw, part[1] - part[0], x.data() + part[0] * K, K, bias.data(), p0,
                                      std::min(panels, p0 + 2), tiled.data() + part[0] * N, N);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double ref = bias[n];
          for (int64_t k = 0; k < K; ++k) ref += static_cast<double>(x[m * K + k]) * w[k * N + n];
          const double err = std::fabs(ref - y[m * N + n]) / (1.0 + std::fabs(ref));
          worst = std::max(worst, std::isnan(err) ? INFINITY : err);
          if (y[m * N + n] != tiled[m * N + n] && failures++ < 3)
            std::printf("M=%lld K=%lld N=%lld: y[%lld,%lld] %.9g, tiled %.9g\n", static_cast<long long>(M),
                        static_cast<long long>(K), static_cast<long long>(N), static_cast<long long>(m),
                        static_cast<long long>(n), y[m * N + n], tiled[m * N + n]);
        }
      ++cases;
      // y0 + x * W, all rows at once and one row at a time (packed_gemm, no bias).
      std::vector<float> y0(M * N), acc(M * N), alone(M * N);
      for (auto& v : y0) v = u(gen);
      acc = y0;
      alone = y0;
      attncal::packed_gemm(pw, M, x.data(), K, acc.data(), N, /*accumulate=*/true);
      for (int64_t m = 0; m < M; ++m)
        attncal::packed_gemm(pw, 1, x.data() + m * K, K, alone.data() + m * N, N, /*accumulate=*/true);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double ref = y0[m * N + n];
          for (int64_t k = 0; k < K; ++k) ref += static_cast<double>(x[m * K + k]) * w[k * N + n];
          const double err = std::fabs(ref - acc[m * N + n]) / (1.0 + std::fabs(ref));
          worst = std::max(worst, std::isnan(err) ? INFINITY : err);
          if (acc[m * N + n] != alone[m * N + n] && failures++ < 3)
            std::printf("accumulate M=%lld K=%lld N=%lld: y[%lld,%lld] %.9g, row alone %.9g\n",
                        static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                        static_cast<long long>(m), static_cast<long long>(n), acc[m * N + n], alone[m * N + n]);
        }
      // The attention tile's forms: the keys packed transposed (PackTransposed of W^T) compute the same bits as
      // W packed as it is; and a range of W's rows [kb, ke) (a band of rows of a tile, over the keys it sees)
      // against the reference over that range, equal bit for bit to the whole range where x is zero outside
      // it (the keys a band skips would have had probability 0).
      std::vector<float> wt(N * K);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n) wt[n * K + k] = w[k * N + n];
      attncal::PackedWeight pt;
      std::vector<float> yt(M * N, NAN);
      if (!pt.PackTransposed(wt.data(), N, K, K, width) || pt.panel_width() != width) {
        std::printf("panel width %lld: PackTransposed declined\n", static_cast<long long>(width));
        return 1;
      }
      attncal::packed_gemm_bias(pt, M, x.data(), K, bias.data(), 0, panels, yt.data(), N);
      // Also from rows K + 3 floats apart (the keys of one head among several): the same panels.
      std::vector<float> wts(N * (K + 3), NAN), ys(M * N, NAN);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) wts[n * (K + 3) + k] = wt[n * K + k];
      attncal::PackedWeight ps;
      ps.PackTransposed(wts.data(), N, K, K + 3, width);
      attncal::packed_gemm_bias(ps, M, x.data(), K, bias.data(), 0, panels, ys.data(), N);
      for (int64_t i = 0; i < M * N; ++i)
        if ((yt[i] != y[i] || ys[i] != y[i]) && failures++ < 3)
          std::printf("transposed M=%lld K=%lld N=%lld: y[%lld] %.9g and %.9g strided, packed as is %.9g\n",
                      static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                      static_cast<long long>(i), yt[i], ys[i], y[i]);
      const int64_t kb = K / 3, ke = std::max(kb + 1, K - K / 4);
      std::vector<float> xz(x);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k)
          if (k < kb || k >= ke) xz[m * K + k] = 0.f;
      std::vector<float> part(y0), whole(y0);
      attncal::packed_gemm(pw, M, x.data(), K, part.data(), N, /*accumulate=*/true, kb, ke);
      attncal::packed_gemm(pw, M, xz.data(), K, whole.data(), N, /*accumulate=*/true);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double ref = y0[m * N + n];
          for (int64_t k = kb; k < ke; ++k) ref += static_cast<double>(x[m * K + k]) * w[k * N + n];
          const double err = std::fabs(ref - part[m * N + n]) / (1.0 + std::fabs(ref));
          worst = std::max(worst, std::isnan(err) ? INFINITY : err);
          if (K <= 192 && part[m * N + n] != whole[m * N + n] && failures++ < 3)
            std::printf("range M=%lld K=%lld N=%lld: y[%lld,%lld] %.9g, zeros outside %.9g\n",
                        static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                        static_cast<long long>(m), static_cast<long long>(n), part[m * N + n], whole[m * N + n]);
        }
    }
    const bool ok = worst <= 2e-5;  // float32 sums of up to 384 products of magnitude <= 1
    if (!ok) ++failures;
    std::printf("panel width %lld: %d shapes, worst relative error %.2e%s\n", static_cast<long long>(width), cases,
                worst, ok ? "" : " (> 2e-5)");
  }
  std::printf("%d kernel(s) tested, %d failure(s)\n", kernels, failures);
  return failures == 0 ? 0 : 1;
}
