// The shapes of one calibrated attention call, shared by the CPU kernel, the ORT shape checks and
// the CUDA ops (so that they need not include the CPU kernel).
#ifndef ATTNCAL_ATTENTION_SHAPE_H_
#define ATTNCAL_ATTENTION_SHAPE_H_

#include <cstdint>

namespace attncal {

// query [B,S_q,N*D], key [B,S_k,N*D], value [B,S_k,N*D_v] (BSNH stored as BSD, ONNX Runtime
// MultiHeadAttention's unpacked layout), mask int64 [B,S_k], context [B,S_q,N*D_v].
struct AttentionShape {
  int64_t B = 0, S_q = 0, S_k = 0, N = 0, D = 0, D_v = 0;
  float scale = 0.f;  // resolved: never 0
  // Row strides of query, key and value (0: unpacked, N*D, N*D and N*D_v); a packed [B,S,3*N*D] tensor
  // (Q|K|V per token, as ONNX Runtime's Attention projects it) is read with 3*N*D for all three.
  int64_t ld_q = 0, ld_k = 0, ld_v = 0;
};

}  // namespace attncal

#endif  // ATTNCAL_ATTENTION_SHAPE_H_
