// Checks of the SIMT runtime and its PTX models alone, run by tests/simt/test_simt_runtime.py: each
// `runtime_test <name>` runs one small kernel written as CUDA source and prints what it found; the kernels
// that must fail print the launch's error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

int report(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    std::printf("%s: launch failed: %s\n", what, cudaGetErrorString(e));
    return 1;
  }
  std::printf("%s: launch ok\n", what);
  return 0;
}

// ---- the models alone: ldmatrix against the ISA's fragment rule, mma against a naive GEMM
__global__ void ldmatrix_kernel(const uint16_t* src, uint32_t* out, int trans) {
  ATTNCAL_DYNAMIC_SHARED(uint16_t, sm);
  const int lane = threadIdx.x;
  // four 8x8 matrices, matrix i's row r at sm + (i * 8 + r) * 24 (rows 48 bytes apart, 16-byte aligned)
  for (int i = lane; i < 32 * 24; i += 32) sm[i] = src[i];
  __syncwarp();
  const uint16_t* row = sm + ((lane / 8) * 8 + lane % 8) * 24;
  uint32_t r0, r1, r2, r3;
  simt::ptx::ldmatrix_m8n8_x4_b16(r0, r1, r2, r3, static_cast<uint32_t>(__cvta_generic_to_shared(row)), trans != 0,
                                  simt::Loc::current());
  out[lane * 4 + 0] = r0;
  out[lane * 4 + 1] = r1;
  out[lane * 4 + 2] = r2;
  out[lane * 4 + 3] = r3;
}

int check_ldmatrix(bool trans) {
  std::vector<uint16_t> src(32 * 24);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i * 7 + 3);
  std::vector<uint32_t> out(32 * 4);
  ATTNCAL_LAUNCH(ldmatrix_kernel, 1, 32, 32 * 24 * 2, nullptr)(src.data(), out.data(), trans ? 1 : 0);
  if (report(trans ? "ldmatrix.x4.trans" : "ldmatrix.x4")) return 1;
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int m = 0; m < 4; ++m) {
      // naive: element (r, c) of matrix m is src[(m*8 + r)*24 + c]; thread t holds (t/4, 2(t%4)+j), or
      // transposed (2(t%4)+j, t/4)
      uint16_t want[2];
      for (int j = 0; j < 2; ++j) {
        const int r = trans ? 2 * (lane % 4) + j : lane / 4, c = trans ? lane / 4 : 2 * (lane % 4) + j;
        want[j] = src[(m * 8 + r) * 24 + c];
      }
      const uint32_t w = want[0] | (static_cast<uint32_t>(want[1]) << 16);
      bad += out[lane * 4 + m] != w;
    }
  }
  std::printf("ldmatrix%s: %d of 128 registers differ from the naive copy\n", trans ? " trans" : "", bad);
  return bad != 0;
}

// D = A*B + C on one warp, fragments filled from A (16x16 row major) and B (16x8) by the ISA's tables,
// against a naive GEMM in double.
template <typename H>
__global__ void mma_kernel(const float* A, const float* B, const float* C, float* D, int bf16) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane % 4;
  auto bits = [&](float v) -> uint32_t {
    if (bf16) return __float2bfloat16_rn(v).__x;
    return __float2half_rn(v).__x;
  };
  auto pack = [&](float lo, float hi) { return bits(lo) | (bits(hi) << 16); };
  uint32_t a[4], b[2];
  a[0] = pack(A[g * 16 + 2 * t], A[g * 16 + 2 * t + 1]);
  a[1] = pack(A[(g + 8) * 16 + 2 * t], A[(g + 8) * 16 + 2 * t + 1]);
  a[2] = pack(A[g * 16 + 2 * t + 8], A[g * 16 + 2 * t + 9]);
  a[3] = pack(A[(g + 8) * 16 + 2 * t + 8], A[(g + 8) * 16 + 2 * t + 9]);
  b[0] = pack(B[(2 * t) * 8 + g], B[(2 * t + 1) * 8 + g]);
  b[1] = pack(B[(2 * t + 8) * 8 + g], B[(2 * t + 9) * 8 + g]);
  float c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  simt::ptx::mma_m16n8k16_row_col_f32(c, a, b, c, bf16 != 0, simt::Loc::current());
  D[g * 8 + 2 * t] = c[0];
  D[g * 8 + 2 * t + 1] = c[1];
  D[(g + 8) * 8 + 2 * t] = c[2];
  D[(g + 8) * 8 + 2 * t + 1] = c[3];
}

int check_mma(bool bf16) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<float> A(256), B(128), C(128), D(128);
  for (float& x : A) x = d(gen) / 4.0f;  // exact in both 16-bit types
  for (float& x : B) x = d(gen) / 4.0f;
  for (float& x : C) x = d(gen) / 2.0f;
  ATTNCAL_LAUNCH(mma_kernel<int>, 1, 32, 0, nullptr)(A.data(), B.data(), C.data(), D.data(), bf16 ? 1 : 0);
  if (report(bf16 ? "mma bf16" : "mma f16")) return 1;
  double worst = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double s = C[i * 8 + j];
      for (int k = 0; k < 16; ++k) s += static_cast<double>(A[i * 16 + k]) * B[k * 8 + j];
      worst = std::fmax(worst, std::fabs(s - D[i * 8 + j]));
    }
  std::printf("mma %s: max |D - naive GEMM| = %g\n", bf16 ? "bf16" : "f16", worst);
  return worst != 0;
}

// ldmatrix feeding mma, as the attention kernel does: A by ldmatrix.x4, B (stored [n][k]) by ldmatrix.x4 and
// (stored [k][n]) by ldmatrix.x4.trans; both products against the naive GEMM.
__global__ void ldmatrix_mma_kernel(const uint16_t* A, const uint16_t* Bnk, const uint16_t* Bkn, float* D) {
  ATTNCAL_DYNAMIC_SHARED(uint16_t, sm);
  uint16_t* sa = sm;              // 16 x 16, row stride 24
  uint16_t* sb = sm + 16 * 24;    // [n 8 (padded to 16)][k 16], stride 24
  uint16_t* sbt = sm + 32 * 24;   // [k 16][n 8 (padded to 16)], stride 24
  const int lane = threadIdx.x, m = lane >> 3;
  for (int i = lane; i < 16 * 24; i += 32) {
    const int r = i / 24, c = i % 24;
    sa[i] = c < 16 ? A[r * 16 + c] : 0;
    sb[i] = (r < 8 && c < 16) ? Bnk[r * 16 + c] : 0;
    sbt[i] = c < 8 ? Bkn[r * 8 + c] : 0;
  }
  __syncwarp();
  uint32_t a[4], bnk[4], bkn[4];
  // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15): a0..a3 of the mma
  const uint16_t* pa = sa + ((m & 1) * 8 + (lane & 7)) * 24 + (m >> 1) * 8;
  simt::ptx::ldmatrix_m8n8_x4_b16(a[0], a[1], a[2], a[3], static_cast<uint32_t>(__cvta_generic_to_shared(pa)), false,
                                  simt::Loc::current());
  // B as [n][k]: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (unused n 8-15 ...)
  const uint16_t* pb = sb + ((m >> 1) * 8 + (lane & 7)) * 24 + (m & 1) * 8;
  simt::ptx::ldmatrix_m8n8_x4_b16(bnk[0], bnk[1], bnk[2], bnk[3],
                                  static_cast<uint32_t>(__cvta_generic_to_shared(pb)), false, simt::Loc::current());
  // B as [k][n], transposed: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), ...
  const uint16_t* pt = sbt + ((m & 1) * 8 + (lane & 7)) * 24 + (m >> 1) * 8;
  simt::ptx::ldmatrix_m8n8_x4_b16(bkn[0], bkn[1], bkn[2], bkn[3],
                                  static_cast<uint32_t>(__cvta_generic_to_shared(pt)), true, simt::Loc::current());
  float c1[4] = {0, 0, 0, 0}, c2[4] = {0, 0, 0, 0};
  const uint32_t b1[2] = {bnk[0], bnk[1]}, b2[2] = {bkn[0], bkn[1]};
  simt::ptx::mma_m16n8k16_row_col_f32(c1, a, b1, c1, false, simt::Loc::current());
  simt::ptx::mma_m16n8k16_row_col_f32(c2, a, b2, c2, false, simt::Loc::current());
  const int g = lane >> 2, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = i < 2 ? g : g + 8, c = 2 * t + (i & 1);
    D[r * 8 + c] = c1[i];
    D[128 + r * 8 + c] = c2[i];
  }
}

int check_ldmatrix_mma() {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<float> A(256), B(128);
  std::vector<uint16_t> ha(256), hbnk(128), hbkn(128);
  for (int i = 0; i < 256; ++i) {
    A[i] = d(gen) / 4.0f;
    ha[i] = __float2half_rn(A[i]).__x;
  }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      B[k * 8 + n] = d(gen) / 4.0f;
      hbkn[k * 8 + n] = hbnk[n * 16 + k] = __float2half_rn(B[k * 8 + n]).__x;
    }
  std::vector<float> D(256);
  ATTNCAL_LAUNCH(ldmatrix_mma_kernel, 1, 32, 48 * 24 * 2, nullptr)(ha.data(), hbnk.data(), hbkn.data(), D.data());
  if (report("ldmatrix + mma")) return 1;
  double worst = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double s = 0;
      for (int k = 0; k < 16; ++k) s += static_cast<double>(A[i * 16 + k]) * B[k * 8 + j];
      worst = std::fmax(worst, std::fmax(std::fabs(s - D[i * 8 + j]), std::fabs(s - D[128 + i * 8 + j])));
    }
  std::printf("ldmatrix + mma: max |D - naive GEMM| = %g (B by ldmatrix and by ldmatrix.trans)\n", worst);
  return worst != 0;
}

// cp.async: nothing lands before the wait that covers its group; src-size < 16 zero-fills.
__global__ void cp_async_kernel(const float* src, float* out) {
  ATTNCAL_DYNAMIC_SHARED(float, sm);
  const int t = threadIdx.x;  // one thread
  (void)t;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  simt::ptx::cp_async_cg_shared_global(base, src, 16, 16, simt::Loc::current());
  simt::ptx::cp_async_commit_group(simt::Loc::current());
  simt::ptx::cp_async_cg_shared_global(base + 16, src + 4, 16, 8, simt::Loc::current());
  simt::ptx::cp_async_commit_group(simt::Loc::current());
  out[0] = sm[0];  // before any wait: the poison
  simt::ptx::cp_async_wait_group(1, simt::Loc::current());
  out[1] = sm[0];  // group 0 done
  out[2] = sm[4];  // group 1 still pending
  simt::ptx::cp_async_wait_group(0, simt::Loc::current());
  out[3] = sm[4];
  out[4] = sm[5];
  out[5] = sm[6];  // zero-filled
  out[6] = sm[7];
}

int check_cp_async() {
  const float src[8] __attribute__((aligned(16))) = {1, 2, 3, 4, 5, 6, 7, 8};
  float out[7];
  ATTNCAL_LAUNCH(cp_async_kernel, 1, 1, 32, nullptr)(src, out);
  if (report("cp.async")) return 1;
  const bool ok = std::isnan(out[0]) && out[1] == 1 && std::isnan(out[2]) && out[3] == 5 && out[4] == 6 &&
                  out[5] == 0 && out[6] == 0;
  std::printf("cp.async: before wait %g, after wait_group 1: %g and %g (pending), after wait_group 0: %g %g %g %g: %s\n",
              out[0], out[1], out[2], out[3], out[4], out[5], out[6], ok ? "as the ISA says" : "WRONG");
  return !ok;
}

// ---- shuffles, atomics
__global__ void shuffle_kernel(int* out, long long* mn) {
  __shared__ unsigned s_count;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  const int x = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  const int d = __shfl_down_sync(0xffffffffu, lane * 10, 3);
  const int s = __shfl_sync(0xffffffffu, lane * 10, 7);
  out[threadIdx.x * 3 + 0] = x;
  out[threadIdx.x * 3 + 1] = d;
  out[threadIdx.x * 3 + 2] = s;
  atomicAdd(&s_count, 1u);
  atomicMin(mn, static_cast<long long>(1000 - threadIdx.x));
  atomicMax(mn + 1, static_cast<long long>(threadIdx.x));
  __syncthreads();
  if (threadIdx.x == 0) out[3 * blockDim.x] = static_cast<int>(s_count);
}

int check_shuffles() {
  const int n = 96;
  std::vector<int> out(3 * n + 1);
  long long mn[2] = {1 << 20, -1};
  ATTNCAL_LAUNCH(shuffle_kernel, 1, n, 0, nullptr)(out.data(), mn);
  if (report("shuffles")) return 1;
  int bad = 0;
  for (int t = 0; t < n; ++t) {
    const int lane = t & 31;
    bad += out[t * 3] != (lane ^ 5) * 10;
    bad += out[t * 3 + 1] != (lane + 3 < 32 ? lane + 3 : lane) * 10;
    bad += out[t * 3 + 2] != 70;
  }
  bad += out[3 * n] != n;
  bad += mn[0] != 1000 - (n - 1) || mn[1] != n - 1;
  std::printf("shuffles and atomics: %d wrong\n", bad);
  return bad != 0;
}

// ---- errors the runtime must report
__global__ void divergent_kernel() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}
__global__ void exit_kernel() {
  if (threadIdx.x >= 32) return;
  __syncthreads();
}
__global__ void deadlock_kernel() {
  if ((threadIdx.x & 31) == 0) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}
__global__ void mask_kernel(int* out) {
  // lanes 0-15 read lane + 16, which their mask 0x0000ffff leaves out
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 16);
}
__global__ void lane_not_in_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 1);
}
__global__ void oob_kernel(float* out) {
  ATTNCAL_DYNAMIC_SHARED(float, sm);
  sm[threadIdx.x] = 1.f;  // 33 threads, 32 floats
  __syncthreads();
  out[0] = sm[0];
}
__global__ void oob_read_kernel(float* out) {
  ATTNCAL_DYNAMIC_SHARED(float, sm);
  sm[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = sm[threadIdx.x + 1];  // thread 31 reads one past the end
}

__global__ void static_oob_kernel(float* out) {
  __shared__ float s_row[32];
  s_row[threadIdx.x] = 1.f;  // 33 threads, 32 floats
  __syncthreads();
  out[0] = s_row[0];
}

// ---- float16 / bfloat16 conversions of a spread of float bit patterns, written for the test to compare
int dump_conversions(const char* path) {
  FILE* f = std::fopen(path, "wb");
  if (!f) return 1;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const uint32_t bits = static_cast<uint32_t>(u);
    float x;
    std::memcpy(&x, &bits, 4);
    const uint16_t h = __float2half_rn(x).__x, b = __float2bfloat16_rn(x).__x;
    const float back_h = __half2float(__half{h}), back_b = __bfloat162float(__nv_bfloat16{b});
    std::fwrite(&bits, 4, 1, f);
    std::fwrite(&h, 2, 1, f);
    std::fwrite(&b, 2, 1, f);
    std::fwrite(&back_h, 4, 1, f);
    std::fwrite(&back_b, 4, 1, f);
  }
  std::fclose(f);
  std::printf("conversions written\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string what = argv[1];
  std::vector<int> buf(64);
  std::vector<float> fbuf(64);
  if (what == "ldmatrix") return check_ldmatrix(false) | check_ldmatrix(true);
  if (what == "mma") return check_mma(false) | check_mma(true);
  if (what == "ldmatrix_mma") return check_ldmatrix_mma();
  if (what == "cp_async") return check_cp_async();
  if (what == "shuffles") return check_shuffles();
  if (what == "conversions") return dump_conversions(argv[2]);
  if (what == "divergent") ATTNCAL_LAUNCH(divergent_kernel, 1, 64, 0, nullptr)();
  if (what == "exit") ATTNCAL_LAUNCH(exit_kernel, 1, 64, 0, nullptr)();
  if (what == "deadlock") ATTNCAL_LAUNCH(deadlock_kernel, 1, 64, 0, nullptr)();
  if (what == "mask") ATTNCAL_LAUNCH(mask_kernel, 1, 32, 0, nullptr)(buf.data());
  if (what == "lane_not_in_mask") ATTNCAL_LAUNCH(lane_not_in_mask_kernel, 1, 32, 0, nullptr)(buf.data());
  if (what == "oob_write") ATTNCAL_LAUNCH(oob_kernel, 1, 33, 32 * 4, nullptr)(fbuf.data());
  if (what == "oob_read") ATTNCAL_LAUNCH(oob_read_kernel, 1, 32, 32 * 4, nullptr)(fbuf.data());
  if (what == "static_oob") ATTNCAL_LAUNCH(static_oob_kernel, 1, 33, 0, nullptr)(fbuf.data());
  return report(what.c_str());
}
