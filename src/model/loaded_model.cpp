#include "model/loaded_model.h"

#include <filesystem>

#include "core/error.h"

namespace k3 {

std::unique_ptr<LoadedModel> LoadedModel::load(const std::string& dir) {
  K3_CHECK(std::filesystem::is_directory(dir), "model directory ", dir, " does not exist");
  auto m = std::make_unique<LoadedModel>();
  m->dir = dir;
  m->config = load_model_config((std::filesystem::path(dir) / "config.json").string());
  m->checkpoint = Checkpoint::open(dir);
  m->weights = bind_weights(m->config, *m->checkpoint);
  return m;
}

}  // namespace k3
