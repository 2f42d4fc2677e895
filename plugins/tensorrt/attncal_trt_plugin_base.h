// What the calibration plugin (attncal_trt_plugin.cpp) and the calibrated-attention plugin
// (attncal_trt_attention_plugin.cpp) do the same way, so that it is written once: the plugin's
// capabilities (core, build, runtime), identity (op name, version "1", namespace), one output, its
// attributes to serialise (the calibration fields, then the op's own) and its re-creation for a
// context; the creator's identity and field names.  Each plugin keeps its shapes, types, formats,
// workspace, enqueue and clone; each creator its parsing.
#ifndef ATTNCAL_TRT_PLUGIN_BASE_H_
#define ATTNCAL_TRT_PLUGIN_BASE_H_

#include <NvInferRuntime.h>

#include <cstring>
#include <initializer_list>
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

  // The fields to serialise: p's calibration attributes (every one but layer, which is not kept;
  // pool_last only when !p.all_rows), then `extra`; all point into the plugin (p: its member).
  void set_fields(AttncalParams& p, std::initializer_list<nvinfer1::PluginField> extra = {}) {
    int32_t i = 0;
    for (FieldSpec const& fs : kFields) {
      if ((p.all_rows && !strcmp(fs.name, "pool_last")) || !strcmp(fs.name, "layer")) continue;
      if (fs.is_float) {
        fields_[i++] = nvinfer1::PluginField(fs.name, float_slot(p, fs.name), nvinfer1::PluginFieldType::kFLOAT32, 1);
      } else {
        fields_[i++] = nvinfer1::PluginField(fs.name, int_slot(p, fs.name), nvinfer1::PluginFieldType::kINT32, 1);
      }
    }
    for (nvinfer1::PluginField const& f : extra) fields_[i++] = f;
    fc_.nbFields = i;
    fc_.fields = fields_;
  }

  std::string name_, ns_;

 private:
  nvinfer1::PluginField fields_[16];
  nvinfer1::PluginFieldCollection fc_{};
};

// A creator of op `op` (version "1") in namespace `ns`.  Its field names: the calibration fields
// (pool_last only when !all_rows; layer included, it is accepted), then `extra`.
class CreatorBase : public nvinfer1::IPluginCreatorV3One {
 public:
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &fc_; }
  char const* getPluginName() const noexcept override { return op_.c_str(); }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return ns_.c_str(); }

 protected:
  CreatorBase(char const* op, char const* ns, bool all_rows, std::initializer_list<nvinfer1::PluginField> extra = {})
      : op_(op), ns_(ns), all_rows_(all_rows) {
    for (FieldSpec const& fs : kFields) {
      if (all_rows_ && !strcmp(fs.name, "pool_last")) continue;
      names_.emplace_back(fs.name, nullptr,
                          fs.is_float ? nvinfer1::PluginFieldType::kFLOAT32 : nvinfer1::PluginFieldType::kINT32, 1);
    }
    names_.insert(names_.end(), extra.begin(), extra.end());
    fc_.nbFields = static_cast<int32_t>(names_.size());
    fc_.fields = names_.data();
  }

  std::string op_, ns_;
  bool all_rows_;

 private:
  std::vector<nvinfer1::PluginField> names_;
  nvinfer1::PluginFieldCollection fc_{};
};

}  // namespace attncal_trt

#endif  // ATTNCAL_TRT_PLUGIN_BASE_H_
