// Host test of the attncal TensorRT plugin's TensorRT-facing logic
// (plugins/tensorrt/attncal_trt_plugin.cpp), without libnvinfer or a GPU.
// Built and run by tests/test_native_trt.py against each TensorRT header set.
//
// Covers, for each of the four op types (PooledRowCalibration,
// AllRowsCalibration, SoftmaxPooledRowCalibration, SoftmaxAllRowsCalibration):
// the creators (names, version, namespaces, field names), field parsing (every
// numeric width, missing fields, invalid values), output types and shapes,
// format combinations, the build interface (IPluginV3OneBuildV2, output 0
// aliased to input 0), the serialisation round trip, clone, and a clean enqueue
// error when there is no GPU (and that the Softmax* ops reach the softmax
// launcher).  Prints one line per check group and exits non-zero on the first
// failure.
#include <NvInferRuntime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "trt_host_test_common.h"  // CHECK, getPluginRegistry, Fields, creator, desc, dyn, ...

using namespace nvinfer1;
using namespace trt_host_test;

namespace {

char const* const kOps[] = {"PooledRowCalibration", "AllRowsCalibration", "SoftmaxPooledRowCalibration",
                            "SoftmaxAllRowsCalibration"};

// A valid attribute set (the op contract).
const std::vector<Attr> kContract = {
    {"pool_last", false, 1},     {"basket_size", false, 128}, {"strength", true, 0.5},    {"isolate_first", false, 1},
    {"isolate_last", false, 0},  {"first_mode", false, 2},    {"last_mode", false, 0},    {"first_weight", true, 0.25},
    {"last_weight", true, 0.0},  {"skip_short", false, 1},    {"layer", false, 3}};

// kContract, optionally with one field changed or dropped.
Fields contract_fields(bool all_rows, bool wide, char const* drop = nullptr, char const* override_name = nullptr,
                       double override_value = 0) {
  return make_fields(kContract, all_rows, wide, drop, override_name, override_value);
}

void test_creators() {
  int32_t n = 0;
  CHECK(getCreators(n) != nullptr && n == 8);
  int found = 0;
  for (char const* op : kOps) {
    for (char const* ns : {"", "ai.attncal"}) {
      IPluginCreatorV3One* c = checked_creator(op, ns);
      ++found;
      PluginFieldCollection const* names = c->getFieldNames();
      const bool all_rows = all_rows_op(op);
      CHECK(names->nbFields == (all_rows ? 14 : 15));  // with the four optional marked-row fields
      bool has_pool_last = false, has_marked_rows = false;
      for (int32_t i = 0; i < names->nbFields; ++i) {
        has_pool_last |= !std::strcmp(names->fields[i].name, "pool_last");
        has_marked_rows |= !std::strcmp(names->fields[i].name, "marked_rows");
      }
      CHECK(has_pool_last == !all_rows && has_marked_rows);
    }
  }
  CHECK(found == n);  // every creator is one of the 4 ops x 2 namespaces, no duplicates
  CHECK(creator("SoftmaxCalibration", "") == nullptr && creator("PooledRowCalibration", "other") == nullptr);
  std::printf("creators: 4 ops x namespaces {\"\", \"ai.attncal\"} = %d, version 1, field names ok\n", n);
}

void test_field_parsing() {
  for (char const* op : kOps) {
    check_field_parsing(op, contract_fields, {"basket_size", "strength", "first_mode", "skip_short", "first_weight"},
                        {{"basket_size", 0}, {"basket_size", -4}, {"strength", 1.5}, {"strength", -0.1},
                         {"first_mode", 3}, {"last_mode", -1}, {"isolate_first", 2}, {"skip_short", 7}});
  }
  std::printf("field parsing (4 ops): int32/int64/float32/float64 accepted; missing and invalid fields rejected\n");
  std::string report;
  for (char const* op : kOps) {
    const std::string r = check_malformed_refusals(op, contract_fields, /*attention=*/false);
    if (!std::strcmp(op, "AllRowsCalibration")) report = r;
  }
  std::printf("malformed fields (4 ops): missing strength with a stray or duplicated field, misspelt, ill-typed "
              "and foreign fields refused, naming the field; e.g. \"%s\"\n", report.c_str());
}

IPluginV3* make(char const* op, char const* override_name = nullptr, double override_value = 0) {
  Fields f = contract_fields(all_rows_op(op), false, nullptr, override_name, override_value);
  return creator(op, "")->createPlugin("n", f.get(), TensorRTPhase::kBUILD);
}

void test_types_shapes_formats(char const* op) {
  std::unique_ptr<IPluginV3> p(make(op));
  CHECK(p != nullptr);
  IPluginV3OneBuild* build = build_of(p.get());
  CHECK(build != nullptr);
  CHECK(build->getNbOutputs() == 1);
  DataType out{};
  DataType in_f[2] = {DataType::kFLOAT, DataType::kINT64};
  CHECK(build->getOutputDataTypes(&out, 1, in_f, 2) == 0 && out == DataType::kFLOAT);
  DataType in_h[2] = {DataType::kHALF, DataType::kINT64};
  CHECK(build->getOutputDataTypes(&out, 1, in_h, 2) == 0 && out == DataType::kHALF);
  CHECK(build->getOutputDataTypes(&out, 1, in_h, 1) != 0);

  static FakeExprBuilder* eb = new FakeExprBuilder;
  DimsExprs ins[2]{}, outs[1]{};
  ins[0].nbDims = 4;
  ins[1].nbDims = 2;
  for (int i = 0; i < 4; ++i) ins[0].d[i] = reinterpret_cast<IDimensionExpr const*>(0x1000 + i);
  CHECK(build->getOutputShapes(ins, 2, nullptr, 0, outs, 1, *eb) == 0);
  CHECK(outs[0].nbDims == 4);
  for (int i = 0; i < 4; ++i) CHECK(outs[0].d[i] == ins[0].d[i]);
  ins[0].nbDims = 3;
  CHECK(build->getOutputShapes(ins, 2, nullptr, 0, outs, 1, *eb) != 0);
  ins[0].nbDims = 4;
  ins[1].nbDims = 3;
  CHECK(build->getOutputShapes(ins, 2, nullptr, 0, outs, 1, *eb) != 0);

  // Formats: probs float/half linear, mask int64 linear, output = probs' type.
  struct Combo {
    DataType probs, mask, out;
    TensorFormat fmt;
    bool ok;
  } combos[] = {
      {DataType::kFLOAT, DataType::kINT64, DataType::kFLOAT, TensorFormat::kLINEAR, true},
      {DataType::kHALF, DataType::kINT64, DataType::kHALF, TensorFormat::kLINEAR, true},
      {DataType::kHALF, DataType::kINT64, DataType::kFLOAT, TensorFormat::kLINEAR, false},
      {DataType::kFLOAT, DataType::kINT32, DataType::kFLOAT, TensorFormat::kLINEAR, false},
      {DataType::kINT8, DataType::kINT64, DataType::kINT8, TensorFormat::kLINEAR, false},
      {DataType::kFLOAT, DataType::kINT64, DataType::kFLOAT, TensorFormat::kCHW32, false},
  };
  int accepted = 0;
  for (Combo const& cb : combos) {
    DynamicPluginTensorDesc io[3] = {dyn(desc(cb.probs, {2, 4, 8, 8}, cb.fmt)), dyn(desc(cb.mask, {2, 8})),
                                     dyn(desc(cb.out, {2, 4, 8, 8}, cb.fmt))};
    const bool all = accepts_formats(build, io, 2);
    CHECK(all == cb.ok);
    accepted += all;
  }
  CHECK(accepted == 2);
  DynamicPluginTensorDesc io[3] = {dyn(desc(DataType::kFLOAT, {2, 4, 8, 8})), dyn(desc(DataType::kINT64, {2, 8})),
                                   dyn(desc(DataType::kFLOAT, {2, 4, 8, 8}))};
  CHECK(build->configurePlugin(io, 2, io + 2, 1) == 0);
  CHECK(build->configurePlugin(io, 1, io + 2, 1) != 0);
  CHECK(build->getWorkspaceSize(io, 2, io + 2, 1) >= 2 * 3 * sizeof(int));

  IPluginV3OneRuntime* rt = runtime_of(p.get());
  PluginTensorDesc good[2] = {desc(DataType::kFLOAT, {2, 4, 8, 8}), desc(DataType::kINT64, {2, 8})};
  CHECK(rt->onShapeChange(good, 2, good, 1) == 0);
  PluginTensorDesc bad_k[2] = {desc(DataType::kFLOAT, {2, 4, 8, 8}), desc(DataType::kINT64, {2, 9})};
  CHECK(rt->onShapeChange(bad_k, 2, bad_k, 1) != 0);
  PluginTensorDesc bad_b[2] = {desc(DataType::kFLOAT, {2, 4, 8, 8}), desc(DataType::kINT64, {3, 8})};
  CHECK(rt->onShapeChange(bad_b, 2, bad_b, 1) != 0);
  std::printf("%s: output types (float->float, half->half), shapes (= input 0, rank checks), %d of %zu format "
              "combinations accepted as expected, shape-change checks ok\n",
              op, accepted, sizeof combos / sizeof combos[0]);
}

// The build capability is IPluginV3OneBuildV2 (TensorRT >= 10.3): output 0 may alias input 0.
void test_aliasing(char const* op) {
  std::unique_ptr<IPluginV3> p(make(op));
  CHECK(p != nullptr);
  IPluginCapability* cap = p->getCapabilityInterface(PluginCapabilityType::kBUILD);
  CHECK(cap != nullptr);
  auto* v2 = static_cast<IPluginV3OneBuildV2*>(cap);
  InterfaceInfo info = v2->getInterfaceInfo();
  CHECK(std::string(info.kind) == "PLUGIN_V3ONE_BUILD" && info.major == 2 && info.minor == 0);
  CHECK(v2->getAliasedInput(0) == 0);
  CHECK(v2->getAliasedInput(1) == -1);
  CHECK(v2->getAliasedInput(-1) == -1);
  // The same object through the version-1 view TensorRT < 10.3 would use.
  auto* v1 = static_cast<IPluginV3OneBuild*>(cap);
  CHECK(v1->getNbOutputs() == 1);
  std::unique_ptr<IPluginV3> cl(p->clone());
  CHECK(cl != nullptr);
  CHECK(static_cast<IPluginV3OneBuildV2*>(cl->getCapabilityInterface(PluginCapabilityType::kBUILD))
            ->getAliasedInput(0) == 0);
  std::printf("%s: build interface PLUGIN_V3ONE_BUILD %d.%d, getAliasedInput(0) = 0, (1) = -1\n", op,
              static_cast<int>(info.major), static_cast<int>(info.minor));
}

void test_serialisation_and_clone() {
  for (char const* op : kOps) {
    const bool all_rows = all_rows_op(op);
    const int32_t nb_fields = all_rows ? 9 : 10;
    Fields f = contract_fields(all_rows, true, nullptr, "strength", 0.75);
    check_round_trip_and_clone(
        creator(op, "ai.attncal"), op, f, nb_fields,
        [&](PluginFieldCollection const* ser) {
          CHECK(lookup(ser, "strength") == 0.75);
          CHECK(lookup(ser, "basket_size") == 128);
          CHECK(lookup(ser, "first_mode") == 2);
          CHECK(std::abs(lookup(ser, "first_weight") - 0.25) < 1e-7);
          if (!all_rows) CHECK(lookup(ser, "pool_last") == 1);
        },
        // The clone keeps the fields.
        [&](PluginFieldCollection const* ser_c) {
          CHECK(lookup(ser_c, "strength") == 0.75 && ser_c->nbFields == nb_fields);
        });
  }
  std::printf("serialisation round trip (build -> fields -> runtime plugin) and clone ok (4 ops)\n");
}

// Marked rows (landmark pooling): the all-rows ops keep the four optional fields that differ from their defaults
// through the round trip; a pooled op refuses them, naming the field.
void test_marked_rows() {
  std::vector<Attr> marked = kContract;
  marked.insert(marked.end(), {{"marked_rows", false, 1}, {"isolate_self", false, 1}, {"self_mode", false, 2},
                               {"self_weight", true, 0.2}});
  CaptureFinder finder;
  setLoggerFinder(&finder);
  for (char const* op : kOps) {
    const bool all_rows = all_rows_op(op);
    Fields f = make_fields(marked, all_rows, false, nullptr, nullptr, 0);
    if (!all_rows) {
      check_refused(creator(op, "ai.attncal"), f, {}, finder);
      CHECK(std::string(attncal_trt_last_error()).find("marked_rows and isolate_self are the all-rows ops'") !=
            std::string::npos);
      continue;
    }
    check_round_trip_and_clone(
        creator(op, "ai.attncal"), op, f, 9 + 4,
        [&](PluginFieldCollection const* ser) {
          CHECK(lookup(ser, "marked_rows") == 1 && lookup(ser, "isolate_self") == 1 && lookup(ser, "self_mode") == 2);
          CHECK(std::abs(lookup(ser, "self_weight") - 0.2) < 1e-7);
        },
        [&](PluginFieldCollection const* ser_c) { CHECK(lookup(ser_c, "marked_rows") == 1); });
  }
  setLoggerFinder(nullptr);
  std::printf("marked rows: the all-rows ops keep marked_rows, isolate_self, self_mode, self_weight; the pooled "
              "ops refuse them\n");
}

int32_t enqueue(IPluginV3* p, std::vector<float>& probs, std::vector<float>& result, bool in_place) {
  IPluginV3OneRuntime* rt = runtime_of(p);
  PluginTensorDesc in[2] = {desc(DataType::kFLOAT, {1, 1, 4, 4}), desc(DataType::kINT64, {1, 4})};
  PluginTensorDesc out[1] = {desc(DataType::kFLOAT, {1, 1, 4, 4})};
  std::vector<int64_t> mask(4, 1);
  void const* inputs[2] = {probs.data(), mask.data()};
  void* outputs[1] = {in_place ? probs.data() : result.data()};
  return rt->enqueue(in, out, inputs, outputs, nullptr, nullptr);
}

// The buffers are host memory: with a GPU (--gpu) only the call that never reaches the GPU runs.
void test_enqueue_without_gpu(bool expect_gpu_error) {
  for (char const* op : kOps) {
    if (!expect_gpu_error) break;
    std::unique_ptr<IPluginV3> p(make(op));
    std::vector<float> probs(16, 0.25f), result(16, -1.f);
    const int32_t rc = enqueue(p.get(), probs, result, false);
    CHECK(rc != 0);  // an error code, not a crash
    CHECK(std::strlen(attncal_cuda_last_error()) > 0);
    for (float v : result) CHECK(v == -1.f);  // nothing written
    for (float v : probs) CHECK(v == 0.25f);
    std::printf("%s: enqueue without a GPU: returned %d (clean error: %s)\n", op, rc, attncal_cuda_last_error());
  }
  // Dispatch: in place at strength 0 the calibration launcher has nothing to do (success without touching
  // the GPU), while the Softmax* ops must still compute the softmax (an error without a GPU).
  for (char const* op : kOps) {
    const bool softmax = std::strncmp(op, "Softmax", 7) == 0;
    if (softmax && !expect_gpu_error) continue;
    std::unique_ptr<IPluginV3> p(make(op, "strength", 0.0));
    CHECK(p != nullptr);
    std::vector<float> probs(16, 0.25f), result(16, -1.f);
    const int32_t rc = enqueue(p.get(), probs, result, true);
    CHECK(softmax ? rc != 0 : rc == 0);
    for (float v : probs) CHECK(v == 0.25f);
    for (float v : result) CHECK(v == -1.f);
  }
  std::printf("launcher dispatch: calibration ops in place at strength 0 -> no-op; Softmax* ops -> softmax "
              "launcher%s\n", expect_gpu_error ? "" : " (GPU-touching enqueues skipped: --gpu)");
}

}  // namespace

int main(int argc, char** argv) {
  const bool expect_gpu_error = argc < 2 || std::strcmp(argv[1], "--gpu") != 0;
  std::printf("TensorRT headers %d.%d.%d\n", NV_TENSORRT_MAJOR, NV_TENSORRT_MINOR, NV_TENSORRT_PATCH);
  test_creators();
  test_field_parsing();
  for (char const* op : kOps) {
    test_types_shapes_formats(op);
    test_aliasing(op);
  }
  test_serialisation_and_clone();
  test_marked_rows();
  test_enqueue_without_gpu(expect_gpu_error);
  std::printf("OK: %d checks\n", g_checks);
  return 0;
}
