// What the calibration plugin (attncal_trt_plugin.cpp) and the calibrated-attention plugin
// (attncal_trt_attention_plugin.cpp) do the same way, so that it is written once: the plugin's
// capabilities (core, build, runtime), identity (op name, version "1", namespace), one output, its
// attributes to serialise and its re-creation for a context; the creator's identity, field names and
// field parsing (with its refusal report).  Each plugin keeps its shapes, types, formats, workspace,
// enqueue and clone.
#ifndef ATTNCAL_TRT_PLUGIN_BASE_H_
#define ATTNCAL_TRT_PLUGIN_BASE_H_

#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attncal_trt_fields.h"

namespace attncal_trt {

// An IPluginV3 with one output whose build capability is `Build` (IPluginV3OneBuild, or
// IPluginV3OneBuildV2 for a plugin that declares aliasing).
template <class Build>
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public Build,
                   public nvinfer1::IPluginV3OneRuntime {
 public:
  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override {
    switch (type) {
      case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
      case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<Build*>(this);
      case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override { return name_.c_str(); }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return ns_.c_str(); }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 1; }

  // IPluginV3OneRuntime
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext*) noexcept override { return this->clone(); }
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &fc_; }

 protected:
  // name: the op type; ns: the creator's namespace.
  PluginBase(std::string name, std::string ns) : name_(std::move(name)), ns_(std::move(ns)) {}

  // The fields to serialise (attncal_trt_fields.h, fields_of: the op's required attributes and the
  // optional ones set to other than their default, in the table's order); they point into p, which
  // must be the plugin's member.
  void set_fields(AttncalParams& p, bool attention) {
    fields_ = fields_of(p, attention);
    fc_.nbFields = static_cast<int32_t>(fields_.size());
    fc_.fields = fields_.data();
  }

  std::string name_, ns_;

 private:
  std::vector<nvinfer1::PluginField> fields_;
  nvinfer1::PluginFieldCollection fc_{};
};

// A creator of op `op` (version "1") in namespace `ns`.  Its field names: every attribute the op
// takes (attncal_trt_fields.h, field_names), layer included: it is accepted.
class CreatorBase : public nvinfer1::IPluginCreatorV3One {
 public:
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &fc_; }
  char const* getPluginName() const noexcept override { return op_.c_str(); }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return ns_.c_str(); }

 protected:
  CreatorBase(char const* op, char const* ns, bool all_rows, bool attention)
      : op_(op), ns_(ns), all_rows_(all_rows), attention_(attention), names_(field_names(all_rows, attention)) {
    fc_.nbFields = static_cast<int32_t>(names_.size());
    fc_.fields = names_.data();
  }

  // The op's attributes from fc, or false: the reason, naming the fields, is reported
  // (report_refusal) so that a refused node is never silent.
  bool parse(nvinfer1::PluginFieldCollection const* fc, AttncalParams* p) const {
    std::string why;
    if (fc == nullptr) {
      why = "no fields";
    } else if (parse_fields(fc, all_rows_, attention_, p, &why)) {
      last_error().clear();
      return true;
    }
    report_refusal(op_.c_str(), why);
    return false;
  }

  std::string op_, ns_;
  bool all_rows_, attention_;

 private:
  std::vector<nvinfer1::PluginField> names_;
  nvinfer1::PluginFieldCollection fc_{};
};

}  // namespace attncal_trt

#endif  // ATTNCAL_TRT_PLUGIN_BASE_H_
