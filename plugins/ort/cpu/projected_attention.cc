// PooledRowCalibratedProjectedAttention / AllRowsCalibratedProjectedAttention on the CPU (contract.py): the
// layer input and ONNX Runtime Attention's packed QKV weight and bias.  Q, K and V are projected into scratch
// from ORT's allocator (the arena, as the fused Attention's own projection: not a tensor of the graph's
// memory pattern, which is what costs the separate projections their extra peak memory), in tiles on the
// intra-op pool (ProjectionJob, with the weight packed once for small requests: cpu/packed_gemm.h), then the
// calibrated attention units of cpu/calibrated_attention.h read the packed [B,S,3*N*D] buffer through strides.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <new>

#include "cpu/calibrated_attention.h"
#include "cpu/gemm.h"
#include "cpu/packed_gemm.h"
#include "cpu_jobs.h"
#include "ort_common.h"

namespace attncal_ort {
namespace cpu {

namespace {

using Ort::Custom::Tensor;

// One tile of qkv = input * weight + bias.  Tiles of up to 256 rows and, where that gives fewer than
// kMinTiles tiles, the columns split as well, so that a one-text request still spreads over the pool.  With
// the packed weight (cpu/packed_gemm.h; below 256 rows, see PackedFor) a tile is whole panels of it, and 12
// tiles, because 12 divides evenly among 2, 3, 4 or 6 threads (uneven shares leave threads idle at the end).
// Otherwise cblas_sgemm, which packs its share of the weight on every call (split by columns, each tile packs
// only its slice; 8 tiles).  The measurements behind these sizes: see docs/native-kernels.md.  Tiles depend
// only on the shapes, and every element is one fixed sum over the input's row: results do not depend on the
// thread count.
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
  AttentionAttributes attrs;

  // The weight packed for small requests (below), when it is a constant initializer (every export's is): packed
  // on the first such request, not at creation, so that batch jobs, which never take it, do not hold a second
  // copy of the calibrated layers' QKV weights (MiniLM: 1.7 MB per layer).  A weight fed at run time keeps
  // cblas_sgemm.
  bool weight_is_constant = false;
  std::once_flag pack_once;
  attncal::PackedWeight packed;

  CpuCalibratedProjectedAttention(const OrtApi* api, const OrtKernelInfo* info)
      : attrs(ReadAttentionAttributes(api, info, AllRows)) {
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
    if (!attrs.calibration.error.empty()) return AttributeError(attrs.calibration, op);
    attncal::AttentionShape shape;
    int64_t hidden_in = 0;
    Ort::Status st = CheckProjectedShapes(input.Shape(), weight.Shape(), bias.Shape(), mask.Shape(),
                                          attrs.calibration.params, &shape, &hidden_in);
    if (!st.IsOK()) return st;
    shape.scale = attrs.scale != 0.f ? attrs.scale : 1.0f / std::sqrt(static_cast<float>(shape.D));
    const int64_t cols = shape.ld_q, hidden = shape.N * shape.D, rows = shape.B * shape.S_q;
    float* dst = out.Allocate({shape.B, shape.S_q, hidden});
    g_attention_computes.fetch_add(1);
    if (rows == 0 || hidden == 0) return Ort::Status{nullptr};
    const ArenaBuffer qkv(context, sizeof(float) * static_cast<size_t>(rows * cols));  // freed on every return path
    float* qkv_data = qkv.floats();
    ProjectionJob pj{input.Data(), weight.Data(), bias.Data(), qkv_data, rows, hidden_in, cols};
    pj.packed = PackedFor(rows, weight.Data(), hidden_in, cols);
    if (pj.packed != nullptr) g_packed_projections.fetch_add(1);
    pj.Plan();
    st = RunUnits(context, &ProjectionJob::Run, pj.Tiles(), &pj, op);
    if (!st.IsOK()) return st;
    attncal::AttentionPlan plan(mask.Data(), shape, attrs.calibration.params);
    if (plan.size() == 0) return Ort::Status{nullptr};
    return RunAttention(context, plan, qkv_data, qkv_data + hidden, qkv_data + 2 * hidden, dst,
                        &attrs.calibration.params, op);
  }
};

}  // namespace

void AppendProjectedOps(OpList& ops, const char* ep) {
  Append<CpuCalibratedProjectedAttention<false>>(ops, ProjectedOpName(false), ep, OpKind::kProjected);
  Append<CpuCalibratedProjectedAttention<true>>(ops, ProjectedOpName(true), ep, OpKind::kProjected);
}

}  // namespace cpu
}  // namespace attncal_ort
