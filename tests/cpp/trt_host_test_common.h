// What the TensorRT plugin host tests (trt_plugin_host_test.cpp, trt_attention_host_test.cpp) share:
// the CHECK macro and its counter, the registry symbol that stands in for libnvinfer, attribute
// sets in every numeric width the ONNX parser may use, field look-ups, creator look-up, tensor
// descriptors, capability views, and the check sequences both plugins go through the same way
// (field parsing; serialisation round trip and clone).  Each test keeps its own ops, attribute
// values, refused values and op-specific checks.
//
// Included by exactly one translation unit per test binary (it defines getPluginRegistry).
#ifndef ATTNCAL_TESTS_CPP_TRT_HOST_TEST_COMMON_H_
#define ATTNCAL_TESTS_CPP_TRT_HOST_TEST_COMMON_H_

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// No libnvinfer here: the plugin's load-time registration asks for the global registry; the test
// binary provides the symbol and answers "none", so the plugin is exercised through getCreators()
// as TensorRT's loadLibrary would.
extern "C" nvinfer1::IPluginRegistry* getPluginRegistry() noexcept { return nullptr; }
extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" const char* attncal_cuda_last_error(void);
// The plugin library's refusal report: why the last createPlugin on this thread refused its fields.
extern "C" const char* attncal_trt_last_error(void);
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

namespace trt_host_test {

using namespace nvinfer1;

inline int g_checks = 0;

#define CHECK(cond)                                                           \
  do {                                                                        \
    ++::trt_host_test::g_checks;                                              \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

inline bool all_rows_op(char const* op) { return std::strstr(op, "AllRows") != nullptr; }

// Never called by the plugins (their output dims are copies of input dims); allocate it and leak it
// (11.x declares a protected destructor).
struct FakeExprBuilder : IExprBuilder {};

struct Fields {
  // Owned storage for a PluginFieldCollection, in the widths the ONNX parser may use.
  std::vector<PluginField> list;
  std::vector<std::shared_ptr<void>> values;  // each deletes its own type
  std::vector<std::string> names;
  PluginFieldCollection fc{};

  template <class T>
  void add(char const* name, T v, PluginFieldType type) {
    names.emplace_back(name);
    values.emplace_back(new T(v));
    list.emplace_back(nullptr, values.back().get(), type, 1);
  }
  void add_int(char const* name, int64_t v, bool wide) {
    if (wide) {
      add<int64_t>(name, v, PluginFieldType::kINT64);
    } else {
      add<int32_t>(name, static_cast<int32_t>(v), PluginFieldType::kINT32);
    }
  }
  void add_float(char const* name, double v, bool wide) {
    if (wide) {
      add<double>(name, v, PluginFieldType::kFLOAT64);
    } else {
      add<float>(name, static_cast<float>(v), PluginFieldType::kFLOAT32);
    }
  }
  PluginFieldCollection const* get() {
    for (size_t i = 0; i < list.size(); ++i) list[i].name = names[i].c_str();
    fc.nbFields = static_cast<int32_t>(list.size());
    fc.fields = list.data();
    return &fc;
  }
};

// One attribute of a test's valid set: its name, whether it is written as a float (else an
// integer), its value.
struct Attr {
  char const* name;
  bool is_float;
  double value;
};

// `attrs` in order, int32/float32 (int64/float64 when `wide`), without pool_last on an all-rows op
// and without `drop`; the attribute named `override_name` (if any) set to `override_value`.
inline Fields make_fields(std::vector<Attr> const& attrs, bool all_rows, bool wide, char const* drop,
                          char const* override_name, double override_value) {
  Fields f;
  for (Attr const& a : attrs) {
    if ((all_rows && !std::strcmp(a.name, "pool_last")) || (drop && !std::strcmp(a.name, drop))) continue;
    const double v = override_name && !std::strcmp(a.name, override_name) ? override_value : a.value;
    if (a.is_float) {
      f.add_float(a.name, v, wide);
    } else {
      f.add_int(a.name, static_cast<int64_t>(v), wide);
    }
  }
  return f;
}

inline double field_value(PluginField const& f) {
  switch (f.type) {
    case PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
    case PluginFieldType::kINT64: return static_cast<double>(*static_cast<int64_t const*>(f.data));
    case PluginFieldType::kFLOAT32: return *static_cast<float const*>(f.data);
    case PluginFieldType::kFLOAT64: return *static_cast<double const*>(f.data);
    default: return -12345;
  }
}

inline PluginField const* find_field(PluginFieldCollection const* fc, char const* name) {
  for (int32_t i = 0; i < fc->nbFields; ++i)
    if (!std::strcmp(fc->fields[i].name, name)) return &fc->fields[i];
  return nullptr;
}

inline double lookup(PluginFieldCollection const* fc, char const* name) {
  PluginField const* f = find_field(fc, name);
  return f ? field_value(*f) : -99999;
}

// The creator of op `name` in namespace `ns` that getCreators lists, or nullptr.
inline IPluginCreatorV3One* creator(char const* name, char const* ns) {
  int32_t n = 0;
  IPluginCreatorInterface* const* list = getCreators(n);
  for (int32_t i = 0; i < n; ++i) {
    auto* c = static_cast<IPluginCreatorV3One*>(list[i]);
    if (!std::strcmp(c->getPluginName(), name) && !std::strcmp(c->getPluginNamespace(), ns)) return c;
  }
  return nullptr;
}

// The creator of `op` in `ns`, checked: listed, version "1", a V3One creator.
inline IPluginCreatorV3One* checked_creator(char const* op, char const* ns) {
  IPluginCreatorV3One* c = creator(op, ns);
  CHECK(c != nullptr);
  CHECK(!std::strcmp(c->getPluginVersion(), "1"));
  CHECK(std::string(c->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE");
  return c;
}

inline PluginTensorDesc desc(DataType type, std::vector<int64_t> dims, TensorFormat fmt = TensorFormat::kLINEAR) {
  PluginTensorDesc d{};
  d.type = type;
  d.format = fmt;
  d.scale = -1.f;
  d.dims.nbDims = static_cast<int32_t>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) d.dims.d[i] = dims[i];
  return d;
}

inline DynamicPluginTensorDesc dyn(PluginTensorDesc d) {
  DynamicPluginTensorDesc x{};
  x.desc = d;
  x.min = x.opt = x.max = d.dims;
  return x;
}

// The plugin's capability views.
inline IPluginV3OneCore* core_of(IPluginV3* p) {
  return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}
inline IPluginV3OneBuild* build_of(IPluginV3* p) {
  return static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}
inline IPluginV3OneRuntime* runtime_of(IPluginV3* p) {
  return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

// Whether the plugin accepts every position of `io` (nb_inputs inputs, then one output).
inline bool accepts_formats(IPluginV3OneBuild* build, DynamicPluginTensorDesc const* io, int32_t nb_inputs) {
  bool all = true;
  for (int32_t pos = 0; pos < nb_inputs + 1; ++pos) all = all && build->supportsFormatCombination(pos, io, nb_inputs, 1);
  return all;
}

// A test's valid attribute set for an op (all_rows: an all-rows op), in int32/float32 or (wide)
// int64/float64, without `drop`, with `override_name` set to `override_value`.
using ContractFields = Fields (*)(bool all_rows, bool wide, char const* drop, char const* override_name,
                                  double override_value);

struct BadValue {
  char const* name;
  double value;
};

// Field parsing by op's creator in namespace "ai.attncal": the valid set is accepted in both widths
// (a plugin named op, version "1"); refused: the set without any one of `required` (and, on a pooled
// op, without pool_last), no fields at all, the set (wide) with one of `bad`, and pool_last 2.
inline void check_field_parsing(char const* op, ContractFields contract, std::vector<char const*> const& required,
                                std::vector<BadValue> const& bad) {
  const bool all_rows = all_rows_op(op);
  IPluginCreatorV3One* c = creator(op, "ai.attncal");
  for (bool wide : {false, true}) {
    Fields ok = contract(all_rows, wide, nullptr, nullptr, 0);
    std::unique_ptr<IPluginV3> p(c->createPlugin("node", ok.get(), TensorRTPhase::kBUILD));
    CHECK(p != nullptr);
    IPluginV3OneCore* core = core_of(p.get());
    CHECK(!std::strcmp(core->getPluginName(), op) && !std::strcmp(core->getPluginNamespace(), "ai.attncal"));
    CHECK(!std::strcmp(core->getPluginVersion(), "1"));
  }
  for (char const* drop : required) {
    Fields f = contract(all_rows, false, drop, nullptr, 0);
    CHECK(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD) == nullptr);
  }
  if (!all_rows) {
    Fields f = contract(false, false, "pool_last", nullptr, 0);
    CHECK(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD) == nullptr);
  }
  CHECK(c->createPlugin("node", nullptr, TensorRTPhase::kBUILD) == nullptr);
  for (BadValue const& b : bad) {
    Fields f = contract(all_rows, true, nullptr, b.name, b.value);
    CHECK(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD) == nullptr);
  }
  if (!all_rows) {
    Fields f = contract(false, false, nullptr, "pool_last", 2);
    CHECK(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD) == nullptr);
  }
}

// A logger that keeps the last error TensorRT would have been told, and the finder that hands it out
// (what TensorRT gives the library through setLoggerFinder).
struct CaptureLogger : ILogger {
  std::string last;
  void log(Severity severity, AsciiChar const* msg) noexcept override {
    if (severity == Severity::kERROR) last = msg;
  }
};
struct CaptureFinder : ILoggerFinder {
  CaptureLogger logger;
  ILogger* findLogger() override { return &logger; }
};

// createPlugin with f must refuse, and the report (attncal_trt_last_error, and the logger) must name
// every one of `named` (quoted, as the parser writes them).
inline void check_refused(IPluginCreatorV3One* c, Fields& f, std::vector<char const*> const& named,
                          CaptureFinder& finder) {
  finder.logger.last.clear();
  std::unique_ptr<IPluginV3> p(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD));
  CHECK(p == nullptr);
  const std::string why = attncal_trt_last_error();
  for (char const* n : named) {
    const std::string quoted = std::string("'") + n + "'";
    if (why.find(quoted) == std::string::npos || finder.logger.last.find(quoted) == std::string::npos) {
      std::fprintf(stderr, "refusal does not name %s: \"%s\" (logged: \"%s\")\n", quoted.c_str(), why.c_str(),
                   finder.logger.last.c_str());
      CHECK(false);
    }
  }
}

// The malformed field sets that a count of the fields seen used to accept, refused by op's creator in
// namespace "ai.attncal" with a report naming the field: the valid set without strength but with a
// stray pool_last (foreign on an all-rows op, duplicated on a pooled one), or with a duplicated
// basket_size, so that the count is the valid set's; a stray name outside the contract; strength as a
// string, as a list, with no data; num_heads on a calibration op; a duplicated field with every
// required one present.  Returns the first report, for the log.
inline std::string check_malformed_refusals(char const* op, ContractFields contract, bool attention) {
  const bool all_rows = all_rows_op(op);
  IPluginCreatorV3One* c = creator(op, "ai.attncal");
  CaptureFinder finder;
  setLoggerFinder(&finder);
  std::string first;
  {  // strength missing, pool_last in its place (AllRows: foreign; Pooled: a second pool_last)
    Fields f = contract(all_rows, false, "strength", nullptr, 0);
    f.add_int("pool_last", 0, false);
    check_refused(c, f, {"strength", "pool_last"}, finder);
    first = attncal_trt_last_error();
  }
  {  // strength missing, basket_size twice
    Fields f = contract(all_rows, true, "strength", nullptr, 0);
    f.add_int("basket_size", 4, true);
    check_refused(c, f, {"strength", "basket_size"}, finder);
  }
  {  // every field present, one duplicated with another value
    Fields f = contract(all_rows, false, nullptr, nullptr, 0);
    f.add_float("strength", 0.0, false);
    check_refused(c, f, {"strength"}, finder);
  }
  {  // a misspelt name in strength's place
    Fields f = contract(all_rows, false, "strength", nullptr, 0);
    f.add_float("strenght", 0.5, false);
    check_refused(c, f, {"strength", "strenght"}, finder);
  }
  {  // strength ill-typed: a string, two values, no data
    Fields f = contract(all_rows, false, "strength", nullptr, 0);
    f.add<char>("strength", '1', PluginFieldType::kCHAR);
    check_refused(c, f, {"strength"}, finder);
    Fields g = contract(all_rows, false, "strength", nullptr, 0);
    g.add<float>("strength", 0.5f, PluginFieldType::kFLOAT32);
    g.list.back().length = 2;
    check_refused(c, g, {"strength"}, finder);
    Fields h = contract(all_rows, false, "strength", nullptr, 0);
    h.add<float>("strength", 0.5f, PluginFieldType::kFLOAT32);
    h.list.back().data = nullptr;
    check_refused(c, h, {"strength"}, finder);
  }
  if (!attention) {  // an attention op's field on a calibration op
    Fields f = contract(all_rows, false, nullptr, nullptr, 0);
    f.add_int("num_heads", 4, false);
    check_refused(c, f, {"num_heads"}, finder);
  }
  {  // still accepted, and the report cleared: the valid set, with the routing fields the ONNX parser reads
    Fields f = contract(all_rows, false, nullptr, nullptr, 0);
    f.add<char>("plugin_namespace", 'a', PluginFieldType::kCHAR);
    std::unique_ptr<IPluginV3> p(c->createPlugin("node", f.get(), TensorRTPhase::kBUILD));
    CHECK(p != nullptr && std::string(attncal_trt_last_error()).empty());
  }
  setLoggerFinder(nullptr);
  return first;
}

// The serialisation round trip and clone of op's plugin, made (build phase) by creator `c` (namespace
// "ai.attncal") from `f`: its fields to serialise number nb_fields and pass check_fields; a runtime
// plugin created from them (what the runtime does with a plan) serialises the same fields, in order;
// its clone is a distinct object with the same identity, alive after the original, whose fields pass
// check_clone_fields, and that attaches to a context as a new plugin.
template <class CheckFields, class CheckCloneFields>
void check_round_trip_and_clone(IPluginCreatorV3One* c, char const* op, Fields& f, int32_t nb_fields,
                                CheckFields check_fields, CheckCloneFields check_clone_fields) {
  std::unique_ptr<IPluginV3> a(c->createPlugin("n", f.get(), TensorRTPhase::kBUILD));
  CHECK(a != nullptr);
  PluginFieldCollection const* ser = runtime_of(a.get())->getFieldsToSerialize();
  CHECK(ser != nullptr && ser->nbFields == nb_fields);
  check_fields(ser);
  std::unique_ptr<IPluginV3> b(c->createPlugin("n", ser, TensorRTPhase::kRUNTIME));
  CHECK(b != nullptr);
  PluginFieldCollection const* ser_b = runtime_of(b.get())->getFieldsToSerialize();
  CHECK(ser_b->nbFields == ser->nbFields);
  for (int32_t i = 0; i < ser->nbFields; ++i) {
    CHECK(!std::strcmp(ser->fields[i].name, ser_b->fields[i].name));
    CHECK(field_value(ser->fields[i]) == field_value(ser_b->fields[i]));
  }
  IPluginV3* cl = a->clone();
  CHECK(cl != nullptr && cl != a.get());
  a.reset();
  IPluginV3OneCore* core = core_of(cl);
  CHECK(!std::strcmp(core->getPluginName(), op) && !std::strcmp(core->getPluginNamespace(), "ai.attncal"));
  IPluginV3OneRuntime* rt_c = runtime_of(cl);
  check_clone_fields(rt_c->getFieldsToSerialize());
  IPluginV3* attached = rt_c->attachToContext(nullptr);
  CHECK(attached != nullptr && attached != cl);
  delete attached;
  delete cl;
}

}  // namespace trt_host_test

#endif  // ATTNCAL_TESTS_CPP_TRT_HOST_TEST_COMMON_H_
