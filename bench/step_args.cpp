// k3_bench_step's command line.
#include "step_args.h"

#include <algorithm>
#include <cstdlib>

#include "core/error.h"

namespace k3::bench {

namespace {

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = (*end == ',') ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

}  // namespace

StepArgs parse_step_args(int argc, char** argv) {
  StepArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--layers")
      a.layers = std::atoi(v), ++i;
    else if (k == "--tp")
      a.tp = std::atoi(v), ++i;
    else if (k == "--ep")
      a.ep = std::atoi(v), ++i;
    else if (k == "--replays")
      a.replays = std::atoi(v), ++i;
    else if (k == "--dir")
      a.dir = v, ++i;
    else if (k == "--dsa")
      a.dsa = true;
    else if (k == "--template-layers")
      a.template_layers = std::atoi(v), ++i;
    else if (k == "--no-profile")
      a.profile = false;
    else if (k == "--no-flips")
      a.flips = false;
    else if (k == "--flips-matching")
      a.flips_matching = v, ++i;
    else if (k == "--flip-repeats")
      a.flip_repeats = std::max(1, std::atoi(v)), ++i;
    else if (k == "--no-tuning")
      a.tuning = false;
    else if (k == "--trace")
      a.trace = true;
    else if (k == "--paths") {
      a.paths.clear();
      for (std::string p = v; !p.empty();) {
        const size_t c = p.find(',');
        a.paths.push_back(p.substr(0, c));
        p = c == std::string::npos ? "" : p.substr(c + 1);
      }
      ++i;
    } else if (k == "--batch") {
      a.batches.clear();
      for (int64_t b : parse_list(v)) a.batches.push_back(static_cast<int>(b));
      ++i;
    } else if (k == "--verify-q") {
      a.verify_q.clear();
      for (int64_t q : parse_list(v))
        if (q > 1) a.verify_q.push_back(static_cast<int>(q));
      ++i;
    } else if (k == "--context")
      a.contexts = parse_list(v), ++i;
    else
      fail("unknown argument ", k);
  }
  return a;
}

}  // namespace k3::bench
