// The CPU attention kernel's GEMMs, one library against another, on the shapes the kernel calls them with.
//
// Why: the kernel (plugins/kernels/cpu/calibrated_attention.h) makes two single-threaded float32 GEMMs per
// block of query rows: scores = scale * Q_blk * K^T (NT: R x T x D) and context += P * V (NN: R x D_v x T),
// where R is the block's rows, T the keys of a tile (or of the whole row) and D the head size.  They are thin
// (D = 32 to 256), and which library multiplies them fastest decides the kernel's speed at long sequences.
// This program times each backend on those shapes, one thread, backends interleaved round by round, and prints
// GFLOP/s and the ratio to OpenBLAS (the default backend, plugins/kernels/cpu/gemm.h).
//
// Backends, each compiled in only where its macro is given (see benchmarks/gemm_shapes.sh):
//   OpenBLAS (scipy-openblas32, the kernel's default), always;
//   the kernel's built-in loops (plugins/kernels/cpu/gemm.h without a backend macro), always;
//   GEMM_SHAPES_MKL:    Intel MKL's cblas_sgemm (mkl_rt; run with MKL_THREADING_LAYER=SEQUENTIAL);
//   GEMM_SHAPES_ONEDNN: oneDNN's dnnl_sgemm (row-major; run with OMP_NUM_THREADS=1).
// Every backend's result is compared with OpenBLAS's (max relative difference printed), so a backend that
// computes something else is not timed as if it were faster.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cpu/gemm.h"  // no backend macro: the built-in loops

extern "C" {
// scipy-openblas32's CBLAS (every symbol scipy_-prefixed, so it never clashes with MKL's cblas_sgemm).
void scipy_cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha, const float* a, int lda,
                       const float* b, int ldb, float beta, float* c, int ldc);
void scipy_openblas_set_num_threads(int n);
#if defined(GEMM_SHAPES_MKL)
void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
#endif
#if defined(GEMM_SHAPES_ONEDNN)
// oneDNN's BLAS-like entry point (dnnl.h): row-major C = alpha * op(A) * op(B) + beta * C; returns dnnl_status_t.
int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
#endif
}

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // the CBLAS enum values

struct Shape {
  const char* what;
  bool nt;  // C[M,N] = A[M,K] * B[N,K]^T (scores), else C[M,N] += A[M,K] * B[K,N] (context)
  int64_t M, N, K;
};

using Gemm = std::function<void(const Shape&, const float*, const float*, float*)>;

struct Backend {
  const char* name;
  Gemm run;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<Backend> backends() {
  std::vector<Backend> out;
  out.push_back({"openblas", [](const Shape& s, const float* a, const float* b, float* c) {
                   scipy_cblas_sgemm(kRowMajor, kNoTrans, s.nt ? kTrans : kNoTrans, s.M, s.N, s.K, 1.f, a, s.K, b,
                                     s.nt ? s.K : s.N, s.nt ? 0.f : 1.f, c, s.N);
                 }});
  out.push_back({"builtin", [](const Shape& s, const float* a, const float* b, float* c) {
                   if (s.nt)
                     attncal::gemm_nt(s.M, s.N, s.K, 1.f, a, s.K, b, s.K, c, s.N);
                   else
                     attncal::gemm_nn(s.M, s.N, s.K, a, s.K, b, s.N, c, s.N, /*accumulate=*/true);
                 }});
#if defined(GEMM_SHAPES_MKL)
  out.push_back({"mkl", [](const Shape& s, const float* a, const float* b, float* c) {
                   cblas_sgemm(kRowMajor, kNoTrans, s.nt ? kTrans : kNoTrans, s.M, s.N, s.K, 1.f, a, s.K, b,
                               s.nt ? s.K : s.N, s.nt ? 0.f : 1.f, c, s.N);
                 }});
#endif
#if defined(GEMM_SHAPES_ONEDNN)
  out.push_back({"onednn", [](const Shape& s, const float* a, const float* b, float* c) {
                   dnnl_sgemm('N', s.nt ? 'T' : 'N', s.M, s.N, s.K, 1.f, a, s.K, b, s.nt ? s.K : s.N,
                              s.nt ? 0.f : 1.f, c, s.N);
                 }});
#endif
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  const double slice_s = 0.03;  // each backend's share of a round on one shape
  scipy_openblas_set_num_threads(1);
  // The kernel's shapes (calibrated_attention.h): whole-row blocks of R rows against every key up to 2,048 keys
  // (R = 1 MiB of scores / S_k, at most 256), and past that 512-row units over 128-key tiles.
  const std::vector<Shape> shapes = {
      {"D 32, 512 keys, whole row (MiniLM 8x512)", true, 256, 512, 32},
      {"", false, 256, 32, 512},
      {"D 64, 2,048 keys, whole row (XLM-R 8x2048)", true, 128, 2048, 64},
      {"", false, 128, 64, 2048},
      {"D 64, 128-key tile (XLM-R 1x8192)", true, 512, 128, 64},
      {"", false, 512, 64, 128},
      {"D 128, 128-key tile (Qwen3)", true, 512, 128, 128},
      {"", false, 512, 128, 128},
      {"D 256, 128-key tile (EmbeddingGemma)", true, 512, 128, 256},
      {"", false, 512, 256, 128},
  };
  const std::vector<Backend> libs = backends();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::printf("%-44s %-4s %5s %5s %5s", "shape", "op", "M", "N", "K");
  for (const Backend& b : libs) std::printf(" %10s", b.name);
  for (size_t i = 1; i < libs.size(); ++i) std::printf(" %9s", (std::string(libs[i].name) + "/ob").c_str());
  std::printf("  max rel diff\n");
  const char* last = "";
  for (const Shape& s : shapes) {
    if (*s.what) last = s.what;
    std::vector<float> a(s.M * s.K), b(s.nt ? s.N * s.K : s.K * s.N), c(s.M * s.N), ref(s.M * s.N);
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    // Correctness: each backend once on a zeroed C against OpenBLAS.
    double worst = 0.0;
    std::fill(ref.begin(), ref.end(), 0.f);
    libs[0].run(s, a.data(), b.data(), ref.data());
    for (size_t i = 1; i < libs.size(); ++i) {
      std::fill(c.begin(), c.end(), 0.f);
      libs[i].run(s, a.data(), b.data(), c.data());
      for (size_t j = 0; j < c.size(); ++j)
        worst = std::max(worst, std::fabs(static_cast<double>(c[j]) - ref[j]) / (1.0 + std::fabs(ref[j])));
    }
    // Timing: per round, each backend in turn (the order rotating) for slice_s; the median of its rounds.
    std::vector<std::vector<double>> per_call(libs.size());
    for (int r = 0; r < rounds; ++r) {
      for (size_t o = 0; o < libs.size(); ++o) {
        const size_t i = (o + r) % libs.size();
        int64_t calls = 0;
        const double t0 = now();
        double t = t0;
        while (t - t0 < slice_s) {
          libs[i].run(s, a.data(), b.data(), c.data());
          ++calls;
          if ((calls & 3) == 0) t = now();
        }
        t = now();
        per_call[i].push_back((t - t0) / calls);
      }
    }
    const double flops = 2.0 * s.M * s.N * s.K;
    std::vector<double> gf;
    for (auto& v : per_call) {
      std::sort(v.begin(), v.end());
      gf.push_back(flops / v[v.size() / 2] / 1e9);
    }
    std::printf("%-44s %-4s %5lld %5lld %5lld", last, s.nt ? "NT" : "NN", static_cast<long long>(s.M),
                static_cast<long long>(s.N), static_cast<long long>(s.K));
    for (double g : gf) std::printf(" %10.1f", g);
    for (size_t i = 1; i < gf.size(); ++i) std::printf(" %9.2f", gf[i] / gf[0]);
    std::printf("  %.1e\n", worst);
    last = "";
  }
  std::printf("GFLOP/s per backend, one thread, median of %d interleaved rounds\n", rounds);
  return 0;
}
