#include "spec/verify_cpu.h"

#include "core/error.h"

namespace k3::spec {

void cpu_verify(const cpu::CpuBackbone& model, cpu::DecodeState& st,
                std::span<const int64_t> tokens, float* logits, VerifyScratch& sc, float* hidden) {
  // logits: [q][vocab] fp32.
  K3_CHECK(!tokens.empty(), "a verify step needs at least one token");
  const auto vocab = static_cast<size_t>(model.config().vocab_size);
  const size_t q = tokens.size();
  sc.start = st.position;
  sc.rows = static_cast<int64_t>(q);
  if (sc.snaps.size() < q - 1) sc.snaps.resize(q - 1);
  for (size_t i = 0; i < q; ++i) {
    const auto H = static_cast<size_t>(model.config().hidden_size);
    model.step_hidden(st, tokens[i], logits + i * vocab, hidden ? hidden + i * H : nullptr);
    if (i + 1 < q) sc.snaps[i].capture_into(st);  // the last row's state is the live one
  }
}

void cpu_commit(cpu::DecodeState& st, const VerifyScratch& sc, int64_t consumed) {
  K3_CHECK(consumed >= 1 && consumed <= sc.rows, "commit of ", consumed,
           " tokens after a verify step of ", sc.rows);
  K3_CHECK(st.position == sc.start + sc.rows, "commit: the state moved since its verify step");
  if (consumed == sc.rows) return;
  sc.snaps[static_cast<size_t>(consumed - 1)].restore(st);
  st.truncate(sc.start + consumed);
}

}  // namespace k3::spec
