// The shape and attributes of an uncalibrated self-attention call of the CPU kernel (strength 0: every row runs
// as in an uncalibrated layer), for the programs that drive cpu/calibrated_attention.h directly: the kernel's
// benchmark (attention_kernel.cpp) and its host tests (tests/cpp).  Only fields that every kernel tree the
// benchmark builds against has.
#ifndef ATTNCAL_BENCHMARKS_SELF_ATTENTION_SETUP_H_
#define ATTNCAL_BENCHMARKS_SELF_ATTENTION_SETUP_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/calibrated_attention.h"

namespace attncal_bench {

// B items of S tokens, N query heads of D over N_kv key/value heads, the window's bounds (-1: none).
inline void uncalibrated_self_attention(int64_t B, int64_t S, int64_t N, int64_t N_kv, int64_t D, int64_t window_left,
                                        int64_t window_right, attncal::AttentionShape* sh, AttncalParams* p) {
  *sh = attncal::AttentionShape{};
  sh->B = B;
  sh->S_q = sh->S_k = S;
  sh->N = N;
  sh->N_kv = N_kv;
  sh->D = sh->D_v = D;
  sh->scale = 1.0f / std::sqrt(static_cast<float>(D));
  sh->window_left = window_left;
  sh->window_right = window_right;
  std::memset(p, 0, sizeof *p);
  p->all_rows = 1;
  p->basket_size = 128;
  p->first_mode = ATTNCAL_MODE_ORIGINAL;
  p->skip_short = 1;
  p->num_heads = static_cast<int32_t>(N);
  p->num_kv_heads = static_cast<int32_t>(N_kv);
  p->window_left = static_cast<int32_t>(window_left);
  p->window_right = static_cast<int32_t>(window_right);
}

}  // namespace attncal_bench

#endif  // ATTNCAL_BENCHMARKS_SELF_ATTENTION_SETUP_H_
