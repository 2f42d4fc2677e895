// TensorRT IPluginV3 plugin for the calibrated attention ops, PooledRowCalibratedAttention and
// AllRowsCalibratedAttention (attncal/graphs/contract.py, "Calibrated attention"): a
// thin adapter over attncal_cuda_calibrated_attention (kernels/cuda/calibrated_attention_cuda.h).
//
//   inputs:  0 query T[B,S_q,N*D], 1 key T[B,S_k,N_kv*D], 2 value T[B,S_k,N_kv*D_v],
//            3 attention_mask int64[B,S_k], and with relative_max_distance > 0 (only then)
//            4 relative_bias T[num_buckets,N], the model's relative position bias table;
//            T = float, half or bfloat16 (one T for all)
//   output:  0 context T[B,S_q,N*D_v]
//   fields:  the calibration op's (pool_last on the pooled op only; layer optional, not kept),
//            num_heads (1..65535) and scale (finite, >= 0; 0 = 1/sqrt(D)): all required, read by
//            the shared parser (attncal_trt_fields.h), which refuses missing, duplicated,
//            ill-typed and foreign fields; the optional geometry, num_kv_heads (N_kv, dividing
//            num_heads; 0 = num_heads), window_left and window_right (-1 = no bound; a window needs
//            S_q == S_k) and relative_max_distance (0 = no relative position bias; else the fifth
//            input, at least 4 buckets, num_buckets / 4 below it, S_q == S_k), is kept, serialised
//            where it differs from its default, and passed to the kernel.
//
// Two creators per op type, version "1", namespaces "" and "ai.attncal" (as the calibration
// plugin has): 4 creators, listed by attncal_trt_plugin.cpp's getCreators when both files are
// built into one library with ATTNCAL_TRT_WITH_ATTENTION (CMake does).
//
// Why the plugin refuses what it refuses: shapes are checked where TensorRT gives them
// (getOutputShapes: ranks; onShapeChange: batch, key length, mask, head split with N_kv key/value
// heads, S_q rule, a window's S_q == S_k, the bias table's [num_buckets, N] and its S_q == S_k; the
// number of inputs, 5 exactly with relative_max_distance, wherever TensorRT passes it), and a
// refusal is a non-zero return there, never a bad launch.  The output is never aliased to an
// input (the build capability is IPluginV3OneBuild, not V2): the context has another shape, and
// the kernel reads the query after writing rows it hands to its per-row pass.
//
// Host-tested without libnvinfer or a GPU (tests/test_native_trt.py builds
// tests/cpp/trt_attention_host_test.cpp against TensorRT 10.5.0 and 11.1 headers); no engine has
// been built with it.
#include <NvInferRuntime.h>

#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "attncal_trt_fields.h"
#include "attncal_trt_plugin_base.h"
#include "common/relative_position.h"
#include "cuda/calibrated_attention_cuda.h"

using namespace nvinfer1;

namespace {

using attncal_trt::kDomain;

constexpr char const* kPooled = "PooledRowCalibratedAttention";
constexpr char const* kAllRows = "AllRowsCalibratedAttention";

// The launcher's grid limit on the number of heads (cuda/calibrated_attention_cuda.cu: one grid dimension).
constexpr int32_t kMaxHeads = 65535;

bool is_float_type(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

// The key/value heads (num_kv_heads resolved: 0 = num_heads).
int64_t kv_heads(AttncalParams const& p) { return p.num_kv_heads > 0 ? p.num_kv_heads : p.num_heads; }

// The inputs a node takes: the relative_bias table exactly when relative_max_distance is set.
int32_t input_count(AttncalParams const& p) { return p.relative_max_distance > 0 ? 5 : 4; }

// The run-time shape rules of the contract (the same as the ORT kernels' CheckAttentionShapes and
// CheckRelativeBias): query N heads of D, key N_kv heads of the same D, value N_kv heads; a window needs
// S_q == S_k; the relative position bias table (`rel`, with relative_max_distance) is [num_buckets, N]
// with a bucket function valid there, and needs S_q == S_k.
bool shapes_ok(Dims const& q, Dims const& k, Dims const& v, Dims const& m, Dims const* rel, AttncalParams const& p) {
  const int64_t n = p.num_heads, n_kv = kv_heads(p);
  if (q.nbDims != 3 || k.nbDims != 3 || v.nbDims != 3 || m.nbDims != 2) return false;
  if (k.d[0] != q.d[0] || v.d[0] != q.d[0] || m.d[0] != q.d[0]) return false;  // batch
  if (v.d[1] != k.d[1] || m.d[1] != k.d[1]) return false;                     // key length
  if (k.d[2] * n != q.d[2] * n_kv || q.d[2] % n != 0 || v.d[2] % n_kv != 0) return false;
  if ((p.window_left >= 0 || p.window_right >= 0) && q.d[1] != k.d[1]) return false;
  if ((rel != nullptr) != (p.relative_max_distance > 0)) return false;
  if (rel != nullptr) {
    if (rel->nbDims != 2 || rel->d[1] != n || !attncal::relative_buckets_valid(rel->d[0], p.relative_max_distance))
      return false;
    if (q.d[1] != k.d[1]) return false;
  }
  return p.all_rows ? q.d[1] == k.d[1] : (q.d[1] == k.d[1] || q.d[1] == 1);
}

// Capabilities, identity, the single output, the fields to serialise and attachToContext:
// attncal_trt_plugin_base.h (build capability IPluginV3OneBuild: no aliasing).
class AttentionPlugin : public attncal_trt::PluginBase<IPluginV3OneBuild> {
 public:
  AttentionPlugin(std::string name, std::string ns, AttncalParams p)
      : PluginBase(std::move(name), std::move(ns)), p_(p) {
    set_fields(p_, /*attention=*/true);
  }

  // IPluginV3
  IPluginV3* clone() noexcept override { return new (std::nothrow) AttentionPlugin(name_, ns_, p_); }

  // IPluginV3OneBuild
  int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t nbOutputs) noexcept override {
    return nbInputs == input_count(p_) && nbOutputs == 1 ? 0 : -1;
  }
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != 1 || nbInputs != input_count(p_) || !is_float_type(inputTypes[0])) return -1;
    if (inputTypes[1] != inputTypes[0] || inputTypes[2] != inputTypes[0] || inputTypes[3] != DataType::kINT64) return -1;
    if (nbInputs == 5 && inputTypes[4] != inputTypes[0]) return -1;  // the bias table: query's type
    outputTypes[0] = inputTypes[0];
    return 0;
  }
  // context = [query.d0, query.d1, value.d2 * N/N_kv]: an expression only under GQA (N_kv < N).
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
                          int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override {
    if (nbInputs != input_count(p_) || nbOutputs != 1) return -1;
    if (inputs[0].nbDims != 3 || inputs[1].nbDims != 3 || inputs[2].nbDims != 3 || inputs[3].nbDims != 2) return -1;
    if (nbInputs == 5 && inputs[4].nbDims != 2) return -1;
    outputs[0].nbDims = 3;
    outputs[0].d[0] = inputs[0].d[0];
    outputs[0].d[1] = inputs[0].d[1];
    const int64_t group = p_.num_heads / kv_heads(p_);
    outputs[0].d[2] = group == 1 ? inputs[2].d[2]
                                 : exprBuilder.operation(DimensionOperation::kPROD, *inputs[2].d[2],
                                                         *exprBuilder.constant(group));
    return outputs[0].d[2] != nullptr ? 0 : -1;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != input_count(p_) || nbOutputs != 1 || pos < 0 || pos > nbInputs) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    if (pos == 0) return is_float_type(d.type);
    if (pos == 3) return d.type == DataType::kINT64;
    return d.type == inOut[0].desc.type;  // key, value, the bias table and context: query's type
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t) const noexcept override {
    if (nbInputs != input_count(p_)) return 0;
    const int64_t buckets = nbInputs == 5 ? inputs[4].max.d[0] : 0;  // the bias rows: 4*N*(2*S_q-1) bytes more
    return attncal_cuda_attention_workspace_bytes(inputs[0].max.d[0], inputs[0].max.d[1], p_.num_heads, buckets);
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != input_count(p_) || nbOutputs != 1) return -1;
    if (!shapes_ok(in[0].dims, in[1].dims, in[2].dims, in[3].dims, nbInputs == 5 ? &in[4].dims : nullptr, p_))
      return -1;
    Dims const& o = out[0].dims;
    const int64_t group = p_.num_heads / kv_heads(p_);
    if (o.nbDims != 3 || o.d[0] != in[0].dims.d[0] || o.d[1] != in[0].dims.d[1] || o.d[2] != in[2].dims.d[2] * group)
      return -1;
    return 0;
  }
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
    Dims const& q = inputDesc[0].dims;
    Dims const& k = inputDesc[1].dims;
    Dims const& v = inputDesc[2].dims;
    const int64_t N = p_.num_heads;
    const DataType t = inputDesc[0].type;
    const int dtype = t == DataType::kHALF ? ATTNCAL_DTYPE_FLOAT16
                      : t == DataType::kBF16 ? ATTNCAL_DTYPE_BFLOAT16
                                             : ATTNCAL_DTYPE_FLOAT32;
    const bool rel = p_.relative_max_distance > 0;  // then input 4 is the bias table (onShapeChange checked it)
    return attncal_cuda_calibrated_attention(dtype, inputs[0], inputs[1], inputs[2],
                                             static_cast<int64_t const*>(inputs[3]), outputs[0], q.d[0], q.d[1],
                                             k.d[1], N, q.d[2] / N, v.d[2] / kv_heads(p_), p_.scale,
                                             rel ? inputs[4] : nullptr, rel ? inputDesc[4].dims.d[0] : 0, &p_,
                                             workspace, stream);
  }

 private:
  AttncalParams p_;  // num_heads, scale and the geometry included
};

// Identity, field names (the calibration fields, then num_heads and scale) and parsing:
// attncal_trt_plugin_base.h; here only the launcher's limit on num_heads.
class AttentionCreator : public attncal_trt::CreatorBase {
 public:
  AttentionCreator(char const* op, char const* ns)
      : CreatorBase(op, ns, !strcmp(op, kAllRows), /*attention=*/true) {}
  IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    AttncalParams p;
    if (!parse(fc, &p)) return nullptr;  // refused: the reason is reported (attncal_trt_last_error)
    if (p.num_heads > kMaxHeads) {
      attncal_trt::report_refusal(op_.c_str(), std::string(attncal::attr_name(ATTNCAL_ATTR_ID_num_heads)) +
                                                   " must be <= " + std::to_string(kMaxHeads) + " (the launcher's "
                                                   "grid limit), got " + std::to_string(p.num_heads));
      return nullptr;
    }
    return new (std::nothrow) AttentionPlugin(op_, ns_, p);
  }
};

}  // namespace

namespace attncal_trt {

// The 4 creators (2 op types x namespaces "" and "ai.attncal"); attncal_trt_plugin.cpp's getCreators
// appends them to the calibration ops' 8.
IPluginCreatorInterface* const* attention_creators(int32_t& nbCreators) {
  static AttentionCreator pooled_default(kPooled, ""), all_default(kAllRows, "");
  static AttentionCreator pooled_domain(kPooled, kDomain), all_domain(kAllRows, kDomain);
  static IPluginCreatorInterface* const creators[] = {&pooled_default, &all_default, &pooled_domain, &all_domain};
  nbCreators = static_cast<int32_t>(sizeof creators / sizeof creators[0]);
  return creators;
}

}  // namespace attncal_trt
