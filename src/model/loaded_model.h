// A model ready to run: config.json parsed, checkpoint mmap'd and validated, weights bound.
#pragma once

#include <memory>
#include <string>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3 {

struct LoadedModel {
  std::string dir;
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;  // views into *checkpoint

  // Reads dir/config.json and the checkpoint in dir; every problem is a k3::Error.
  static std::unique_ptr<LoadedModel> load(const std::string& dir);
};

}  // namespace k3
