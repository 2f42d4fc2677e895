// The TensorRT plugins (plugins/tensorrt: the calibration ops' and, with ATTNCAL_TRT_WITH_ATTENTION, the calibrated
// attention ops') driven as TensorRT drives them, with the CUDA launchers of the simulator's library behind them:
// run by tests/simt/test_simt_trt.py, which writes the case and checks the output against the float64 oracle.
//   trt_enqueue <case file> <directory>
// The case file: the op type; the number of inputs, then per input its type (0 float32, 1 float16, 2 bfloat16,
// 3 int64), rank and dims; the output's type, rank and dims; whether output 0 aliases input 0 (in place); then one
// field per line: name, i or f, value (the node's attributes, as the ONNX parser hands them to the creator).  The
// inputs are <directory>/in<i>.bin, the output is written to <directory>/out.bin.
// Path: getCreators -> createPlugin(kBUILD) -> configurePlugin -> getWorkspaceSize -> onShapeChange -> enqueue.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "trt_host_test_common.h"

using namespace trt_host_test;

namespace {
std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
DataType type_of(int code) {
  switch (code) {
    case 0: return DataType::kFLOAT;
    case 1: return DataType::kHALF;
    case 2: return DataType::kBF16;
    default: return DataType::kINT64;
  }
}
PluginTensorDesc read_desc(std::istream& in) {
  int code = 0, rank = 0;
  in >> code >> rank;
  std::vector<int64_t> dims(static_cast<size_t>(rank));
  for (int64_t& d : dims) in >> d;
  return desc(type_of(code), dims);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string dir = argv[2];
  std::ifstream cs(argv[1]);
  std::string op;
  int n_in = 0, in_place = 0;
  cs >> op >> n_in;
  std::vector<PluginTensorDesc> in;
  for (int i = 0; i < n_in; ++i) in.push_back(read_desc(cs));
  PluginTensorDesc out[1] = {read_desc(cs)};
  cs >> in_place;
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
  std::vector<DynamicPluginTensorDesc> din;
  for (const PluginTensorDesc& d : in) din.push_back(dyn(d));
  DynamicPluginTensorDesc dout[1] = {dyn(out[0])};
  IPluginV3OneBuild* build = build_of(p.get());
  CHECK(build->configurePlugin(din.data(), n_in, dout, 1) == 0);
  const size_t ws_bytes = build->getWorkspaceSize(din.data(), n_in, dout, 1);
  IPluginV3OneRuntime* rt = runtime_of(p.get());
  CHECK(rt->onShapeChange(in.data(), n_in, out, 1) == 0);
  std::vector<std::vector<char>> data;
  std::vector<void const*> inputs;
  for (int i = 0; i < n_in; ++i) data.push_back(read_file(dir + "/in" + std::to_string(i) + ".bin"));
  for (auto& d : data) inputs.push_back(d.data());
  size_t out_bytes = 1;
  for (int i = 0; i < out[0].dims.nbDims; ++i) out_bytes *= static_cast<size_t>(out[0].dims.d[i]);
  out_bytes *= out[0].type == DataType::kFLOAT ? 4 : 2;
  std::vector<char> y(out_bytes);
  std::vector<char> ws(ws_bytes > 0 ? ws_bytes : 1);
  void* outputs[1] = {in_place ? static_cast<void*>(data[0].data()) : y.data()};
  const int32_t rc = rt->enqueue(in.data(), out, inputs.data(), outputs, ws.data(), nullptr);
  if (rc != 0) {
    std::printf("enqueue failed (%d): %s\n", rc, attncal_cuda_last_error());
    return 1;
  }
  std::ofstream of(dir + "/out.bin", std::ios::binary);
  const char* r = in_place ? data[0].data() : y.data();
  of.write(r, static_cast<std::streamsize>(out_bytes));
  std::printf("%s: enqueue ok, workspace %zu bytes\n", op.c_str(), ws_bytes);
  return 0;
}
