#include "parallel/parallel_generate.h"

namespace k3::parallel {

cpu::GenerateResult generate(const ParallelCpuBackbone& model, const cpu::GenerateRequest& req,
                             const std::function<void(int64_t)>& on_token) {
  ParallelState st = model.new_state(0);
  return cpu::generate_loop(
      req, model.config().vocab_size, model.config().eos_token_ids, model.max_context(),
      [&](const std::vector<int64_t>& prompt, float* logits) {
        for (int64_t t : prompt) model.step({&st}, {t}, logits);
      },
      [&](int64_t tok, float* logits) { model.step({&st}, {tok}, logits); }, on_token);
}

}  // namespace k3::parallel
