#include <cstdio>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/weight_table.h"

namespace k3::cli {
namespace {

void print_list(const char* title, const std::vector<std::string>& items, size_t limit) {
  std::printf("%s: %zu\n", title, items.size());
  for (size_t i = 0; i < items.size() && i < limit; ++i) std::printf("  %s\n", items[i].c_str());
  if (items.size() > limit) std::printf("  ... and %zu more\n", items.size() - limit);
}

}  // namespace

void register_inspect(CLI::App& app) {
  struct Opts {
    std::string dir;
    bool list = false;
    size_t limit = 20;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("inspect", "check a checkpoint against its config.json");
  sub->add_option("checkpoint", o->dir, "checkpoint directory")->required();
  sub->add_flag("--list", o->list, "list every tensor");
  sub->add_option("--limit", o->limit, "entries shown per problem list")->capture_default_str();
  sub->callback([o] {
    const ModelConfig cfg = load_model_config(o->dir + "/config.json");
    const auto ckpt = Checkpoint::open(o->dir);
    std::printf("model: %s (%s), %d layers: %d KDA + %d MLA%s, hidden %lld, %d experts top-%d%s\n",
                cfg.architecture.c_str(), cfg.model_type.c_str(), cfg.num_hidden_layers,
                cfg.num_kda_layers(), cfg.num_mla_layers(), cfg.has_dsa() ? " (DSA indexer)" : "",
                static_cast<long long>(cfg.hidden_size), cfg.num_experts, cfg.num_experts_per_token,
                cfg.experts_mxfp4() ? " MXFP4" : "");
    std::printf("checkpoint: %s, %zu shard(s), %zu tensors, %.3f GB\n", o->dir.c_str(),
                ckpt->num_shards(), ckpt->names().size(), ckpt->total_bytes() / 1e9);
    if (o->list) {
      for (const auto& n : ckpt->names()) {
        const TensorView& t = ckpt->tensor(n);
        std::printf("  %-80s %-8s %s\n", n.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                    shape_str(t.shape).c_str());
      }
    }
    const WeightCheck r = check_weights(*ckpt, weight_table(cfg));
    std::printf("bytes by kind:\n");
    for (const auto& [kind, bytes] : r.bytes_by_kind)
      std::printf("  %-16s %12.3f GB\n", std::string(weight_kind_name(kind)).c_str(), bytes / 1e9);
    print_list("missing", r.missing, o->limit);
    print_list("mismatched", r.mismatched, o->limit);
    print_list("unknown (ignored)", r.unknown, o->limit);
    K3_CHECK(r.ok(), "checkpoint ", o->dir, " does not match its config (", r.missing.size(),
             " missing, ", r.mismatched.size(), " mismatched)");
    std::printf("ok\n");
  });
}

}  // namespace k3::cli
