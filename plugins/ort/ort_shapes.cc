// The shapes of the ai.attncal ops in ONNX Runtime: the run-time checks against the contract
// (attncal/graphs/contract.py; a mismatch is an InvalidArgument status, never a crash), and the output
// shape inference that ORT's planner reads, symbolic dims included: it is what lets ORT reuse the
// calibration ops' input buffer for their output (the in-place map below).
#include <cstdint>
#include <string>
#include <vector>

#include "common/attncal_attribute_parser.h"  // attr_name, for messages
#include "common/relative_position.h"
#include "ort_common.h"

namespace attncal_ort {

namespace {

// Output 0 may reuse input 0 (probs): the op rewrites rows of the attention
// probabilities, so in place saves a [B,H,Q,K] buffer and, for the pooled
// op, all but B*H rows of traffic.  ORT frees the arrays with ReleaseMayInplace.
size_t ORT_API_CALL MayInplace(int** input_index, int** output_index) {
  *input_index = new int[1]{0};
  *output_index = new int[1]{0};
  return 1;
}

void ORT_API_CALL ReleaseMayInplace(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

// Output 0 has probs' type and shape (symbolic dims included).  Known output
// shapes are what lets ORT's planner reuse the probs buffer: GetMayInplace
// needs equal sizes.  Written against the C API because the C++ helper
// (ShapeInferContext::SetOutputShape) drops symbolic dims in ORT 1.32.  A rank
// other than 4 is left to Compute, which reports it.
//
// An unknown dim without a name (common inside exported graphs, e.g. the
// [B,H,1,K] scores that row placement builds with Expand/GatherElements)
// reaches us as -1 with an empty symbolic name, and SetOutputTypeShape would
// write it back as the *known* value -1: downstream inference then folds
// Shape() to a constant [-1,...] and a later Expand fails with "invalid expand
// shape".  The C API cannot express an anonymous unknown dim, so in that case
// the output is left without a shape (ORT infers it at run time).  Nothing is
// lost: the planner only reuses a buffer when every dim is a known value or a
// named symbol on both sides, which an anonymous dim never is.
OrtStatusPtr ORT_API_CALL InferSameAsProbs(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  size_t n = 0, rank = 0;
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputCount(ctx, &n)) return st;
  if (n < 1) return nullptr;
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &info)) return st;
  if (OrtStatusPtr st = api.GetDimensionsCount(info, &rank)) return st;
  if (rank != 4) return nullptr;
  int64_t dims[4] = {0, 0, 0, 0};
  const char* names[4] = {nullptr, nullptr, nullptr, nullptr};
  if (OrtStatusPtr st = api.GetDimensions(info, dims, rank)) return st;
  if (OrtStatusPtr st = api.GetSymbolicDimensions(info, names, rank)) return st;
  for (size_t i = 0; i < rank; ++i) {
    if (dims[i] < 0 && (names[i] == nullptr || names[i][0] == '\0')) return nullptr;
  }
  return api.ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

// One input's type/shape as shape inference sees it: `ok` when the input exists and has the expected rank
// (<= 3); dims are -1 and names non-empty where a dim is symbolic.
struct InputShape {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  int64_t dims[3] = {0, 0, 0};
  const char* names[3] = {nullptr, nullptr, nullptr};
  bool ok = false;
};

OrtStatusPtr ReadInputShape(OrtShapeInferContext* ctx, size_t index, size_t rank, InputShape* shape) {
  const OrtApi& api = Ort::GetApi();
  shape->ok = false;
  size_t n = 0, r = 0;
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputCount(ctx, &n)) return st;
  if (index >= n || rank > 3) return nullptr;
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, index, &shape->info)) return st;
  if (OrtStatusPtr st = api.GetDimensionsCount(shape->info, &r)) return st;
  if (r != rank) return nullptr;
  if (OrtStatusPtr st = api.GetDimensions(shape->info, shape->dims, rank)) return st;
  if (OrtStatusPtr st = api.GetSymbolicDimensions(shape->info, shape->names, rank)) return st;
  shape->ok = true;
  return nullptr;
}

// Writes output 0 as a rank-3 tensor of `type_of`'s element type with these dims and symbolic names; writes
// nothing when a dim is unknown without a name (ORT then infers it at run time).
OrtStatusPtr SetContextShape(OrtShapeInferContext* ctx, const OrtTensorTypeAndShapeInfo* type_of,
                             const int64_t (&dims)[3], const char* const (&names)[3]) {
  const OrtApi& api = Ort::GetApi();
  for (int i = 0; i < 3; ++i) {
    if (dims[i] < 0 && (names[i] == nullptr || names[i][0] == '\0')) return nullptr;
  }
  ONNXTensorElementDataType type;
  if (OrtStatusPtr st = api.GetTensorElementType(type_of, &type)) return st;
  OrtTensorTypeAndShapeInfo* out = nullptr;
  if (OrtStatusPtr st = api.CreateTensorTypeAndShapeInfo(&out)) return st;
  const char* sym[3] = {names[0], names[1], names[2]};
  OrtStatusPtr st = api.SetTensorElementType(out, type);
  if (st == nullptr) st = api.SetDimensions(out, dims, 3);
  if (st == nullptr) st = api.SetSymbolicDimensions(out, sym, 3);
  if (st == nullptr) st = api.ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  api.ReleaseTensorTypeAndShapeInfo(out);
  return st;
}

// context: query's [B,S_q] and value's last dimension, symbolic dims included; as InferSameAsProbs,
// nothing is written when a dim is unknown without a name (ORT then infers it at run time).
// Under GQA (key's last dimension N_kv*D below query's N*D) the context's N*D_v is value's N_kv*D_v times
// N/N_kv: known when all three are numbers, else left to run time.
OrtStatusPtr ORT_API_CALL InferAttentionContext(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  InputShape q, k, v;
  if (OrtStatusPtr st = ReadInputShape(ctx, 0, 3, &q)) return st;
  if (OrtStatusPtr st = ReadInputShape(ctx, 1, 3, &k)) return st;
  if (OrtStatusPtr st = ReadInputShape(ctx, 2, 3, &v)) return st;
  if (!q.ok || !k.ok || !v.ok) return nullptr;
  int64_t last = v.dims[2];
  const char* last_name = v.names[2];
  const bool same_heads = (q.dims[2] >= 0 && q.dims[2] == k.dims[2]) ||
                          (q.dims[2] < 0 && k.dims[2] < 0 && q.names[2] && k.names[2] && q.names[2][0] != '\0' &&
                           std::string(q.names[2]) == k.names[2]);
  if (!same_heads) {
    const bool known = q.dims[2] > 0 && k.dims[2] > 0 && v.dims[2] >= 0 && q.dims[2] % k.dims[2] == 0;
    last = known ? v.dims[2] * (q.dims[2] / k.dims[2]) : -1;
    last_name = "";
  }
  const int64_t dims[3] = {q.dims[0], q.dims[1], last};
  const char* const names[3] = {q.names[0], q.names[1], last_name};
  return SetContextShape(ctx, q.info, dims, names);
}

// context: input's [B,S] (symbolic dims included) and a third of weight's columns; nothing is written when
// a dim is unknown without a name (as InferAttentionContext).
OrtStatusPtr ORT_API_CALL InferProjectedContext(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  InputShape x, w;
  if (OrtStatusPtr st = ReadInputShape(ctx, 0, 3, &x)) return st;
  if (OrtStatusPtr st = ReadInputShape(ctx, 1, 2, &w)) return st;
  if (!x.ok || !w.ok || w.dims[1] <= 0 || w.dims[1] % 3 != 0) return nullptr;
  const int64_t out_dims[3] = {x.dims[0], x.dims[1], w.dims[1] / 3};
  const char* const names[3] = {x.names[0], x.names[1], ""};
  return SetContextShape(ctx, x.info, out_dims, names);
}

std::string Dims(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}
}  // namespace

Ort::Status CheckShapes(const std::vector<int64_t>& probs, const std::vector<int64_t>& mask, const char* input) {
  if (probs.size() != 4) {
    return Ort::Status(
        (std::string("attncal: ") + input + " must have rank 4 [B,H,Q,K], got rank " + std::to_string(probs.size()))
            .c_str(),
        ORT_INVALID_ARGUMENT);
  }
  if (mask.size() != 2 || mask[0] != probs[0] || mask[1] != probs[3]) {
    std::string got = "[";
    for (size_t i = 0; i < mask.size(); ++i) got += (i ? "," : "") + std::to_string(mask[i]);
    got += "]";
    return Ort::Status(("attncal: attention_mask must be [B,K]=[" + std::to_string(probs[0]) + "," +
                        std::to_string(probs[3]) + "], got " + got)
                           .c_str(),
                       ORT_INVALID_ARGUMENT);
  }
  return Ort::Status{nullptr};
}

Ort::Status CheckAttentionShapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                 const std::vector<int64_t>& v, const std::vector<int64_t>& mask, bool all_rows,
                                 const AttncalParams& p, attncal::AttentionShape* shape) {
  const int64_t num_heads = p.num_heads, kv_heads = p.num_kv_heads ? p.num_kv_heads : p.num_heads;
  auto bad = [](const std::string& why) { return Ort::Status(("attncal: " + why).c_str(), ORT_INVALID_ARGUMENT); };
  if (q.size() != 3 || k.size() != 3 || v.size() != 3) {
    return bad("query, key and value must have rank 3 [B,S,N*D], got " + Dims(q) + ", " + Dims(k) + ", " + Dims(v));
  }
  if (k[0] != q[0] || v[0] != q[0] || v[1] != k[1]) {
    return bad("query " + Dims(q) + ", key " + Dims(k) + " and value " + Dims(v) +
               " must share the batch size, and key and value the key length");
  }
  if (q[2] % num_heads != 0 || k[2] * num_heads != q[2] * kv_heads || v[2] % kv_heads != 0) {
    return bad("query's last dimension must be " + std::string(attncal::attr_name(ATTNCAL_ATTR_ID_num_heads)) + "=" +
               std::to_string(num_heads) + " heads of D, key's " + std::to_string(kv_heads) +
               " heads of the same D (" + attncal::attr_name(ATTNCAL_ATTR_ID_num_kv_heads) +
               "), and value's divisible by " + std::to_string(kv_heads) + "; got " + Dims(q) + ", " + Dims(k) +
               ", " + Dims(v));
  }
  if (mask.size() != 2 || mask[0] != k[0] || mask[1] != k[1]) {
    return bad("attention_mask must be [B,S_k]=[" + std::to_string(k[0]) + "," + std::to_string(k[1]) + "], got " +
               Dims(mask));
  }
  if (all_rows ? q[1] != k[1] : (q[1] != k[1] && q[1] != 1)) {
    return bad(std::string(all_rows ? "AllRowsCalibratedAttention needs S_q == S_k (self-attention)"
                                    : "PooledRowCalibratedAttention needs S_q == S_k or S_q == 1") +
               "; got query " + Dims(q) + ", key " + Dims(k));
  }
  if ((p.window_left >= 0 || p.window_right >= 0) && q[1] != k[1]) {
    return bad("a window (window_left, window_right) needs S_q == S_k; got query " + Dims(q) + ", key " + Dims(k));
  }
  shape->B = q[0];
  shape->S_q = q[1];
  shape->S_k = k[1];
  shape->N = num_heads;
  shape->N_kv = kv_heads;
  shape->D = q[2] / num_heads;
  shape->D_v = v[2] / kv_heads;
  shape->window_left = p.window_left;
  shape->window_right = p.window_right;
  return Ort::Status{nullptr};
}

Ort::Status CheckRelativeBias(const AttncalParams& p, const std::vector<int64_t>* table,
                              const attncal::AttentionShape& shape, const char* op) {
  auto bad = [op](const std::string& why) {
    return Ort::Status((std::string("attncal ") + op + ": " + why).c_str(), ORT_INVALID_ARGUMENT);
  };
  // The table's shape first (only where the attribute asks for a table), then the rules every backend shares.
  if (table != nullptr && p.relative_max_distance > 0 && (table->size() != 2 || (*table)[1] != shape.N)) {
    return bad("relative_bias must be [num_buckets, N] with N = num_heads = " + std::to_string(shape.N) + ", got " +
               Dims(*table));
  }
  char msg[200];
  if (!attncal::relative_bias_ok(table != nullptr, table != nullptr ? (*table)[0] : 0, p.relative_max_distance,
                                 shape.S_q, shape.S_k, msg, sizeof msg)) {
    return bad(msg);
  }
  return Ort::Status{nullptr};
}

Ort::Status CheckProjectedShapes(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                 const std::vector<int64_t>& b, const std::vector<int64_t>& mask, const AttncalParams& p,
                                 attncal::AttentionShape* shape, int64_t* hidden_in) {
  const auto dims = Dims;
  const int64_t num_heads = p.num_heads;
  auto bad = [](const std::string& why) { return Ort::Status(("attncal: " + why).c_str(), ORT_INVALID_ARGUMENT); };
  if (p.relative_max_distance != 0) {
    return bad(std::string(attncal::attr_name(ATTNCAL_ATTR_ID_relative_max_distance)) +
               " must be 0: the projected attention ops take no relative position bias");
  }
  if (p.num_kv_heads != 0 && p.num_kv_heads != p.num_heads) {
    return bad(std::string(attncal::attr_name(ATTNCAL_ATTR_ID_num_kv_heads)) + " must be 0 or num_heads: the packed " +
               "Q|K|V weight holds as many key/value heads as query heads; got " + std::to_string(p.num_kv_heads));
  }
  if (x.size() != 3 || w.size() != 2 || b.size() != 1) {
    return bad("input, weight and bias must be [B,S,H_in], [H_in,3*N*D] and [3*N*D], got " + dims(x) + ", " +
               dims(w) + ", " + dims(b));
  }
  if (w[0] != x[2] || b[0] != w[1] || w[1] % (3 * num_heads) != 0) {
    return bad("weight must be [H_in,3*N*D] with H_in = input's last dimension and 3*N*D divisible by 3*" +
               std::string(attncal::attr_name(ATTNCAL_ATTR_ID_num_heads)) + "=" +
               std::to_string(3 * num_heads) + ", and bias [3*N*D]; got input " + dims(x) + ", weight " + dims(w) +
               ", bias " + dims(b));
  }
  if (mask.size() != 2 || mask[0] != x[0] || mask[1] != x[1]) {
    return bad("attention_mask must be [B,S]=[" + std::to_string(x[0]) + "," + std::to_string(x[1]) + "], got " +
               dims(mask));
  }
  shape->B = x[0];
  shape->S_q = shape->S_k = x[1];
  shape->N = num_heads;
  shape->D = shape->D_v = w[1] / 3 / num_heads;
  shape->ld_q = shape->ld_k = shape->ld_v = w[1];
  shape->window_left = p.window_left;
  shape->window_right = p.window_right;
  *hidden_in = x[2];
  return Ort::Status{nullptr};
}

Ort::Status CheckCalibration(const Attributes& attrs, bool all_rows, bool softmax, const std::vector<int64_t>& input,
                             const std::vector<int64_t>& mask) {
  if (!attrs.error.empty()) return AttributeError(attrs, OpName(all_rows, softmax));
  return CheckShapes(input, mask, softmax ? "scores" : "probs");
}

Ort::Status CheckAttention(const AttentionAttributes& attrs, bool all_rows, const std::vector<int64_t>& q,
                           const std::vector<int64_t>& k, const std::vector<int64_t>& v,
                           const std::vector<int64_t>& mask, attncal::AttentionShape* shape) {
  if (!attrs.calibration.error.empty()) return AttributeError(attrs.calibration, AttentionOpName(all_rows));
  return CheckAttentionShapes(q, k, v, mask, all_rows, attrs.calibration.params, shape);
}

// Shape inference, and for the calibration ops the in-place map, by what the op computes.
void SetShapeInference(Ort::Custom::OrtLiteCustomOp* op, OpKind kind) {
  switch (kind) {
    case OpKind::kCalibration:
      op->InferOutputShapeFn = &InferSameAsProbs;
      op->GetMayInplace = &MayInplace;
      op->ReleaseMayInplace = &ReleaseMayInplace;
      break;
    case OpKind::kAttention:
      op->InferOutputShapeFn = &InferAttentionContext;
      break;
    case OpKind::kProjected:
      op->InferOutputShapeFn = &InferProjectedContext;
      break;
  }
}

}  // namespace attncal_ort
