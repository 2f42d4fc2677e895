// ONNX Runtime custom-op library for the calibration op contract:
// domain ai.attncal, version 1, PooledRowCalibration and AllRowsCalibration
// and their Softmax-fused forms (SoftmaxPooledRowCalibration,
// SoftmaxAllRowsCalibration: input 0 is the scores), float and float16, on CPUExecutionProvider (always) and
// CUDAExecutionProvider (when built with CUDA).  Load it with
// SessionOptions.register_custom_ops_library(path); ORT then runs these
// kernels instead of inlining the model-local function of the same name.
//
// Bad inputs (wrong rank, mask shape mismatch, invalid attributes) come back
// as an ORT error status; nothing here throws across the C boundary.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "attncal_attribute_parser.h"
#include "attncal_ort_common.h"
#include "calibrated_attention_cpu.h"
#include "calibration_cpu.h"
#include "packed_gemm_cpu.h"

namespace attncal_ort {

std::atomic<uint64_t> g_computes[2];
std::atomic<uint64_t> g_inplace[2];
std::atomic<uint64_t> g_attention_computes{0};
std::atomic<uint64_t> g_packed_projections{0};  // projected-op runs whose projection used the packed weight

OrtStatusPtr ORT_API_CALL InferSameAsProbs(const OrtCustomOp*, OrtShapeInferContext* ctx);

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

// Shape inference and the in-place map, for every op of the library.
void AllowInplace(Ort::Custom::OrtLiteCustomOp* op) {
  op->InferOutputShapeFn = &InferSameAsProbs;
  op->GetMayInplace = &MayInplace;
  op->ReleaseMayInplace = &ReleaseMayInplace;
}

namespace {

// What ONNX Runtime holds under `name` for this node: false when nothing.  The kernel-info API reads
// an attribute by name and type and cannot list a node's attributes, so the adapter asks for every
// name of the table (attncal_attributes.def): an attribute of the table that this op does not take
// (pool_last on an all-rows op, num_heads on a calibration op) is seen and refused as foreign; a name
// outside the table cannot be seen here.  A duplicated attribute never reaches a kernel: ONNX
// Runtime refuses the model when it loads it ("appeared multiple times").
bool Probe(const OrtApi* api, const OrtKernelInfo* info, const char* name, attncal::AttrValue* v) {
  auto ok = [api](OrtStatus* st) {
    if (st == nullptr) return true;
    api->ReleaseStatus(st);
    return false;
  };
  int64_t i = 0;
  float f = 0.f;
  size_t n = 0;
  if (ok(api->KernelInfoGetAttribute_int64(info, name, &i))) {
    *v = attncal::AttrValue::integer(i);
  } else if (ok(api->KernelInfoGetAttribute_float(info, name, &f))) {
    *v = attncal::AttrValue::real(f);
  } else if (ok(api->KernelInfoGetAttribute_string(info, name, nullptr, &n))) {
    *v = attncal::AttrValue::other("a string");
  } else if (ok(api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &n)) ||
             ok(api->KernelInfoGetAttributeArray_float(info, name, nullptr, &n))) {
    *v = attncal::AttrValue::other("a list");
  } else {
    return false;
  }
  return true;
}

// The node's attributes through the shared parser (attncal_attribute_parser.h); ONNX attribute
// types are exact, so no numeric leniency.
AttncalParams ReadNode(const OrtApi* api, const OrtKernelInfo* info, bool all_rows, bool attention,
                       std::string* error) {
  attncal::AttributeParser parser(all_rows, attention, /*lenient_numbers=*/false);
  for (int id = 0; id < ATTNCAL_ATTR_COUNT; ++id) {
    attncal::AttrValue v{};
    if (Probe(api, info, attncal::attr_name(id), &v)) parser.offer(attncal::attr_name(id), v);
  }
  AttncalParams p{};
  p.all_rows = all_rows ? 1 : 0;
  if (!parser.finish(&p)) *error = parser.error();
  return p;
}

}  // namespace

Attributes ReadAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows) {
  Attributes a;
  a.params = ReadNode(api, info, all_rows, /*attention=*/false, &a.error);
  return a;
}

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

Ort::Status AttributeError(const Attributes& a, const char* op) {
  return Ort::Status((std::string("attncal ") + op + ": " + a.error).c_str(), ORT_INVALID_ARGUMENT);
}

AttentionAttributes ReadAttentionAttributes(const OrtApi* api, const OrtKernelInfo* info, bool all_rows) {
  AttentionAttributes a;
  a.calibration.params = ReadNode(api, info, all_rows, /*attention=*/true, &a.calibration.error);
  a.num_heads = a.calibration.params.num_heads;
  a.scale = a.calibration.params.scale;
  return a;
}

namespace {
std::string Dims(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}
}  // namespace

Ort::Status CheckAttentionShapes(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                 const std::vector<int64_t>& v, const std::vector<int64_t>& mask, bool all_rows,
                                 int64_t num_heads, attncal::AttentionShape* shape) {
  auto bad = [](const std::string& why) { return Ort::Status(("attncal: " + why).c_str(), ORT_INVALID_ARGUMENT); };
  if (q.size() != 3 || k.size() != 3 || v.size() != 3) {
    return bad("query, key and value must have rank 3 [B,S,N*D], got " + Dims(q) + ", " + Dims(k) + ", " + Dims(v));
  }
  if (k[0] != q[0] || v[0] != q[0] || v[1] != k[1]) {
    return bad("query " + Dims(q) + ", key " + Dims(k) + " and value " + Dims(v) +
               " must share the batch size, and key and value the key length");
  }
  if (k[2] != q[2] || q[2] % num_heads != 0 || v[2] % num_heads != 0) {
    return bad("query and key must have the same last dimension, and it and value's must be divisible by " +
               std::string(attncal::attr_name(ATTNCAL_ATTR_ID_num_heads)) + "=" + std::to_string(num_heads) + "; got " +
               Dims(q) + ", " + Dims(k) + ", " + Dims(v));
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
  shape->B = q[0];
  shape->S_q = q[1];
  shape->S_k = k[1];
  shape->N = num_heads;
  shape->D = q[2] / num_heads;
  shape->D_v = v[2] / num_heads;
  return Ort::Status{nullptr};
}

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

// context: query's [B,S_q] and value's last dimension, symbolic dims included; as InferSameAsProbs,
// nothing is written when a dim is unknown without a name (ORT then infers it at run time).
OrtStatusPtr ORT_API_CALL InferAttentionContext(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  InputShape q, v;
  if (OrtStatusPtr st = ReadInputShape(ctx, 0, 3, &q)) return st;
  if (OrtStatusPtr st = ReadInputShape(ctx, 2, 3, &v)) return st;
  if (!q.ok || !v.ok) return nullptr;
  const int64_t dims[3] = {q.dims[0], q.dims[1], v.dims[2]};
  const char* const names[3] = {q.names[0], q.names[1], v.names[2]};
  return SetContextShape(ctx, q.info, dims, names);
}

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

}  // namespace attncal_ort

namespace {

using attncal_ort::Attributes;
using Ort::Custom::OrtLiteCustomOp;
using Ort::Custom::Tensor;

// Runs n work units: inline when there is one, else on ORT's intra-op thread pool (ParallelFor).
Ort::Status RunUnits(OrtKernelContext* context, void (*run)(void*, size_t), size_t n, void* job, const char* op) {
  if (n == 1) {
    run(job, 0);
    return Ort::Status{nullptr};
  }
  try {
    Ort::KernelContext(context).ParallelFor(run, n, 0, job);
  } catch (const Ort::Exception& e) {
    return Ort::Status((std::string("attncal ") + op + ": " + e.what()).c_str(), ORT_FAIL);
  }
  return Ort::Status{nullptr};
}

// The kernel's work units run on ORT's intra-op thread pool (ParallelFor).
template <typename T, bool Softmax>
struct ParallelJob {
  const attncal::Plan* plan;
  const T* in;
  T* out;
  const AttncalParams* params;
  static void Run(void* self, size_t i) {
    auto* job = static_cast<ParallelJob*>(self);
    job->plan->template run<Softmax>(i, job->in, job->out, *job->params);
  }
};

// Softmax = false: input 0 is probs; true: input 0 is the scores and every row gets its softmax.
template <typename T, bool AllRows, bool Softmax = false>
struct CpuCalibration {
  // float16 is handled as its raw bits; the kernel widens each row to float.
  using Raw = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  Attributes attrs;

  CpuCalibration(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(attncal_ort::ReadAttributes(api, info, AllRows)) {}

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& probs, const Tensor<int64_t>& mask,
                      Tensor<T>& out) {
    const char* op = attncal_ort::OpName(AllRows, Softmax);
    if (!attrs.error.empty()) return attncal_ort::AttributeError(attrs, op);
    const std::vector<int64_t> shape = probs.Shape();
    Ort::Status st = attncal_ort::CheckShapes(shape, mask.Shape(), Softmax ? "scores" : "probs");
    if (!st.IsOK()) return st;
    // With GetMayInplace ORT may hand back the input's buffer as the output.
    const Raw* src = reinterpret_cast<const Raw*>(probs.Data());
    Raw* dst = reinterpret_cast<Raw*>(out.Allocate(shape));
    attncal_ort::g_computes[0].fetch_add(1);
    if (static_cast<const void*>(dst) == static_cast<const void*>(src)) attncal_ort::g_inplace[0].fetch_add(1);
    const attncal::Plan plan(mask.Data(), shape[0], shape[1], shape[2], shape[3], attrs.params,
                             Softmax || dst != src);
    if (plan.size() == 0) return Ort::Status{nullptr};
    using Job = ParallelJob<Raw, Softmax>;
    Job job{&plan, src, dst, &attrs.params};
    return RunUnits(context, &Job::Run, plan.size(), &job, op);
  }
};

// The calibrated attention ops: units of (item, head, block of query rows) on the intra-op pool.
template <typename T>
struct AttentionJob {
  const attncal::AttentionPlan* plan;
  const T *q, *k, *v;
  T* out;
  const AttncalParams* params;
  static void Run(void* self, size_t i) {
    auto* job = static_cast<AttentionJob*>(self);
    job->plan->run(i, job->q, job->k, job->v, job->out, *job->params);
  }
};

template <typename T, bool AllRows>
struct CpuCalibratedAttention {
  using Raw = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  attncal_ort::AttentionAttributes attrs;

  CpuCalibratedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(attncal_ort::ReadAttentionAttributes(api, info, AllRows)) {
    attncal::gemm_init();
  }

  Ort::Status Compute(OrtKernelContext* context, const Tensor<T>& query, const Tensor<T>& key,
                      const Tensor<T>& value, const Tensor<int64_t>& mask, Tensor<T>& out) {
    const char* op = attncal_ort::AttentionOpName(AllRows);
    if (!attrs.calibration.error.empty()) return attncal_ort::AttributeError(attrs.calibration, op);
    attncal::AttentionShape shape;
    Ort::Status st = attncal_ort::CheckAttentionShapes(query.Shape(), key.Shape(), value.Shape(), mask.Shape(),
                                                       AllRows, attrs.num_heads, &shape);
    if (!st.IsOK()) return st;
    shape.scale = attrs.scale != 0.f ? attrs.scale : 1.0f / std::sqrt(static_cast<float>(shape.D));
    Raw* dst = reinterpret_cast<Raw*>(out.Allocate({shape.B, shape.S_q, shape.N * shape.D_v}));
    attncal_ort::g_attention_computes.fetch_add(1);
    const attncal::AttentionPlan plan(mask.Data(), shape, attrs.calibration.params);
    if (plan.size() == 0) return Ort::Status{nullptr};
    using Job = AttentionJob<Raw>;
    Job job{&plan, reinterpret_cast<const Raw*>(query.Data()), reinterpret_cast<const Raw*>(key.Data()),
            reinterpret_cast<const Raw*>(value.Data()), dst, &attrs.calibration.params};
    return RunUnits(context, &Job::Run, plan.size(), &job, op);
  }
};

// The projected calibrated attention ops (contract.py): the layer input and ONNX Runtime Attention's packed QKV
// weight and bias.  Q, K and V are projected into scratch from ORT's allocator (the arena, as the fused Attention's
// own projection: not a tensor of the graph's memory pattern, which is what costs the separate projections their
// extra peak memory), in blocks of rows on the intra-op pool, then the calibrated attention units read the packed
// [B,S,3*N*D] buffer through strides.
constexpr const char* ProjectedOpName(bool all_rows) {
  return all_rows ? "AllRowsCalibratedProjectedAttention" : "PooledRowCalibratedProjectedAttention";
}

bool IsProjectedOp(const char* name) {
  const std::string n(name);
  return n == ProjectedOpName(false) || n == ProjectedOpName(true);
}

Ort::Status CheckProjectedShapes(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                 const std::vector<int64_t>& b, const std::vector<int64_t>& mask, int64_t num_heads,
                                 attncal::AttentionShape* shape, int64_t* hidden_in) {
  const auto dims = attncal_ort::Dims;
  auto bad = [](const std::string& why) { return Ort::Status(("attncal: " + why).c_str(), ORT_INVALID_ARGUMENT); };
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
  *hidden_in = x[2];
  return Ort::Status{nullptr};
}

// context: input's [B,S] (symbolic dims included) and a third of weight's columns; nothing is written when
// a dim is unknown without a name (as InferAttentionContext).
OrtStatusPtr ORT_API_CALL InferProjectedContext(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  attncal_ort::InputShape x, w;
  if (OrtStatusPtr st = attncal_ort::ReadInputShape(ctx, 0, 3, &x)) return st;
  if (OrtStatusPtr st = attncal_ort::ReadInputShape(ctx, 1, 2, &w)) return st;
  if (!x.ok || !w.ok || w.dims[1] <= 0 || w.dims[1] % 3 != 0) return nullptr;
  const int64_t out_dims[3] = {x.dims[0], x.dims[1], w.dims[1] / 3};
  const char* const names[3] = {x.names[0], x.names[1], ""};
  return attncal_ort::SetContextShape(ctx, x.info, out_dims, names);
}

// One tile of qkv = input * weight + bias.  Tiles of up to 256 rows and, where that gives fewer than
// kMinTiles tiles, the columns split as well, so that a one-text request still spreads over the pool.  With
// the packed weight (packed_gemm_cpu.h; below 256 rows, see PackedFor) a tile is whole panels of it, and 12
// tiles, because 12 divides evenly among 2, 3, 4 or 6 threads (uneven shares leave threads idle at the end).
// Otherwise cblas_sgemm, which packs its share of the weight on every call (split by columns, each tile packs
// only its slice; 8 tiles).  The measurements behind these sizes: see docs/native-kernels.md.  Tiles depend only on the shapes, and every element is one fixed sum over the
// input's row: results do not depend on the thread count.
struct ProjectionJob {
  static constexpr int64_t kMaxRows = 256, kMinTiles = 8, kMinPackedTiles = 12;
  const float *x, *w, *bias;
  float* qkv;
  int64_t rows, hidden_in, cols;
  const attncal::PackedWeight* packed = nullptr;  // null: cblas_sgemm on w
  int64_t row_block = 1, col_block = 1, row_tiles = 1, col_tiles = 1;

  void Plan() {
    row_block = std::min(rows, kMaxRows);
    row_tiles = (rows + row_block - 1) / row_block;
    // Columns in units of the packed panel width, or of 16 for cblas_sgemm.
    const int64_t unit = packed != nullptr ? packed->panel_width() : 16;
    const int64_t units = (cols + unit - 1) / unit;
    const int64_t min_tiles = packed != nullptr ? kMinPackedTiles : kMinTiles;
    const int64_t want = std::min<int64_t>((min_tiles + row_tiles - 1) / row_tiles, std::max<int64_t>(1, units));
    col_block = (units + want - 1) / want * unit;
    col_tiles = (cols + col_block - 1) / col_block;
  }
  size_t Tiles() const { return static_cast<size_t>(row_tiles * col_tiles); }
  static void Run(void* self, size_t i) {
    auto* j = static_cast<ProjectionJob*>(self);
    const int64_t ti = static_cast<int64_t>(i) / j->col_tiles, tj = static_cast<int64_t>(i) % j->col_tiles;
    const int64_t r0 = ti * j->row_block, r = std::min(j->row_block, j->rows - r0);
    const int64_t c0 = tj * j->col_block, c = std::min(j->col_block, j->cols - c0);
    if (j->packed != nullptr) {
      const int64_t nr = j->packed->panel_width();
      attncal::packed_gemm_bias(*j->packed, r, j->x + r0 * j->hidden_in, j->hidden_in, j->bias, c0 / nr,
                                (c0 + c + nr - 1) / nr, j->qkv + r0 * j->cols, j->cols);
      return;
    }
    // The bias first, then the product accumulated onto it: one pass over the tile fewer than a product into
    // zeroed memory followed by the bias.
    float* dst = j->qkv + r0 * j->cols + c0;
    for (int64_t k = 0; k < r; ++k) std::copy(j->bias + c0, j->bias + c0 + c, dst + k * j->cols);
    attncal::gemm_nn(r, c, j->hidden_in, j->x + r0 * j->hidden_in, j->hidden_in, j->w + c0, j->cols, dst, j->cols,
                     /*accumulate=*/true);
  }
};

template <bool AllRows>
struct CpuCalibratedProjectedAttention {
  attncal_ort::AttentionAttributes attrs;

  // The weight packed for small requests (below), when it is a constant initializer (every export's is): packed
  // on the first such request, not at creation, so that batch jobs, which never take it, do not hold a second
  // copy of the calibrated layers' QKV weights (MiniLM: 1.7 MB per layer).  A weight fed at run time keeps
  // cblas_sgemm.
  bool weight_is_constant = false;
  std::once_flag pack_once;
  attncal::PackedWeight packed;

  CpuCalibratedProjectedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(attncal_ort::ReadAttentionAttributes(api, info, AllRows)) {
    attncal::gemm_init();
    int is_constant = 0;
    const OrtValue* weight = nullptr;
    if (OrtStatus* status = api->KernelInfoGetConstantInput_tensor(info, 1, &is_constant, &weight)) {
      api->ReleaseStatus(status);  // an ONNX Runtime that cannot tell: the weight is treated as fed
      return;
    }
    weight_is_constant = is_constant != 0 && weight != nullptr;
  }

  // The packed weight for this call, or null: only below one row tile, where cblas_sgemm's repacking of the
  // weight, paid once per column tile, is what the projection costs.  From one full tile on, the packed
  // kernel gains little on the op and loses at the model level, so OpenBLAS keeps the batches (the
  // measurements: see docs/native-kernels.md).
  const attncal::PackedWeight* PackedFor(int64_t rows, const float* weight, int64_t hidden_in, int64_t cols) {
    if (!weight_is_constant || rows >= ProjectionJob::kMaxRows) return nullptr;
    std::call_once(pack_once, [&] {
      try {
        packed.Pack(weight, hidden_in, cols, cols);
      } catch (const std::bad_alloc&) {  // no memory for the copy: cblas_sgemm, as before
        packed = attncal::PackedWeight{};
      }
    });
    return packed.Matches(hidden_in, cols) ? &packed : nullptr;
  }

  Ort::Status Compute(OrtKernelContext* context, const Tensor<float>& input, const Tensor<float>& weight,
                      const Tensor<float>& bias, const Tensor<int64_t>& mask, Tensor<float>& out) {
    const char* op = ProjectedOpName(AllRows);
    if (!attrs.calibration.error.empty()) return attncal_ort::AttributeError(attrs.calibration, op);
    attncal::AttentionShape shape;
    int64_t hidden_in = 0;
    Ort::Status st = CheckProjectedShapes(input.Shape(), weight.Shape(), bias.Shape(), mask.Shape(), attrs.num_heads,
                                          &shape, &hidden_in);
    if (!st.IsOK()) return st;
    shape.scale = attrs.scale != 0.f ? attrs.scale : 1.0f / std::sqrt(static_cast<float>(shape.D));
    const int64_t cols = shape.ld_q, hidden = shape.N * shape.D, rows = shape.B * shape.S_q;
    float* dst = out.Allocate({shape.B, shape.S_q, hidden});
    attncal_ort::g_attention_computes.fetch_add(1);
    if (rows == 0 || hidden == 0) return Ort::Status{nullptr};
    Ort::KernelContext kctx(context);
    Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    Ort::Allocator alloc = kctx.GetAllocator(*cpu);
    struct Buffer {  // freed on every return path
      Ort::Allocator& a;
      void* p;
      ~Buffer() { a.Free(p); }
    } qkv{alloc, alloc.Alloc(sizeof(float) * static_cast<size_t>(rows * cols))};
    float* qkv_data = static_cast<float*>(qkv.p);
    ProjectionJob pj{input.Data(), weight.Data(), bias.Data(), qkv_data, rows, hidden_in, cols};
    pj.packed = PackedFor(rows, weight.Data(), hidden_in, cols);
    if (pj.packed != nullptr) attncal_ort::g_packed_projections.fetch_add(1);
    pj.Plan();
    st = RunUnits(context, &ProjectionJob::Run, pj.Tiles(), &pj, op);
    if (!st.IsOK()) return st;
    const attncal::AttentionPlan plan(mask.Data(), shape, attrs.calibration.params);
    if (plan.size() == 0) return Ort::Status{nullptr};
    using Job = AttentionJob<float>;
    Job job{&plan, qkv_data, qkv_data + hidden, qkv_data + 2 * hidden, dst, &attrs.calibration.params};
    return RunUnits(context, &Job::Run, plan.size(), &job, op);
  }
};

const char* kDomain = "ai.attncal";
constexpr int kVersion = 1;

std::vector<std::unique_ptr<OrtLiteCustomOp>>& AllOps() {
  static std::vector<std::unique_ptr<OrtLiteCustomOp>> ops = [] {
    std::vector<std::unique_ptr<OrtLiteCustomOp>> v;
    const char* cpu = "CPUExecutionProvider";
    // start_ver = end_ver = 1: the contract is version 1 of the domain.
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, false>>("PooledRowCalibration", cpu, kVersion,
                                                                                 kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, false>>("PooledRowCalibration", cpu,
                                                                                          kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, true>>("AllRowsCalibration", cpu, kVersion,
                                                                                kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, true>>("AllRowsCalibration", cpu,
                                                                                         kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, false, true>>(
        "SoftmaxPooledRowCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, false, true>>(
        "SoftmaxPooledRowCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<float, true, true>>(
        "SoftmaxAllRowsCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibration<Ort::Float16_t, true, true>>(
        "SoftmaxAllRowsCalibration", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedAttention<float, false>>(
        "PooledRowCalibratedAttention", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedAttention<Ort::Float16_t, false>>(
        "PooledRowCalibratedAttention", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedAttention<float, true>>(
        "AllRowsCalibratedAttention", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedAttention<Ort::Float16_t, true>>(
        "AllRowsCalibratedAttention", cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedProjectedAttention<false>>(
        ProjectedOpName(false), cpu, kVersion, kVersion));
    v.emplace_back(Ort::Custom::CreateLiteCustomOp<CpuCalibratedProjectedAttention<true>>(
        ProjectedOpName(true), cpu, kVersion, kVersion));
    attncal_ort::AppendCudaOps(v, kVersion);
    // The calibration ops (CPU and CUDA): output 0 may reuse input 0.  The calibrated attention ops
    // never: their output is the context, not a rewritten input.
    for (auto& op : v) {
      if (IsProjectedOp(op->GetName(op.get()))) {
        op->InferOutputShapeFn = &InferProjectedContext;
      } else if (attncal_ort::IsAttentionOp(op->GetName(op.get()))) {
        op->InferOutputShapeFn = &attncal_ort::InferAttentionContext;
      } else {
        attncal_ort::AllowInplace(op.get());
      }
    }
    return v;
  }();
  return ops;
}

std::mutex g_domains_mutex;
std::vector<Ort::CustomOpDomain>& Domains() {
  static std::vector<Ort::CustomOpDomain> domains;
  return domains;
}

}  // namespace

extern "C" {

ATTNCAL_ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // The loading runtime is older than the headers; nothing else can be used.
    return nullptr;
  }
  Ort::InitApi(api);
  try {
    Ort::CustomOpDomain domain{kDomain};
    for (auto& op : AllOps()) domain.Add(op.get());
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(g_domains_mutex);
    Domains().push_back(std::move(domain));  // must outlive the sessions
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

// Debug counters, read through ctypes by the tests: how many times a native
// kernel ran (provider 0 = CPU, 1 = CUDA).  They prove that ORT executed the
// library's kernel rather than the inlined function body.
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_compute_count(int provider) {
  return (provider == 0 || provider == 1) ? attncal_ort::g_computes[provider].load() : 0;
}

// How many of those runs computed in place (ORT reused the probs buffer).
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_inplace_count(int provider) {
  return (provider == 0 || provider == 1) ? attncal_ort::g_inplace[provider].load() : 0;
}

// How many times the CPU calibrated attention kernel ran.
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_attention_count(void) { return attncal_ort::g_attention_computes.load(); }

// How many projected calibrated attention runs projected with the weight packed at kernel creation.
ATTNCAL_ORT_EXPORT uint64_t attncal_debug_packed_projection_count(void) {
  return attncal_ort::g_packed_projections.load();
}

// The GEMM the CPU calibrated attention kernel was built with ("openblas", "eigen" or "builtin").
ATTNCAL_ORT_EXPORT const char* attncal_gemm_backend(void) { return attncal::kGemmBackend; }

ATTNCAL_ORT_EXPORT int attncal_has_cuda(void) { return attncal_ort::kHasCuda ? 1 : 0; }

}  // extern "C"
