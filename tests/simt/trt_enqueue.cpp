// The TensorRT calibration plugin (plugins/tensorrt/attncal_trt_plugin.cpp) driven as TensorRT drives it,
// with the CUDA launchers of the simulator's library behind it: run by tests/simt/test_simt_trt.py, which
// writes the case and checks the output against the float64 oracle.
//   trt_enqueue <case file> <input file> <mask file> <output file>
// The case file: the op type, the dtype (0 float32, 1 float16), B H Q K, in place (0/1), then one field per
// line: name, i or f, value (the node's attributes, as the ONNX parser hands them to the creator).
// Path: getCreators -> createPlugin(kBUILD) -> configurePlugin -> getWorkspaceSize -> onShapeChange -> enqueue.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "trt_host_test_common.h"

using namespace trt_host_test;

namespace {
std::vector<char> read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  std::ifstream cs(argv[1]);
  std::string op;
  int dtype = 0, in_place = 0;
  int64_t B = 0, H = 0, Q = 0, K = 0;
  cs >> op >> dtype >> B >> H >> Q >> K >> in_place;
  Fields fields;
  std::string name, kind;
  double value = 0;
  while (cs >> name >> kind >> value) {
    if (kind == "f") {
      fields.add_float(name.c_str(), value, false);
    } else {
      fields.add_int(name.c_str(), static_cast<int64_t>(value), false);
    }
  }
  IPluginCreatorV3One* c = checked_creator(op.c_str(), "ai.attncal");
  std::unique_ptr<IPluginV3> p(c->createPlugin("node", fields.get(), TensorRTPhase::kBUILD));
  CHECK(p != nullptr);
  const DataType dt = dtype == 0 ? DataType::kFLOAT : DataType::kHALF;
  PluginTensorDesc in[2] = {desc(dt, {B, H, Q, K}), desc(DataType::kINT64, {B, K})};
  PluginTensorDesc out[1] = {desc(dt, {B, H, Q, K})};
  DynamicPluginTensorDesc din[2] = {dyn(in[0]), dyn(in[1])}, dout[1] = {dyn(out[0])};
  IPluginV3OneBuild* build = build_of(p.get());
  CHECK(build->configurePlugin(din, 2, dout, 1) == 0);
  const size_t ws_bytes = build->getWorkspaceSize(din, 2, dout, 1);
  IPluginV3OneRuntime* rt = runtime_of(p.get());
  CHECK(rt->onShapeChange(in, 2, out, 1) == 0);
  std::vector<char> x = read_file(argv[2]), mask = read_file(argv[3]);
  std::vector<char> y(in_place ? 0 : x.size());
  std::vector<char> ws(ws_bytes > 0 ? ws_bytes : 1);
  void const* inputs[2] = {x.data(), mask.data()};
  void* outputs[1] = {in_place ? static_cast<void*>(x.data()) : y.data()};
  const int32_t rc = rt->enqueue(in, out, inputs, outputs, ws.data(), nullptr);
  if (rc != 0) {
    std::printf("enqueue failed (%d): %s\n", rc, attncal_cuda_last_error());
    return 1;
  }
  std::ofstream of(argv[4], std::ios::binary);
  const std::vector<char>& r = in_place ? x : y;
  of.write(r.data(), static_cast<std::streamsize>(r.size()));
  std::printf("%s: enqueue ok, workspace %zu bytes\n", op.c_str(), ws_bytes);
  return 0;
}
