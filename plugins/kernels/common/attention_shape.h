// The shapes of one calibrated attention call, shared by the CPU kernel, the ORT shape checks and
// the CUDA ops (so that they need not include the CPU kernel).
#ifndef ATTNCAL_ATTENTION_SHAPE_H_
#define ATTNCAL_ATTENTION_SHAPE_H_

#include <cstdint>

namespace attncal {

// query [B,S_q,N*D], key [B,S_k,N_kv*D], value [B,S_k,N_kv*D_v] (BSNH stored as BSD, ONNX Runtime
// MultiHeadAttention's unpacked layout), mask int64 [B,S_k], context [B,S_q,N*D_v].
struct AttentionShape {
  int64_t B = 0, S_q = 0, S_k = 0, N = 0, D = 0, D_v = 0;
  int64_t N_kv = 0;  // key/value heads (divides N); 0 = N.  Query head h reads key/value head h / (N / N_kv).
  float scale = 0.f;  // resolved: never 0
  // Row strides of query, key and value (0: unpacked, N*D, N_kv*D and N_kv*D_v); a packed [B,S,3*N*D]
  // tensor (Q|K|V per token, as ONNX Runtime's Attention projects it) is read with 3*N*D for all three.
  int64_t ld_q = 0, ld_k = 0, ld_v = 0;
  // The window: query q sees key k when q - window_left <= k <= q + window_right (-1 = no bound; needs
  // S_q == S_k).
  int64_t window_left = -1, window_right = -1;

  int64_t kv_heads() const { return N_kv ? N_kv : N; }
  int64_t kv_head(int64_t h) const { return h / (N / kv_heads()); }
  bool windowed() const { return window_left >= 0 || window_right >= 0; }
};

}  // namespace attncal

#endif  // ATTNCAL_ATTENTION_SHAPE_H_
