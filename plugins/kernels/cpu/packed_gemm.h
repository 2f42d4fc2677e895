// Y[M, c0:c0+n] = X[M,K] * W[K, c0:c0+n] + bias[c0:c0+n] with W packed once: the Q/K/V projection of the
// projected calibrated-attention op (plugins/ort/cpu/projected_attention.cc), whose weight is a constant
// initializer.  Also Y (+)= X * W without a bias (packed_gemm): the attention kernel's context += P * V over
// a key tile (cpu/calibrated_attention.h), with the tile of V packed per call.
//
// Why not the GEMM library of cpu/gemm.h: cblas_sgemm repacks its B operand (here the whole [K, 3*hidden]
// weight) on every call, and OpenBLAS has no pack-once API (its cblas.h declares no sgemm_pack).  At a
// one-text request the repacking is a large share of the GEMM's time, while ONNX Runtime's own Attention
// prepacks its weight (MLAS).  Packed once, the weight is read in panels laid out for the micro-kernel
// below.  The op uses it below 256 rows only, where it wins at the model level (see docs/native-kernels.md
// for the comparison).
//
// Layout: panels of kNr columns (32 with AVX-512, 16 with AVX2), each [K][kNr], zero-padded past N.
// The micro-kernel keeps an MR x kNr block of Y in registers (8 x 2 zmm or 6 x 2 ymm accumulators) and
// runs over K in blocks, so every element of Y is one fixed sequence of operations (per block of k a chain of
// fused multiply-adds, added onto the sum so far), whatever M is: results do not depend on how rows or panels
// are split over threads, and a row computed alone equals the same row computed among others.
//
// Every instruction-set path (cpu/isa.h) has a micro-kernel: AVX-512 (panels of 32), AVX2 (panels of 16), and the
// default path's (panels of 16, 2 x 4 four-float vectors: baseline x86-64's SSE registers, or the build target's
// elsewhere), so the attention kernel's rows come out the same whatever the rows of a call on every CPU.
#ifndef ATTNCAL_CPU_PACKED_GEMM_H_
#define ATTNCAL_CPU_PACKED_GEMM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/isa.h"

namespace attncal {

// A weight packed for packed_gemm_bias; empty (packed() false) where this machine has no kernel for it.
class PackedWeight {
 public:
  // Packs w [k, n] (row-major, leading dimension ldw) for the kernel of the active instruction-set path
  // (cpu/isa.h), or in panels of panel_width 16 (AVX2 or default) or 32 (AVX-512) when given and the path allows
  // it (AVX-512 runs both).  False, leaving it empty, when the path has no such kernel.  A packed weight is run by
  // the kernel of its panel width on the path active when it runs: 32 by AVX-512's, 16 by AVX2's or the default
  // path's.  The storage is kept from one Pack to the next (the attention kernel packs per tile).
  bool Pack(const float* w, int64_t k, int64_t n, int64_t ldw, int64_t panel_width = 0);
  // Packs b^T for b [n, k] (row-major, leading dimension ldb): the keys of an attention tile, so that
  // packed_gemm gives Q * K^T.  Same panels and same refusals as Pack.
  bool PackTransposed(const float* b, int64_t n, int64_t k, int64_t ldb, int64_t panel_width = 0);
  // Packs into `storage` (at least StorageFloats(k, n) floats, owned by the caller) from then on instead of the
  // object's own vector: the attention kernel's per-call store of packed key tiles, which every unit reads.
  void UseStorage(float* storage) { storage_ = storage; }
  // Floats that k x n takes in panels of any width this header packs.
  static int64_t StorageFloats(int64_t k, int64_t n) { return (n + 31) / 32 * 32 * k; }
  bool packed() const { return nr_ != 0; }
  bool Matches(int64_t k, int64_t n) const { return packed() && k == k_ && n == n_; }
  int64_t panel_width() const { return nr_; }
  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  const float* panel(int64_t p) const { return data() + p * k_ * nr_; }
  bool avx512() const { return nr_ == 32; }

 private:
  // Sizes the storage for k x n in panels of this CPU's widest kernel (or of panel_width); false, leaving it
  // empty, when there is no such kernel.
  bool Reserve(int64_t k, int64_t n, int64_t panel_width);
  float* data() { return storage_ != nullptr ? storage_ : data_.data(); }
  const float* data() const { return storage_ != nullptr ? storage_ : data_.data(); }

  int64_t k_ = 0, n_ = 0, nr_ = 0;
  std::vector<float> data_;
  float* storage_ = nullptr;  // UseStorage's, or null: data_
};

namespace packed {

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

// One MR x (NV vectors) block of Y over one block of k: rows x[0..MR), the panel's columns, a chain of K fused
// multiply-adds from 0 per element, added onto the partial sum stored in y unless this is the first block of
// k, and the bias (where there is one) added after the last block.  Blocked summation: no chain is longer
// than one block of k, so a long sum rounds as a sum of block sums (as OpenBLAS's does), not as one chain.
template <typename V, int MR, int NV>
inline __attribute__((always_inline)) void Micro(int64_t K, const float* x, int64_t ldx, const float* panel,
                                                 const float* bias, float* y, int64_t ldy, int64_t ncols,
                                                 bool first, bool last) {
  constexpr int L = sizeof(V) / sizeof(float), NR = L * NV;
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&b[j], panel + k * NR + j * L, sizeof(V));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float a = x[i * ldx + k];
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc[i][j] += b[j] * a;
    }
  }
  const bool add_bias = last && bias != nullptr;
  if (ncols == NR) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) {
      bv[j] = V{};
      if (add_bias) __builtin_memcpy(&bv[j], bias + j * L, sizeof(V));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) {
        V out = acc[i][j];
        if (!first) {
          V sum;
          __builtin_memcpy(&sum, y + i * ldy + j * L, sizeof(V));
          out = sum + out;
        }
        out += bv[j];
        __builtin_memcpy(y + i * ldy + j * L, &out, sizeof(V));
      }
    return;
  }
  for (int i = 0; i < MR; ++i) {  // the last panel, cut short by N
    float row[NR];
    for (int j = 0; j < NV; ++j) __builtin_memcpy(row + j * L, &acc[i][j], sizeof(V));
    for (int64_t n = 0; n < ncols; ++n) {
      const float out = first ? row[n] : y[i * ldy + n] + row[n];
      y[i * ldy + n] = add_bias ? out + bias[n] : out;
    }
  }
}

// The last M % MR rows: the micro-kernel with exactly that many rows (no reads past X's end).
template <typename V, int MR, int NV>
inline __attribute__((always_inline)) void Tail(int64_t r, int64_t K, const float* x, int64_t ldx,
                                                const float* panel, const float* bias, float* y, int64_t ldy,
                                                int64_t ncols, bool first, bool last) {
  if constexpr (MR >= 1) {
    if (r == MR) {
      Micro<V, MR, NV>(K, x, ldx, panel, bias, y, ldy, ncols, first, last);
    } else {
      Tail<V, MR - 1, NV>(r, K, x, ldx, panel, bias, y, ldy, ncols, first, last);
    }
  }
}

// Rows in blocks of kRowBlock, k in blocks of kKBlock: a panel's block of k (192 x 32 floats, 24 KiB) stays in
// the 48 KiB L1 while every row group of the row block passes over it, so each panel block is loaded from L2
// once per row block rather than once per row group (the measurements, and the choice of 256-row blocks:
// see docs/native-kernels.md).
template <typename V, int MR, int NV>
inline __attribute__((always_inline)) void Run(const PackedWeight& w, int64_t M, const float* x, int64_t ldx,
                                               const float* bias, int64_t p0, int64_t p1, float* y, int64_t ldy,
                                               bool accumulate, int64_t kb, int64_t ke) {
  constexpr int64_t kRowBlock = 256, kKBlock = 192;
  constexpr int64_t NR = static_cast<int64_t>(sizeof(V) / sizeof(float)) * NV;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, nc = std::min(NR, w.n() - n0);
      for (int64_t k0 = kb; k0 < ke; k0 += kKBlock) {
        const int64_t kc = std::min(kKBlock, ke - k0);
        const bool first = k0 == kb && !accumulate, last = k0 + kc >= ke;
        const float* panel = w.panel(p) + k0 * NR;
        const float* b = bias != nullptr ? bias + n0 : nullptr;  // (null + n0 would let GCC assume bias non-null)
        int64_t m = m0;
        for (; m + MR <= m1; m += MR)
          Micro<V, MR, NV>(kc, x + m * ldx + k0, ldx, panel, b, y + m * ldy + n0, ldy, nc, first, last);
        if (m < m1)
          Tail<V, MR - 1, NV>(m1 - m, kc, x + m * ldx + k0, ldx, panel, b, y + m * ldy + n0, ldy, nc, first,
                              last);
      }
    }
  }
}

#if ATTNCAL_ISA_PATHS
__attribute__((target("avx512f,fma"))) inline void RunAvx512(const PackedWeight& w, int64_t M, const float* x,
                                                         int64_t ldx, const float* bias, int64_t p0, int64_t p1,
                                                         float* y, int64_t ldy, bool accumulate, int64_t kb,
                                                         int64_t ke) {
  Run<V16, 8, 2>(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
}

__attribute__((target("avx2,fma"))) inline void RunAvx2(const PackedWeight& w, int64_t M, const float* x,
                                                        int64_t ldx, const float* bias, int64_t p0, int64_t p1,
                                                        float* y, int64_t ldy, bool accumulate, int64_t kb,
                                                        int64_t ke) {
  Run<V8, 6, 2>(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
}
#endif

// The default path's: 2 rows x 16 columns in 8 four-float accumulators, which baseline x86-64's 16 SSE registers
// hold with the panel row and the broadcast operand (a multiply, then an add: no FMA there).
inline void RunDefault(const PackedWeight& w, int64_t M, const float* x, int64_t ldx, const float* bias, int64_t p0,
                       int64_t p1, float* y, int64_t ldy, bool accumulate, int64_t kb, int64_t ke) {
  Run<V4, 2, 4>(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
}

// The kernel for w's panel width on the active path (see PackedWeight::Pack).
inline void RunPacked(const PackedWeight& w, int64_t M, const float* x, int64_t ldx, const float* bias, int64_t p0,
                      int64_t p1, float* y, int64_t ldy, bool accumulate, int64_t kb, int64_t ke) {
#if ATTNCAL_ISA_PATHS
  if (w.avx512()) return RunAvx512(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
  if (isa_path() != IsaPath::kDefault) return RunAvx2(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
#endif
  RunDefault(w, M, x, ldx, bias, p0, p1, y, ldy, accumulate, kb, ke);
}

// dst[kk * nr + j] = b[j * ldb + kk] for keys j < nc and kk < k: one panel of an attention tile's keys,
// transposed in blocks of 8 x 8 (three rounds of shuffles) with the edges element by element.  An element loop
// stores one float at a time, a panel row apart, which was a large part of a tile's packing (the measurement:
// docs/native-kernels.md).
ATTNCAL_ISA_BODY void TransposePanel_isa(const float* b, int64_t nc, int64_t k, int64_t ldb, float* dst, int64_t nr) {
  int64_t j0 = 0;
  for (; j0 + 8 <= nc; j0 += 8) {
    int64_t k0 = 0;
    for (; k0 + 8 <= k; k0 += 8) {
      V8 r[8], s[8], t[8];
      for (int i = 0; i < 8; ++i) __builtin_memcpy(&r[i], b + (j0 + i) * ldb + k0, sizeof(V8));
      for (int i = 0; i < 8; i += 2) {  // rows i, i+1 interleaved: even and odd columns
        s[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 2, 10, 4, 12, 6, 14);
        s[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
      }
      for (int i = 0; i < 8; i += 4)  // four rows per column pair: columns c, c+4 of rows i..i+3
        for (int c = 0; c < 2; ++c) {
          t[i + c] = __builtin_shufflevector(s[i + c], s[i + c + 2], 0, 1, 8, 9, 4, 5, 12, 13);
          t[i + c + 2] = __builtin_shufflevector(s[i + c], s[i + c + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
      for (int c = 0; c < 4; ++c) {  // rows 0..3 with rows 4..7: columns c and c+4 whole
        const V8 lo = __builtin_shufflevector(t[c], t[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        const V8 hi = __builtin_shufflevector(t[c], t[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        __builtin_memcpy(dst + (k0 + c) * nr + j0, &lo, sizeof(V8));
        __builtin_memcpy(dst + (k0 + c + 4) * nr + j0, &hi, sizeof(V8));
      }
    }
    for (; k0 < k; ++k0)
      for (int64_t i = 0; i < 8; ++i) dst[k0 * nr + j0 + i] = b[(j0 + i) * ldb + k0];
  }
  for (; j0 < nc; ++j0)
    for (int64_t kk = 0; kk < k; ++kk) dst[kk * nr + j0] = b[j0 * ldb + kk];
}
ATTNCAL_ISA_DISPATCH(void, TransposePanel, (const float* b, int64_t nc, int64_t k, int64_t ldb, float* dst, int64_t nr),
                     (b, nc, k, ldb, dst, nr))

}  // namespace packed

inline bool PackedWeight::Reserve(int64_t k, int64_t n, int64_t panel_width) {
  int64_t nr = 0;
  if ((panel_width == 0 || panel_width == 32) && isa_path() == IsaPath::kAvx512) {
    nr = 32;
  } else if (panel_width == 0 || panel_width == 16) {
    nr = 16;
  }
  k_ = n_ = nr_ = 0;
  if (nr == 0 || k <= 0 || n <= 0) return false;
  const int64_t panels = (n + nr - 1) / nr;
  if (storage_ == nullptr) data_.resize(static_cast<size_t>(panels * k * nr));
  k_ = k;
  n_ = n;
  nr_ = nr;
  return true;
}

inline bool PackedWeight::Pack(const float* w, int64_t k, int64_t n, int64_t ldw, int64_t panel_width) {
  if (!Reserve(k, n, panel_width)) return false;
  for (int64_t n0 = 0; n0 < n; n0 += nr_) {
    const int64_t nc = std::min(nr_, n - n0);
    float* dst = data() + n0 * k;
    for (int64_t kk = 0; kk < k; ++kk) {
      std::copy(w + kk * ldw + n0, w + kk * ldw + n0 + nc, dst + kk * nr_);
      std::fill(dst + kk * nr_ + nc, dst + (kk + 1) * nr_, 0.f);  // the last panel's columns past n
    }
  }
  return true;
}

inline bool PackedWeight::PackTransposed(const float* b, int64_t n, int64_t k, int64_t ldb, int64_t panel_width) {
  if (!Reserve(k, n, panel_width)) return false;
  for (int64_t n0 = 0; n0 < n; n0 += nr_) {
    const int64_t nc = std::min(nr_, n - n0);
    float* dst = data() + n0 * k;
    if (nc < nr_) std::fill(dst, dst + k * nr_, 0.f);  // the last panel's columns past n
    packed::TransposePanel(b + n0 * ldb, nc, k, ldb, dst, nr_);
  }
  return true;
}

// y[:, p0*nr : p1*nr] (clipped to N) = x * W + bias for panels [p0, p1): columns split only at panel edges.
inline void packed_gemm_bias(const PackedWeight& w, int64_t M, const float* x, int64_t ldx, const float* bias,
                             int64_t p0, int64_t p1, float* y, int64_t ldy) {
  packed::RunPacked(w, M, x, ldx, bias, p0, p1, y, ldy, false, 0, w.k());
}

// y = x * W, or y += x * W with accumulate (the product's block sums added onto y), all columns; or over W's
// rows [kb, ke) only (x's columns [kb, ke); x still points at column 0): what a row of an attention tile
// sees of it.  Blocks of k start at kb.
inline void packed_gemm(const PackedWeight& w, int64_t M, const float* x, int64_t ldx, float* y, int64_t ldy,
                        bool accumulate, int64_t kb = 0, int64_t ke = -1) {
  const int64_t panels = (w.n() + w.panel_width() - 1) / w.panel_width();
  if (ke < 0) ke = w.k();
  packed::RunPacked(w, M, x, ldx, nullptr, 0, panels, y, ldy, accumulate, kb, ke);
}


}  // namespace attncal

#endif  // ATTNCAL_CPU_PACKED_GEMM_H_
