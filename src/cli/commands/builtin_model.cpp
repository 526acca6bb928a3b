#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "synth/presets.h"
#include "synth/synthesize.h"

namespace k3::cli {

// Bump when the tiny preset or the synth value recipe changes, so stale caches are not reused.
constexpr const char* kBuiltinTinyVersion = "tiny-v3";

std::string builtin_tiny_model_dir() {
  namespace fs = std::filesystem;
  fs::path root;
  if (const char* d = std::getenv("K3_CACHE_DIR"); d && *d)
    root = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    root = fs::path(x) / "k3";
  else if (const char* h = std::getenv("HOME"); h && *h)
    root = fs::path(h) / ".cache" / "k3";
  else
    root = fs::temp_directory_path() / "k3";
  const fs::path dir = root / kBuiltinTinyVersion;
  if (fs::exists(dir / "model.safetensors.index.json")) return dir.string();

  std::fprintf(stderr, "k3: synthesizing the built-in tiny model into %s\n", dir.c_str());
  // Written to a private directory and renamed, so a concurrent first use never reads half.
  const fs::path tmp =
      root / (std::string(kBuiltinTinyVersion) + ".tmp." + std::to_string(getpid()));
  fs::create_directories(tmp);
  SynthOptions so;
  so.seed = 1;
  synthesize_checkpoint(synth_preset("tiny"), tmp.string(), so);
  std::error_code ec;
  fs::rename(tmp, dir, ec);
  if (ec) {  // another process won the race: use its copy
    fs::remove_all(tmp);
    K3_CHECK(fs::exists(dir / "model.safetensors.index.json"), "cannot create ", dir.string(), ": ",
             ec.message());
  }
  return dir.string();
}

}  // namespace k3::cli
