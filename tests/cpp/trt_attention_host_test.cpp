// Host test of the calibrated-attention TensorRT plugin (plugins/tensorrt/attncal_trt_attention_plugin.cpp)
// as CMake builds it: together with the calibration plugin (attncal_trt_plugin.cpp) and
// ATTNCAL_TRT_WITH_ATTENTION, so that one getCreators lists all 12 creators.  No libnvinfer, no GPU.
// Built and run by tests/test_native_trt.py against each TensorRT header set.
//
// Covers, for PooledRowCalibratedAttention and AllRowsCalibratedAttention: the creators (names,
// version, namespaces, field names and types; the calibration ops' 8 creators still listed), field
// parsing (every numeric width, missing and invalid calibration fields, num_heads and scale), the
// attribute round trip (fields -> runtime plugin -> fields) and clone, output types and shapes,
// format combinations, the run-time shape refusals (onShapeChange), the workspace size and a clean
// enqueue error without a GPU; and the relative position bias: relative_max_distance accepted or refused,
// serialised, and its fifth input (the bias table) in the type, shape, format, workspace and run-time
// checks, required exactly with the attribute.  Prints one line per check group and exits non-zero on the first
// failure.
#include <NvInferRuntime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "trt_host_test_common.h"  // CHECK, getPluginRegistry, Fields, creator, desc, dyn, ...

using namespace nvinfer1;
using namespace trt_host_test;

extern "C" size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N, int64_t num_buckets);

namespace {

char const* const kOps[] = {"PooledRowCalibratedAttention", "AllRowsCalibratedAttention"};
char const* const kCalibrationOps[] = {"PooledRowCalibration", "AllRowsCalibration", "SoftmaxPooledRowCalibration",
                                       "SoftmaxAllRowsCalibration"};

// A valid attribute set of the contract (num_heads 4, scale 0.125).
const std::vector<Attr> kContract = {
    {"pool_last", false, 0},    {"basket_size", false, 128}, {"strength", true, 0.5},  {"isolate_first", false, 1},
    {"isolate_last", false, 0}, {"first_mode", false, 1},    {"last_mode", false, 0},  {"first_weight", true, 0.0},
    {"last_weight", true, 0.0}, {"skip_short", false, 1},    {"layer", false, 5},      {"num_heads", false, 4},
    {"scale", true, 0.125}};

// kContract, optionally with one field changed or dropped.  override_name "num_heads_float" writes
// num_heads as a float of override_value (a fractional count must be refused).
Fields contract_fields(bool all_rows, bool wide, char const* drop = nullptr, char const* override_name = nullptr,
                       double override_value = 0) {
  if (override_name && !std::strcmp(override_name, "num_heads_float")) {
    std::vector<Attr> attrs = kContract;
    for (Attr& a : attrs)
      if (!std::strcmp(a.name, "num_heads")) a.is_float = true;
    return make_fields(attrs, all_rows, wide, drop, "num_heads", override_value);
  }
  return make_fields(kContract, all_rows, wide, drop, override_name, override_value);
}

IPluginV3* make(char const* op, char const* override_name = nullptr, double override_value = 0) {
  Fields f = contract_fields(all_rows_op(op), false, nullptr, override_name, override_value);
  return creator(op, "")->createPlugin("n", f.get(), TensorRTPhase::kBUILD);
}

void test_creators() {
  int32_t n = 0;
  CHECK(getCreators(n) != nullptr && n == 12);  // 4 calibration ops + 2 attention ops, x 2 namespaces
  for (char const* op : kCalibrationOps)
    for (char const* ns : {"", "ai.attncal"}) CHECK(creator(op, ns) != nullptr);
  for (char const* op : kOps) {
    for (char const* ns : {"", "ai.attncal"}) {
      IPluginCreatorV3One* c = checked_creator(op, ns);
      PluginFieldCollection const* names = c->getFieldNames();
      const bool all_rows = all_rows_op(op);
      // with the optional num_kv_heads, window_left, window_right and relative_max_distance
      CHECK(names->nbFields == (all_rows ? 20 : 21));  // with the four optional marked-row fields
      CHECK((find_field(names, "pool_last") != nullptr) == !all_rows);
      PluginField const* heads = find_field(names, "num_heads");
      PluginField const* scale = find_field(names, "scale");
      CHECK(heads != nullptr && heads->type == PluginFieldType::kINT32);
      CHECK(scale != nullptr && scale->type == PluginFieldType::kFLOAT32);
      for (char const* f : {"basket_size", "strength", "isolate_first", "isolate_last", "first_mode", "last_mode",
                            "first_weight", "last_weight", "skip_short", "layer"})
        CHECK(find_field(names, f) != nullptr);
      PluginField const* rel = find_field(names, "relative_max_distance");
      CHECK(rel != nullptr && rel->type == PluginFieldType::kINT32);
    }
  }
  CHECK(creator("CalibratedAttention", "") == nullptr && creator(kOps[0], "other") == nullptr);
  std::printf("attention creators: 12 listed (8 calibration + 2 attention ops x {\"\", \"ai.attncal\"}), version 1, "
              "fields incl. num_heads (int32) and scale (float32)\n");
}

void test_field_parsing() {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (char const* op : kOps) {
    check_field_parsing(op, contract_fields, {"num_heads", "scale", "basket_size", "strength", "first_mode", "skip_short"},
                        {{"num_heads", 0}, {"num_heads", -2}, {"num_heads", 70000}, {"num_heads_float", 2.5},
                         {"scale", -0.5}, {"scale", inf}, {"scale", nan}, {"basket_size", 0},
                         {"strength", 1.5}, {"first_mode", 3}, {"isolate_last", 2}});
    const bool all_rows = all_rows_op(op);
    IPluginCreatorV3One* c = creator(op, "ai.attncal");
    {  // layer is informational: accepted without it
      Fields f = contract_fields(all_rows, false, "layer");
      std::unique_ptr<IPluginV3> p(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD));
      CHECK(p != nullptr);
    }
    {  // num_heads given as an integral float is a count
      Fields f = contract_fields(all_rows, true, nullptr, "num_heads_float", 3.0);
      std::unique_ptr<IPluginV3> p(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD));
      CHECK(p != nullptr);
    }
    // The geometry: GQA (num_kv_heads dividing num_heads = 4) and windows are accepted; a num_kv_heads that
    // does not divide num_heads, or a window bound below -1, is refused by the shared parser.
    struct Geometry {
      std::vector<Attr> attrs;
      bool ok;
    };
    for (Geometry const& g : std::vector<Geometry>{
             {{{"window_left", false, -1}, {"window_right", false, -1}, {"num_kv_heads", false, 4}}, true},
             {{{"window_right", false, 0}}, true},
             {{{"window_left", false, 7}}, true},
             {{{"num_kv_heads", false, 2}}, true},
             {{{"num_kv_heads", false, 1}, {"window_left", false, 3}, {"window_right", false, 0}}, true},
             {{{"relative_max_distance", false, 0}}, true},
             {{{"relative_max_distance", false, 128}}, true},
             {{{"relative_max_distance", false, 20}, {"num_kv_heads", false, 2}, {"window_right", false, 0}}, true},
             {{{"num_kv_heads", false, 3}}, false},
             {{{"window_left", false, -2}}, false},
             {{{"relative_max_distance", false, -1}}, false}}) {
      std::vector<Attr> attrs = kContract;
      attrs.insert(attrs.end(), g.attrs.begin(), g.attrs.end());
      Fields f = make_fields(attrs, all_rows, false, nullptr, nullptr, 0);
      std::unique_ptr<IPluginV3> p(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD));
      CHECK((p != nullptr) == g.ok);
    }
  }
  std::printf("attention field parsing (2 ops): int32/int64/float32/float64 accepted; missing or invalid num_heads, "
              "scale and calibration fields refused; GQA, windows and relative_max_distance accepted, an invalid "
              "geometry refused\n");
  std::string report;
  for (char const* op : kOps) {
    const std::string r = check_malformed_refusals(op, contract_fields, /*attention=*/true);
    if (!std::strcmp(op, "AllRowsCalibratedAttention")) report = r;
  }
  std::printf("attention malformed fields (2 ops): missing strength with a stray or duplicated field, misspelt and "
              "ill-typed fields refused, naming the field; e.g. \"%s\"\n", report.c_str());
}

void test_round_trip_and_clone() {
  for (char const* op : kOps) {
    const bool all_rows = all_rows_op(op);
    Fields f = contract_fields(all_rows, true, nullptr, "num_heads", 12);
    check_round_trip_and_clone(
        creator(op, "ai.attncal"), op, f, all_rows ? 11 : 12,  // every field but layer
        [&](PluginFieldCollection const* ser) {
          CHECK(lookup(ser, "num_heads") == 12 && lookup(ser, "scale") == 0.125);
          CHECK(lookup(ser, "basket_size") == 128 && lookup(ser, "strength") == 0.5 && lookup(ser, "first_mode") == 1);
          CHECK(lookup(ser, "isolate_first") == 1 && lookup(ser, "skip_short") == 1);
          if (!all_rows) CHECK(lookup(ser, "pool_last") == 0);
          for (char const* g : {"num_kv_heads", "window_left", "window_right", "relative_max_distance"})
            CHECK(find_field(ser, g) == nullptr);  // the default geometry is not written
        },
        [&](PluginFieldCollection const* ser_c) { CHECK(lookup(ser_c, "num_heads") == 12); });
  }
  for (char const* op : kOps) {  // a non-default geometry is serialised, so the runtime plugin computes the same
    const bool all_rows = all_rows_op(op);
    std::vector<Attr> attrs = kContract;
    attrs.insert(attrs.end(), {{"num_kv_heads", false, 2},
                               {"window_left", false, 3},
                               {"window_right", false, 0},
                               {"relative_max_distance", false, 40}});
    Fields f = make_fields(attrs, all_rows, true, nullptr, nullptr, 0);
    check_round_trip_and_clone(
        creator(op, "ai.attncal"), op, f, all_rows ? 15 : 16,  // with the four geometry fields
        [&](PluginFieldCollection const* ser) {
          CHECK(lookup(ser, "num_kv_heads") == 2 && lookup(ser, "window_left") == 3 && lookup(ser, "window_right") == 0);
          PluginField const* rel = find_field(ser, "relative_max_distance");
          CHECK(rel != nullptr && rel->type == PluginFieldType::kINT32 && field_value(*rel) == 40);
        },
        [&](PluginFieldCollection const* ser_c) {
          CHECK(lookup(ser_c, "num_kv_heads") == 2 && lookup(ser_c, "relative_max_distance") == 40);
        });
  }
  std::printf("attention attribute round trip (build -> fields -> runtime plugin) and clone ok (2 ops), "
              "the geometry included (relative_max_distance too)\n");
}

void test_types_shapes_formats(char const* op) {
  const bool all_rows = all_rows_op(op);
  std::unique_ptr<IPluginV3> p(make(op));
  CHECK(p != nullptr);
  IPluginV3OneBuild* build = build_of(p.get());
  CHECK(build != nullptr && build->getNbOutputs() == 1);
  // Output type = query's, for float, half and bfloat16; every input but the mask of that type.
  for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
    DataType in[4] = {t, t, t, DataType::kINT64}, out{};
    CHECK(build->getOutputDataTypes(&out, 1, in, 4) == 0 && out == t);
  }
  DataType out{};
  DataType mixed[4] = {DataType::kHALF, DataType::kFLOAT, DataType::kHALF, DataType::kINT64};
  CHECK(build->getOutputDataTypes(&out, 1, mixed, 4) != 0);
  DataType mask32[4] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kINT32};
  CHECK(build->getOutputDataTypes(&out, 1, mask32, 4) != 0);
  DataType ints[4] = {DataType::kINT8, DataType::kINT8, DataType::kINT8, DataType::kINT64};
  CHECK(build->getOutputDataTypes(&out, 1, ints, 4) != 0);
  DataType three[3] = {DataType::kHALF, DataType::kHALF, DataType::kHALF};
  CHECK(build->getOutputDataTypes(&out, 1, three, 3) != 0);

  // Shapes: context = [query.d0, query.d1, value.d2].
  static FakeExprBuilder* eb = new FakeExprBuilder;  // leaked: 11.x declares a protected destructor
  DimsExprs ins[4]{}, outs[1]{};
  for (int i = 0; i < 3; ++i) ins[i].nbDims = 3;
  ins[3].nbDims = 2;
  for (int i = 0; i < 4; ++i)
    for (int d = 0; d < ins[i].nbDims; ++d) ins[i].d[d] = reinterpret_cast<IDimensionExpr const*>(0x1000 + 16 * i + d);
  CHECK(build->getOutputShapes(ins, 4, nullptr, 0, outs, 1, *eb) == 0);
  CHECK(outs[0].nbDims == 3 && outs[0].d[0] == ins[0].d[0] && outs[0].d[1] == ins[0].d[1] && outs[0].d[2] == ins[2].d[2]);
  CHECK(build->getOutputShapes(ins, 3, nullptr, 0, outs, 1, *eb) != 0);
  ins[1].nbDims = 4;
  CHECK(build->getOutputShapes(ins, 4, nullptr, 0, outs, 1, *eb) != 0);
  ins[1].nbDims = 3;
  ins[3].nbDims = 3;
  CHECK(build->getOutputShapes(ins, 4, nullptr, 0, outs, 1, *eb) != 0);

  // Formats: linear only; query float/half/bf16; key, value, context query's type; mask int64.
  struct Combo {
    DataType q, kv, mask, out;
    TensorFormat fmt;
    bool ok;
  } combos[] = {
      {DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64, DataType::kFLOAT, TensorFormat::kLINEAR, true},
      {DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kHALF, TensorFormat::kLINEAR, true},
      {DataType::kBF16, DataType::kBF16, DataType::kINT64, DataType::kBF16, TensorFormat::kLINEAR, true},
      {DataType::kHALF, DataType::kFLOAT, DataType::kINT64, DataType::kHALF, TensorFormat::kLINEAR, false},
      {DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kFLOAT, TensorFormat::kLINEAR, false},
      {DataType::kFLOAT, DataType::kFLOAT, DataType::kINT32, DataType::kFLOAT, TensorFormat::kLINEAR, false},
      {DataType::kINT8, DataType::kINT8, DataType::kINT64, DataType::kINT8, TensorFormat::kLINEAR, false},
      {DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kHALF, TensorFormat::kCHW32, false},
  };
  int accepted = 0;
  for (Combo const& cb : combos) {
    DynamicPluginTensorDesc io[5] = {dyn(desc(cb.q, {2, 8, 64}, cb.fmt)), dyn(desc(cb.kv, {2, 8, 64}, cb.fmt)),
                                     dyn(desc(cb.kv, {2, 8, 32}, cb.fmt)), dyn(desc(cb.mask, {2, 8})),
                                     dyn(desc(cb.out, {2, 8, 32}, cb.fmt))};
    const bool all = accepts_formats(build, io, 4);
    CHECK(all == cb.ok);
    accepted += all;
  }
  CHECK(accepted == 3);
  DynamicPluginTensorDesc io[5] = {dyn(desc(DataType::kHALF, {2, 8, 64})), dyn(desc(DataType::kHALF, {2, 8, 64})),
                                   dyn(desc(DataType::kHALF, {2, 8, 32})), dyn(desc(DataType::kINT64, {2, 8})),
                                   dyn(desc(DataType::kHALF, {2, 8, 32}))};
  CHECK(build->configurePlugin(io, 4, io + 4, 1) == 0);
  CHECK(build->configurePlugin(io, 2, io + 4, 1) != 0);
  // Workspace: the launcher's, for the largest batch and query length (at least 4 bytes per query row and head).
  const size_t ws = build->getWorkspaceSize(io, 4, io + 4, 1);
  CHECK(ws == attncal_cuda_attention_workspace_bytes(2, 8, 4, 0) && ws >= 2 * 8 * 4 * sizeof(uint32_t));

  // Run-time shapes (num_heads = 4): accepted and refused.
  auto shapes_ok = [&](IPluginV3* plugin, std::vector<int64_t> q, std::vector<int64_t> k, std::vector<int64_t> v,
                       std::vector<int64_t> m, std::vector<int64_t> o) {
    PluginTensorDesc in[4] = {desc(DataType::kHALF, q), desc(DataType::kHALF, k), desc(DataType::kHALF, v),
                              desc(DataType::kINT64, m)};
    PluginTensorDesc out_d[1] = {desc(DataType::kHALF, o)};
    return runtime_of(plugin)->onShapeChange(in, 4, out_d, 1) == 0;
  };
  CHECK(shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8}, {2, 8, 32}));
  CHECK(shapes_ok(p.get(), {2, 1, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8}, {2, 1, 32}) == !all_rows);  // S_q 1: pooled only
  CHECK(!shapes_ok(p.get(), {2, 3, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8}, {2, 3, 32}));  // S_q neither S_k nor 1
  CHECK(!shapes_ok(p.get(), {2, 8, 66}, {2, 8, 66}, {2, 8, 32}, {2, 8}, {2, 8, 32}));  // hidden not divisible by 4
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 30}, {2, 8}, {2, 8, 30}));  // value hidden not divisible
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 32}, {2, 8, 32}, {2, 8}, {2, 8, 32}));  // query/key hidden differ
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {3, 8, 64}, {2, 8, 32}, {2, 8}, {2, 8, 32}));  // batch differs
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 7, 32}, {2, 8}, {2, 8, 32}));  // key/value length differ
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 32}, {2, 9}, {2, 8, 32}));  // mask length
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8, 1}, {2, 8, 32}));  // mask rank
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8}, {2, 8, 64}));  // context dims
  {  // GQA (num_kv_heads 2 of num_heads 4) and a causal window: key and value hold 2 heads, S_q == S_k
    std::vector<Attr> attrs = kContract;
    attrs.insert(attrs.end(), {{"num_kv_heads", false, 2}, {"window_right", false, 0}});
    Fields f = make_fields(attrs, all_rows, false, nullptr, nullptr, 0);
    std::unique_ptr<IPluginV3> g(creator(op, "")->createPlugin("n", f.get(), TensorRTPhase::kBUILD));
    CHECK(g != nullptr);
    CHECK(shapes_ok(g.get(), {2, 8, 64}, {2, 8, 32}, {2, 8, 16}, {2, 8}, {2, 8, 32}));    // context N*D_v = 4*8
    CHECK(!shapes_ok(g.get(), {2, 8, 64}, {2, 8, 32}, {2, 8, 16}, {2, 8}, {2, 8, 16}));   // context of N_kv heads only
    CHECK(!shapes_ok(g.get(), {2, 8, 64}, {2, 8, 64}, {2, 8, 32}, {2, 8}, {2, 8, 32}));   // key of N heads
    CHECK(!shapes_ok(g.get(), {2, 8, 64}, {2, 8, 32}, {2, 8, 15}, {2, 8}, {2, 8, 30}));   // value not N_kv heads
    CHECK(!shapes_ok(g.get(), {2, 1, 64}, {2, 8, 32}, {2, 8, 16}, {2, 8}, {2, 1, 32}));   // a window needs S_q == S_k
  }
  std::printf("%s: output types (float, half, bf16 -> same), shape [q0, q1, v2], %d of %zu format combinations "
              "accepted as expected, workspace %zu bytes, onShapeChange refusals ok, GQA and window shapes ok\n",
              op, accepted, sizeof combos / sizeof combos[0], ws);
}

// The relative position bias (relative_max_distance 20, num_heads 4): the plugin takes the table as a fifth
// input, T[num_buckets, 4] of query's type, and only with the attribute.
void test_relative_bias(char const* op) {
  const bool all_rows = all_rows_op(op);
  std::vector<Attr> attrs = kContract;
  attrs.push_back({"relative_max_distance", false, 20});
  Fields f = make_fields(attrs, all_rows, false, nullptr, nullptr, 0);
  std::unique_ptr<IPluginV3> p(creator(op, "")->createPlugin("n", f.get(), TensorRTPhase::kBUILD));
  std::unique_ptr<IPluginV3> plain(make(op));
  CHECK(p != nullptr && plain != nullptr);
  IPluginV3OneBuild* build = build_of(p.get());
  IPluginV3OneBuild* plain_build = build_of(plain.get());

  // Types: the table is query's type; four inputs are refused with the attribute, five without it.
  DataType out{};
  for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
    DataType in[5] = {t, t, t, DataType::kINT64, t};
    CHECK(build->getOutputDataTypes(&out, 1, in, 5) == 0 && out == t);
    CHECK(build->getOutputDataTypes(&out, 1, in, 4) != 0);
    CHECK(plain_build->getOutputDataTypes(&out, 1, in, 5) != 0);
  }
  DataType table_f32[5] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kFLOAT};
  CHECK(build->getOutputDataTypes(&out, 1, table_f32, 5) != 0);
  DataType table_i64[5] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64, DataType::kINT64};
  CHECK(build->getOutputDataTypes(&out, 1, table_i64, 5) != 0);

  // Shapes: the context as without the table; the table of rank 2; the input count as the attribute says.
  static FakeExprBuilder* eb = new FakeExprBuilder;  // leaked: 11.x declares a protected destructor
  DimsExprs ins[5]{}, outs[1]{};
  for (int i = 0; i < 3; ++i) ins[i].nbDims = 3;
  ins[3].nbDims = 2;
  ins[4].nbDims = 2;
  for (int i = 0; i < 5; ++i)
    for (int d = 0; d < ins[i].nbDims; ++d) ins[i].d[d] = reinterpret_cast<IDimensionExpr const*>(0x2000 + 16 * i + d);
  CHECK(build->getOutputShapes(ins, 5, nullptr, 0, outs, 1, *eb) == 0);
  CHECK(outs[0].nbDims == 3 && outs[0].d[0] == ins[0].d[0] && outs[0].d[1] == ins[0].d[1]);
  CHECK(outs[0].d[2] == ins[2].d[2]);
  CHECK(build->getOutputShapes(ins, 4, nullptr, 0, outs, 1, *eb) != 0);
  CHECK(plain_build->getOutputShapes(ins, 5, nullptr, 0, outs, 1, *eb) != 0);
  ins[4].nbDims = 3;
  CHECK(build->getOutputShapes(ins, 5, nullptr, 0, outs, 1, *eb) != 0);

  // Formats: linear, the table of query's type.
  auto io_of = [](DataType t, DataType table, TensorFormat fmt) {
    std::vector<DynamicPluginTensorDesc> io = {dyn(desc(t, {2, 8, 64}, fmt)), dyn(desc(t, {2, 8, 64}, fmt)),
                                               dyn(desc(t, {2, 8, 32}, fmt)), dyn(desc(DataType::kINT64, {2, 8})),
                                               dyn(desc(table, {32, 4}, fmt)), dyn(desc(t, {2, 8, 32}, fmt))};
    return io;
  };
  for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    CHECK(accepts_formats(build, io_of(t, t, TensorFormat::kLINEAR).data(), 5));
  CHECK(!accepts_formats(build, io_of(DataType::kHALF, DataType::kFLOAT, TensorFormat::kLINEAR).data(), 5));
  CHECK(!accepts_formats(build, io_of(DataType::kHALF, DataType::kHALF, TensorFormat::kCHW32).data(), 5));
  CHECK(!accepts_formats(plain_build, io_of(DataType::kHALF, DataType::kHALF, TensorFormat::kLINEAR).data(), 5));
  std::vector<DynamicPluginTensorDesc> io = io_of(DataType::kHALF, DataType::kHALF, TensorFormat::kLINEAR);
  CHECK(build->configurePlugin(io.data(), 5, io.data() + 5, 1) == 0);
  CHECK(build->configurePlugin(io.data(), 4, io.data() + 5, 1) != 0);
  CHECK(plain_build->configurePlugin(io.data(), 5, io.data() + 5, 1) != 0);

  // Workspace: the launcher's with the bias rows, 4 bytes per head and offset (2 * 8 - 1 offsets) more.
  const size_t ws = build->getWorkspaceSize(io.data(), 5, io.data() + 5, 1);
  const size_t ws_plain = attncal_cuda_attention_workspace_bytes(2, 8, 4, 0);
  CHECK(ws == attncal_cuda_attention_workspace_bytes(2, 8, 4, 32) && ws >= ws_plain + 4 * 4 * (2 * 8 - 1));
  CHECK(build->getWorkspaceSize(io.data(), 4, io.data() + 5, 1) == 0);

  // Run-time shapes.
  auto shapes_ok = [&](IPluginV3* plugin, std::vector<int64_t> q, std::vector<int64_t> table, bool with_table = true) {
    const std::vector<int64_t> kv = {q[0], 8, 64};
    PluginTensorDesc in[5] = {desc(DataType::kHALF, q), desc(DataType::kHALF, kv), desc(DataType::kHALF, {q[0], 8, 32}),
                              desc(DataType::kINT64, {q[0], 8}), desc(DataType::kHALF, table)};
    PluginTensorDesc out_d[1] = {desc(DataType::kHALF, {q[0], q[1], 32})};
    return runtime_of(plugin)->onShapeChange(in, with_table ? 5 : 4, out_d, 1) == 0;
  };
  CHECK(shapes_ok(p.get(), {2, 8, 64}, {32, 4}));
  CHECK(shapes_ok(p.get(), {2, 8, 64}, {4, 4}));     // the fewest buckets: 4, max distance above 1
  CHECK(shapes_ok(p.get(), {2, 8, 64}, {79, 4}));    // 79 / 4 = 19 < 20
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {80, 4}));   // max distance 20 not above 80 / 4
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {2, 4}));    // too few buckets
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {32, 3}));   // not one column per head
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {32, 4, 1}));  // rank
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {128}));     // rank
  CHECK(!shapes_ok(p.get(), {2, 1, 64}, {32, 4}));   // the bias needs S_q == S_k (a pooled op's one query too)
  CHECK(!shapes_ok(p.get(), {2, 8, 64}, {32, 4}, false));     // the attribute without the table
  CHECK(!shapes_ok(plain.get(), {2, 8, 64}, {32, 4}));        // the table without the attribute
  CHECK(shapes_ok(plain.get(), {2, 8, 64}, {32, 4}, false));
  CHECK(shapes_ok(plain.get(), {2, 1, 64}, {32, 4}, false) == !all_rows);
  std::printf("%s relative_bias: the fifth input exactly with relative_max_distance, of query's type (float, half, "
              "bf16), shape [num_buckets, N], workspace %zu bytes (%zu without), onShapeChange refusals ok\n",
              op, ws, ws_plain);
}

// Host buffers: without a GPU the launcher must fail cleanly (non-zero, message, nothing written).
void test_enqueue_without_gpu(bool expect_gpu_error) {
  if (!expect_gpu_error) return;
  for (char const* op : kOps) {
    for (double strength : {0.5, 0.0}) {
      std::unique_ptr<IPluginV3> p(make(op, "strength", strength));
      CHECK(p != nullptr);
      IPluginV3OneRuntime* rt = runtime_of(p.get());
      std::vector<float> q(2 * 8 * 64, 0.5f), k(2 * 8 * 64, 0.25f), v(2 * 8 * 32, 1.f), out(2 * 8 * 32, -1.f);
      std::vector<int64_t> mask(2 * 8, 1);
      PluginTensorDesc in[4] = {desc(DataType::kFLOAT, {2, 8, 64}), desc(DataType::kFLOAT, {2, 8, 64}),
                                desc(DataType::kFLOAT, {2, 8, 32}), desc(DataType::kINT64, {2, 8})};
      PluginTensorDesc od[1] = {desc(DataType::kFLOAT, {2, 8, 32})};
      void const* inputs[4] = {q.data(), k.data(), v.data(), mask.data()};
      void* outputs[1] = {out.data()};
      const int32_t rc = rt->enqueue(in, od, inputs, outputs, nullptr, nullptr);
      CHECK(rc != 0);
      for (float x : out) CHECK(x == -1.f);
      for (float x : q) CHECK(x == 0.5f);
      std::printf("%s (strength %.1f): enqueue without a GPU: returned %d (clean error: %s)\n", op, strength, rc,
                  attncal_cuda_last_error());
    }
    {  // with the relative position bias at strength 0 (its rows need the workspace even then)
      std::vector<Attr> attrs = kContract;
      attrs.push_back({"relative_max_distance", false, 20});
      Fields f = make_fields(attrs, all_rows_op(op), false, nullptr, "strength", 0.0);
      std::unique_ptr<IPluginV3> p(creator(op, "")->createPlugin("n", f.get(), TensorRTPhase::kBUILD));
      CHECK(p != nullptr);
      std::vector<float> q(2 * 8 * 64, 0.5f), k(2 * 8 * 64, 0.25f), v(2 * 8 * 32, 1.f), out(2 * 8 * 32, -1.f);
      std::vector<float> table(32 * 4, 0.125f);
      std::vector<int64_t> mask(2 * 8, 1);
      PluginTensorDesc in[5] = {desc(DataType::kFLOAT, {2, 8, 64}), desc(DataType::kFLOAT, {2, 8, 64}),
                                desc(DataType::kFLOAT, {2, 8, 32}), desc(DataType::kINT64, {2, 8}),
                                desc(DataType::kFLOAT, {32, 4})};
      PluginTensorDesc od[1] = {desc(DataType::kFLOAT, {2, 8, 32})};
      void const* inputs[5] = {q.data(), k.data(), v.data(), mask.data(), table.data()};
      void* outputs[1] = {out.data()};
      const int32_t rc = runtime_of(p.get())->enqueue(in, od, inputs, outputs, nullptr, nullptr);
      CHECK(rc != 0);
      for (float x : out) CHECK(x == -1.f);
      for (float x : table) CHECK(x == 0.125f);
      std::printf("%s (relative bias): enqueue without a GPU: returned %d (clean error: %s)\n", op, rc,
                  attncal_cuda_last_error());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool expect_gpu_error = argc < 2 || std::strcmp(argv[1], "--gpu") != 0;
  std::printf("TensorRT headers %d.%d.%d\n", NV_TENSORRT_MAJOR, NV_TENSORRT_MINOR, NV_TENSORRT_PATCH);
  test_creators();
  test_field_parsing();
  test_round_trip_and_clone();
  for (char const* op : kOps) test_types_shapes_formats(op);
  for (char const* op : kOps) test_relative_bias(op);
  test_enqueue_without_gpu(expect_gpu_error);
  std::printf("OK: %d checks\n", g_checks);
  return 0;
}
