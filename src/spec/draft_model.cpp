#include "spec/draft_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/ops_basic.h"
#include "spec/target_probs.h"
#include "synth/presets.h"
#include "synth/synthesize.h"

namespace k3::spec {
namespace {

// A [hidden] bf16 vector of the draft head as floats.
std::vector<float> head_vector(const SafetensorsFile& f, const char* name, int64_t hidden) {
  const TensorView& t = f.tensor(name);
  const bool ok = t.dtype == DType::BF16 && t.shape == Shape{hidden};
  K3_CHECK(ok, f.path(), ": ", name, " must be bf16 [", hidden, "]");
  std::vector<float> out(static_cast<size_t>(hidden));
  for (int64_t i = 0; i < hidden; ++i) {
    uint16_t h;
    std::memcpy(&h, t.data + 2 * i, 2);
    out[static_cast<size_t>(i)] = bf16_to_float(h);
  }
  return out;
}

}  // namespace

std::unique_ptr<DraftModel> DraftModel::load(const std::string& dir, const ModelConfig& target) {
  auto m = std::unique_ptr<DraftModel>(new DraftModel());
  m->model_ = LoadedModel::load(dir);
  const ModelConfig& c = m->model_->config;
  K3_CHECK(c.hidden_size == target.hidden_size, "draft model ", dir, ": hidden_size ",
           c.hidden_size, " differs from the target's ", target.hidden_size);
  K3_CHECK(c.vocab_size == target.vocab_size, "draft model ", dir, ": vocab_size ", c.vocab_size,
           " differs from the target's ", target.vocab_size);
  for (int l = 0; l < c.num_hidden_layers; ++l)
    K3_CHECK(c.layer_kind(l) == LayerKind::MLA, "draft model ", dir, ": layer ", l,
             " is not an MLA layer (a draft is dense MLA only)");
  const std::string head = (std::filesystem::path(dir) / kDraftHeadFile).string();
  K3_CHECK(std::filesystem::exists(head), "draft model ", dir, ": ", kDraftHeadFile,
           " (the draft head) is missing");
  m->head_ = SafetensorsFile::open(head);
  const int64_t H = c.hidden_size;
  const TensorView& eh = m->head_->tensor("eh_proj.weight");
  const bool eh_ok = eh.dtype == DType::BF16 && eh.shape == Shape{H, 2 * H};
  K3_CHECK(eh_ok, head, ": eh_proj.weight must be bf16 [", H, ", ", 2 * H, "]");
  m->eh_proj_ = WeightMatrix::from_tensor(eh);
  m->enorm_ = head_vector(*m->head_, "enorm.weight", H);
  m->hnorm_ = head_vector(*m->head_, "hnorm.weight", H);
  m->backbone_ = std::make_unique<cpu::CpuBackbone>(c, m->model_->weights,
                                                    cpu::StateDtypes{DType::BF16, DType::F32});
  return m;
}

void DraftModel::fuse(int64_t token, const float* hidden, float* out) const {
  // hidden: [H] target (or draft) final-normed hidden; out: [H].
  const ModelConfig& c = model_->config;
  K3_CHECK(token >= 0 && token < c.vocab_size, "draft token ", token, " outside the vocabulary");
  const auto H = static_cast<size_t>(c.hidden_size);
  std::vector<float> e(H), cat(2 * H);  // [H], [2H]
  model_->weights.embed.row_to_float(token, e.data());
  cpu::rms_norm(e.data(), enorm_.data(), c.hidden_size, c.rms_norm_eps, cat.data());
  cpu::rms_norm(hidden, hnorm_.data(), c.hidden_size, c.rms_norm_eps, cat.data() + H);
  for (float& v : cat) v = round_bf16(v);  // a GEMM input, stored bf16 on the GPU path
  cpu::linear(eh_proj_, cat.data(), out);
  for (size_t i = 0; i < H; ++i) out[i] = round_bf16(out[i]);
}

DraftModelDrafter::DraftModelDrafter(const DraftModel& m, const cpu::SamplingParams& sp)
    : m_(m),
      sampling_(sp),
      rng_(sp.seed ^ 0xd2af7ull),
      st_(m.backbone().new_state()),
      logits_(static_cast<size_t>(m.vocab_size())),
      hidden_(static_cast<size_t>(m.hidden_size())) {}

void DraftModelDrafter::observe(const float* hidden, int64_t n) {
  // hidden: [n][H].
  pending_.insert(pending_.end(), hidden, hidden + n * m_.hidden_size());
  observed_ += n;
}

int64_t pick_draft_token(const float* logits, int64_t vocab, const cpu::SamplingParams& sampling,
                         Rng& rng, DraftTokens& d) {
  int64_t tok;
  if (sampling.temperature <= 0.0f) {
    tok = cpu::argmax(logits, vocab);
  } else {
    std::vector<double> q = target_probs(logits, vocab, sampling);
    tok = draw_from(q, rng.uniform());
    d.probs.push_back(std::move(q));
  }
  d.tokens.push_back(tok);
  return tok;
}

DraftTokens DraftModelDrafter::propose(std::span<const int64_t> ctx, int n) {
  const auto H = static_cast<size_t>(m_.hidden_size());
  const auto consumed = static_cast<int64_t>(ctx.size()) - 1;  // the last token is not consumed
  K3_CHECK(observed_ == consumed, "draft model: ", observed_, " target hidden states reported for ",
           consumed, " consumed tokens");
  // A context longer than the draft's stops drafting (the target still decodes it).
  if (consumed >= m_.backbone().max_context()) {
    pending_.clear();
    return {};
  }
  // Real entries first: (x[i+1], h[i]) for every target token not fed yet.
  std::vector<float> in(H);
  const int64_t first = st_.position;
  for (int64_t i = first; i < consumed; ++i) {
    m_.fuse(ctx[static_cast<size_t>(i + 1)], pending_.data() + static_cast<size_t>(i - first) * H,
            in.data());
    m_.backbone().step_hidden(st_, 0, logits_.data(), hidden_.data(), in.data());
  }
  pending_.clear();
  DraftTokens d;
  n = static_cast<int>(
      std::min<int64_t>(n, m_.backbone().max_context() - st_.position));  // chained entries fit
  if (n <= 0 || st_.position == 0) return d;
  // Chained entries: the draft's own hidden state stands in for the target's.
  std::vector<float> logits = logits_, hidden = hidden_;  // [vocab], [H]
  int64_t tok = pick_draft_token(logits.data(), m_.vocab_size(), sampling_, rng_, d);
  for (int k = 1; k < n; ++k) {
    m_.fuse(tok, hidden.data(), in.data());
    m_.backbone().step_hidden(st_, 0, logits.data(), hidden.data(), in.data());
    tok = pick_draft_token(logits.data(), m_.vocab_size(), sampling_, rng_, d);
  }
  st_.truncate(consumed);  // drop the chained entries
  return d;
}

void synthesize_draft_checkpoint(const ModelConfig& target, const std::string& dir, uint64_t seed) {
  ModelConfig c = synth_preset("tiny-draft");
  c.hidden_size = target.hidden_size;
  c.vocab_size = target.vocab_size;
  c.bos_token_id = target.bos_token_id;
  c.eos_token_ids = target.eos_token_ids;
  c.pad_token_id = target.pad_token_id;
  SynthOptions so;
  so.seed = seed;
  synthesize_checkpoint(c, dir, so);
  synthesize_draft_head(c, dir, seed);
}

void synthesize_draft_head(const ModelConfig& c, const std::string& dir, uint64_t seed) {
  // Draft head: eh_proj N(0, 1/fan_in), norm weights 1 + N(0, 0.1), as the synthesizer draws.
  const int64_t H = c.hidden_size;
  const std::vector<TensorSpec> specs = {{"eh_proj.weight", DType::BF16, {H, 2 * H}},
                                         {"enorm.weight", DType::BF16, {H}},
                                         {"hnorm.weight", DType::BF16, {H}}};
  write_safetensors((std::filesystem::path(dir) / kDraftHeadFile).string(), specs, {},
                    [&](size_t index, uint8_t* out, size_t nbytes) {
                      Rng r(seed * 1000003u + index + 1);
                      const float scale = index == 0 ? 1.0f / std::sqrt(2.0f * H) : 0.1f;
                      const float bias = index == 0 ? 0.0f : 1.0f;
                      for (size_t i = 0; i < nbytes / 2; ++i) {
                        const uint16_t h = float_to_bf16(bias + scale * r.normal());
                        std::memcpy(out + 2 * i, &h, 2);
                      }
                    });
}

}  // namespace k3::spec
