// The two single-threaded float32 GEMMs of the CPU calibrated-attention kernel
// (cpu/calibrated_attention.h) and of the projected op's projection (ort/cpu/projected_attention.cc),
// row-major, with leading dimensions:
//
//   gemm_nt:  C[M,N] = alpha * A[M,K] * B[N,K]^T     (scores = scale * Q * K^T)
//   gemm_nn:  C[M,N] = A[M,K] * B[K,N]  (or C +=)   (context = P * V; qkv = bias + x * W)
//
// Why a separate header with three backends: ONNX Runtime's own GEMM (MLAS)
// is not exported from libonnxruntime.so, so a custom op brings its own.  The
// build picks one (plugins/cmake/Gemm.cmake, ATTNCAL_GEMM):
//   * ATTNCAL_GEMM_OPENBLAS: cblas_sgemm of the scipy-openblas32 wheel (its
//     symbols carry a scipy_ prefix), forced to one thread: the kernel already
//     splits its work over ONNX Runtime's intra-op pool, and a second pool
//     inside would oversubscribe the cores and make results depend on timing.
//   * ATTNCAL_GEMM_EIGEN: Eigen's GEMM on mapped row-major blocks (header-only;
//     Eigen is not built with OpenMP here, so it is single-threaded).
//   * neither: the built-in loops below, written so that GCC vectorises the
//     inner loop over the contiguous dimension (AVX-512 / AVX2 clones).
// Every backend is deterministic for a given shape, so the kernel's results do
// not depend on the thread count (each row block is one call, on one thread).
// docs/native-kernels.md gives the measured comparison and why the default is
// what it is.
#ifndef ATTNCAL_CPU_GEMM_H_
#define ATTNCAL_CPU_GEMM_H_

#include <cstdint>

#include "cpu/isa.h"

#if defined(ATTNCAL_GEMM_OPENBLAS)
#include <cblas.h>  // scipy-openblas32: every symbol is scipy_-prefixed
#include <mutex>
#elif defined(ATTNCAL_GEMM_EIGEN)
#include <Eigen/Core>
#endif


namespace attncal {

#if defined(ATTNCAL_GEMM_OPENBLAS)
constexpr const char* kGemmBackend = "openblas";
#elif defined(ATTNCAL_GEMM_EIGEN)
constexpr const char* kGemmBackend = "eigen";
#else
constexpr const char* kGemmBackend = "builtin";
#endif

#if defined(ATTNCAL_GEMM_OPENBLAS)
// OpenBLAS's own thread pool off, once per process (the kernel is already parallel).
inline void gemm_init() {
  static std::once_flag once;
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}
#else
inline void gemm_init() {}
#endif

namespace builtin {

// C[M,N] = alpha * A[M,K] * B[N,K]^T: four rows of A against one row of B at a
// time, the dot products over K in 16 independent lanes (vectorised).
ATTNCAL_ISA_BODY void gemm_nt_isa(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                                  const float* B, int64_t ldb, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    const float* a0 = A + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    for (int64_t j = 0; j < N; ++j) {
      const float* b = B + j * ldb;
      float s0[16] = {}, s1[16] = {}, s2[16] = {}, s3[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        for (int l = 0; l < 16; ++l) {
          const float bv = b[k + l];
          s0[l] += a0[k + l] * bv;
          s1[l] += a1[k + l] * bv;
          s2[l] += a2[k + l] * bv;
          s3[l] += a3[k + l] * bv;
        }
      }
      float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
      for (; k < K; ++k) {
        t0 += a0[k] * b[k];
        t1 += a1[k] * b[k];
        t2 += a2[k] * b[k];
        t3 += a3[k] * b[k];
      }
      for (int l = 0; l < 16; ++l) {
        t0 += s0[l];
        t1 += s1[l];
        t2 += s2[l];
        t3 += s3[l];
      }
      C[i * ldc + j] = alpha * t0;
      C[(i + 1) * ldc + j] = alpha * t1;
      C[(i + 2) * ldc + j] = alpha * t2;
      C[(i + 3) * ldc + j] = alpha * t3;
    }
  }
  for (; i < M; ++i) {
    const float* a = A + i * lda;
    for (int64_t j = 0; j < N; ++j) {
      const float* b = B + j * ldb;
      float s[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) s[l] += a[k + l] * b[k + l];
      float t = 0.f;
      for (; k < K; ++k) t += a[k] * b[k];
      for (int l = 0; l < 16; ++l) t += s[l];
      C[i * ldc + j] = alpha * t;
    }
  }
}
ATTNCAL_ISA_DISPATCH(void, gemm_nt, (int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                                      const float* B, int64_t ldb, float* C, int64_t ldc),
                     (M, N, K, alpha, A, lda, B, ldb, C, ldc))

// C[M,N] = A[M,K] * B[K,N] (C += with accumulate): each row of C is a sum of rows of B scaled by A's
// entries; the inner loop runs over N (contiguous), four rows of C at a time.
ATTNCAL_ISA_BODY void gemm_nn_isa(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                                  const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    float* c0 = C + i * ldc;
    float* c1 = c0 + ldc;
    float* c2 = c1 + ldc;
    float* c3 = c2 + ldc;
    if (!accumulate)
      for (int64_t n = 0; n < N; ++n) c0[n] = c1[n] = c2[n] = c3[n] = 0.f;
    const float* a0 = A + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    for (int64_t k = 0; k < K; ++k) {
      const float* b = B + k * ldb;
      const float x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
      for (int64_t n = 0; n < N; ++n) {
        const float bv = b[n];
        c0[n] += x0 * bv;
        c1[n] += x1 * bv;
        c2[n] += x2 * bv;
        c3[n] += x3 * bv;
      }
    }
  }
  for (; i < M; ++i) {
    float* c = C + i * ldc;
    if (!accumulate)
      for (int64_t n = 0; n < N; ++n) c[n] = 0.f;
    const float* a = A + i * lda;
    for (int64_t k = 0; k < K; ++k) {
      const float* b = B + k * ldb;
      const float x = a[k];
      for (int64_t n = 0; n < N; ++n) c[n] += x * b[n];
    }
  }
}
ATTNCAL_ISA_DISPATCH(void, gemm_nn, (int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                                      int64_t ldb, float* C, int64_t ldc, bool accumulate),
                     (M, N, K, A, lda, B, ldb, C, ldc, accumulate))

}  // namespace builtin

inline void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc) {
#if defined(ATTNCAL_GEMM_OPENBLAS)
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), 0.0f, C,
              static_cast<blasint>(ldc));
#elif defined(ATTNCAL_GEMM_EIGEN)
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  Eigen::Map<const Mat, 0, Stride> a(A, M, K, Stride(lda));
  Eigen::Map<const Mat, 0, Stride> b(B, N, K, Stride(ldb));
  Eigen::Map<Mat, 0, Stride> c(C, M, N, Stride(ldc));
  c.noalias() = alpha * (a * b.transpose());
#else
  builtin::gemm_nt(M, N, K, alpha, A, lda, B, ldb, C, ldc);
#endif
}

// accumulate: C += A * B (C holds e.g. the bias already), which spares a pass over C: OpenBLAS's beta = 0 path
// zeroes C first, and a bias added afterwards is a second pass.
inline void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                    float* C, int64_t ldc, bool accumulate = false) {
#if defined(ATTNCAL_GEMM_OPENBLAS)
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), 1.0f, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb),
              accumulate ? 1.0f : 0.0f, C, static_cast<blasint>(ldc));
#elif defined(ATTNCAL_GEMM_EIGEN)
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  Eigen::Map<const Mat, 0, Stride> a(A, M, K, Stride(lda));
  Eigen::Map<const Mat, 0, Stride> b(B, K, N, Stride(ldb));
  Eigen::Map<Mat, 0, Stride> c(C, M, N, Stride(ldc));
  if (accumulate) {
    c.noalias() += a * b;
  } else {
    c.noalias() = a * b;
  }
#else
  builtin::gemm_nn(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
#endif
}

}  // namespace attncal

#endif  // ATTNCAL_CPU_GEMM_H_
