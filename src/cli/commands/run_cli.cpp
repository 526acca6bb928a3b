#include <cstdio>

#include "cli/commands/commands.h"
#include "core/error.h"

namespace k3::cli {

int run_cli(int argc, char** argv) {
  CLI::App app{"k3: a decode engine for the Kimi K3 model family"};
  app.require_subcommand(1);
  register_generate(app);
  register_synth(app);
  register_inspect(app);
  register_serve(app);
  register_diff(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help or the usage error
    return code == 0 ? 0 : 2;      // usage errors exit 2, like most command-line tools
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace k3::cli
