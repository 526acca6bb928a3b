#include "cuda/device_weights.h"

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/linear_bf16.h"
#include "cuda/linear_mxfp4.h"
#include "cuda/step_ops.h"

namespace k3::cuda {

void linear(const DevMatrix& w, const __nv_bfloat16* x, int64_t ldx, int64_t M, void* y,
            int64_t ldy, bool y_fp32, cudaStream_t stream) {
  K3_CHECK(!w.empty(), "linear: empty weight");
  switch (w.format) {
    case WeightFormat::BF16:
      linear_bf16(x, ldx, w.bf16(), M, w.rows, w.cols, y, ldy, y_fp32, stream);
      return;
    case WeightFormat::MXFP4:
      linear_mxfp4(x, ldx, static_cast<const uint8_t*>(w.data), w.scales, M, w.rows, w.cols, y, ldy,
                   y_fp32, stream);
      return;
    case WeightFormat::F32:
      linear_f32w(x, ldx, static_cast<const float*>(w.data), M, w.rows, w.cols, y, ldy, y_fp32,
                  stream);
      return;
    case WeightFormat::F16:
      break;
  }
  fail("linear: weight format ", weight_format_name(w.format), " has no GPU kernel");
}

void linear(const DevMatrix& w, const __nv_bfloat16* x, int64_t ldx, int64_t M, __nv_bfloat16* y,
            int64_t ldy, const LinearEpilogue& epi, cudaStream_t stream) {
  if (epi.empty()) {
    linear(w, x, ldx, M, y, ldy, false, stream);
    return;
  }
  K3_CHECK(!w.empty() && w.format == WeightFormat::BF16,
           "linear: a fused residual add needs a bf16 weight, got ", weight_format_name(w.format));
  linear_bf16(x, ldx, w.bf16(), M, w.rows, w.cols, y, ldy, epi, stream);
}

namespace {
// Bytes of one row of the data array (BF16, MXFP4 packed) and of the MXFP4 scales array.
int64_t data_row_bytes(const WeightMatrix& m) {
  return m.format == WeightFormat::MXFP4 ? m.cols / 2 : m.cols * 2;
}
int64_t scale_row_bytes(const WeightMatrix& m) {
  return m.format == WeightFormat::MXFP4 ? m.cols / 32 : 0;
}
// The experts a MoE layer's weights hold: all of them, or the contiguous range an
// expert-parallel rank keeps (parallel::RankWeights leaves the others empty).
LocalExperts held_experts(const MoeWeights& m, int layer) {
  const auto held = [&](size_t e) {
    const ExpertWeights& x = m.experts[e];
    const int n = !x.w1.empty() + !x.w3.empty() + !x.w2.empty();
    K3_CHECK(n == 0 || n == 3, "MoE layer ", layer, " expert ", e, " has ", n,
             " of its w1 / w3 / w2 matrices");
    return n == 3;
  };
  LocalExperts r{-1, 0};
  for (size_t e = 0; e < m.experts.size(); ++e) {
    if (!held(e)) continue;
    if (r.begin < 0) r.begin = static_cast<int>(e);
    K3_CHECK(r.begin + r.count == static_cast<int>(e), "MoE layer ", layer,
             ": the held experts are not one contiguous range (expert ", e, " after a gap)");
    ++r.count;
  }
  K3_CHECK(r.count > 0, "MoE layer ", layer, " holds no experts");
  return r;
}

}  // namespace

bool can_concat(const std::vector<const WeightMatrix*>& ms) {
  if (ms.empty() || !ms[0]) return false;
  const WeightFormat f = ms[0]->format;
  if (f != WeightFormat::BF16 && f != WeightFormat::MXFP4) return false;
  const bool mx = f == WeightFormat::MXFP4;
  int64_t row = 0;  // first row of the current member in the combined matrix
  for (const WeightMatrix* m : ms) {
    if (!m || m->empty() || m->format != f || m->cols != ms[0]->cols || m->rows <= 0) return false;
    if (mx && (m->cols % 32 != 0 || !m->scales)) return false;
    // cudaMalloc bases are 256-byte aligned: the view offsets decide.
    if (row * data_row_bytes(*m) % 16 != 0) return false;
    if (mx && row * scale_row_bytes(*m) % 8 != 0) return false;
    row += m->rows;
  }
  return true;
}

uint8_t* DeviceWeights::alloc_bytes(size_t n) {
  auto buf = std::make_shared<DeviceBuffer<uint8_t>>(n);
  bytes_ += buf->bytes();
  uint8_t* p = buf->data();
  owned_.push_back(std::move(buf));
  return p;
}

DevConcat DeviceWeights::upload_concat(const std::vector<const WeightMatrix*>& ms) {
  DevConcat c;
  if (!can_concat(ms)) {  // apart, as the stock path always had them
    for (const WeightMatrix* m : ms) c.parts.push_back(upload(*m));
    return c;
  }
  const WeightMatrix& first = *ms[0];
  const bool mx = first.format == WeightFormat::MXFP4;
  const int64_t drb = data_row_bytes(first), srb = scale_row_bytes(first);
  int64_t rows = 0;
  for (const WeightMatrix* m : ms) rows += m->rows;
  uint8_t* data = alloc_bytes(static_cast<size_t>(rows * drb));                   // [rows][drb] u8
  uint8_t* scales = mx ? alloc_bytes(static_cast<size_t>(rows * srb)) : nullptr;  // [rows][srb]
  int64_t row = 0;
  for (const WeightMatrix* m : ms) {
    DevMatrix v;
    v.format = first.format;
    v.rows = m->rows;
    v.cols = first.cols;
    uint8_t* d = data + row * drb;
    K3_CUDA_CHECK(
        cudaMemcpy(d, m->data, static_cast<size_t>(m->rows * drb), cudaMemcpyHostToDevice));
    v.data = d;
    if (mx) {
      uint8_t* s = scales + row * srb;
      K3_CUDA_CHECK(
          cudaMemcpy(s, m->scales, static_cast<size_t>(m->rows * srb), cudaMemcpyHostToDevice));
      v.scales = s;
    }
    c.parts.push_back(v);
    row += m->rows;
  }
  c.combined.format = first.format;
  c.combined.rows = rows;
  c.combined.cols = first.cols;
  c.combined.data = data;
  c.combined.scales = scales;
  return c;
}

template <typename T>
const T* DeviceWeights::keep(std::vector<T> host) {
  auto buf = std::make_shared<DeviceBuffer<T>>(host.size());
  copy_to_device(*buf, host.data(), host.size());
  bytes_ += buf->bytes();
  const T* p = buf->data();
  owned_.push_back(std::move(buf));
  return p;
}

DevMatrix DeviceWeights::upload(const WeightMatrix& m) {
  DevMatrix d;
  if (m.empty()) return d;
  d.format = m.format;
  d.rows = m.rows;
  d.cols = m.cols;
  const auto bytes_of = [](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    return std::vector<uint8_t>(b, b + n);
  };
  switch (m.format) {
    case WeightFormat::BF16:
      d.data = keep(bytes_of(m.data, static_cast<size_t>(m.rows * m.cols * 2)));
      break;
    case WeightFormat::MXFP4:
      d.data = keep(bytes_of(m.data, static_cast<size_t>(m.rows * m.cols / 2)));
      d.scales = keep(bytes_of(m.scales, static_cast<size_t>(m.rows * m.cols / 32)));
      break;
    case WeightFormat::F32:
      d.data = keep(bytes_of(m.data, static_cast<size_t>(m.rows * m.cols * 4)));
      break;
    case WeightFormat::F16:
      fail("tensor ", m.name,
           " is float16; the CUDA path reads bf16, fp32 and MXFP4 weights (convert the "
           "checkpoint or run on the CPU)");
  }
  return d;
}

const float* DeviceWeights::upload_floats(const std::vector<float>& v) {
  return v.empty() ? nullptr : keep(v);
}

DeviceWeights::DeviceWeights(const ModelConfig& cfg, const ModelWeights& w) {
  K3_CHECK(w.embed.format == WeightFormat::BF16, "the CUDA path needs a bf16 embedding; ",
           w.embed.name, " is ", weight_format_name(w.embed.format));
  embed = upload(w.embed);
  lm_head = upload(w.lm_head);
  final_norm = upload_floats(w.final_norm);
  output_attn_res = upload_floats(w.output_attn_res);
  layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    DevLayer& D = layers[l];
    D.kind = L.kind;
    D.moe = L.moe;
    D.input_norm = upload_floats(L.input_norm);
    D.post_attn_norm = upload_floats(L.post_attn_norm);
    D.attn_res_attn = upload_floats(L.attn_res_attn);
    D.attn_res_mlp = upload_floats(L.attn_res_mlp);
    if (L.kind == LayerKind::KDA) {
      const KdaWeights& k = L.kda;
      DevKda& d = D.kda;
      // Everything that reads x in one allocation. Exactly one output gate form may take part
      // (with both present the fused path could not tell which one the g rows are).
      const bool lora_gate = k.g_proj.empty();
      const WeightMatrix& g = lora_gate ? k.g_a : k.g_proj;
      const std::vector<const WeightMatrix*> in = {&k.q_proj, &k.k_proj, &k.v_proj,
                                                   &g,        &k.f_a,    &k.b_proj};
      DevConcat fused;
      if (k.g_proj.empty() != k.g_a.empty())
        fused = upload_concat(in);
      else
        for (const WeightMatrix* m : in) fused.parts.push_back(upload(*m));
      d.q_proj = fused.parts[0];
      d.k_proj = fused.parts[1];
      d.v_proj = fused.parts[2];
      (lora_gate ? d.g_a : d.g_proj) = fused.parts[3];
      (lora_gate ? d.g_proj : d.g_a) = upload(lora_gate ? k.g_proj : k.g_a);
      d.f_a = fused.parts[4];
      d.b_proj = fused.parts[5];
      d.f_b = upload(k.f_b);
      d.g_b = upload(k.g_b);
      d.o_proj = upload(k.o_proj);
      if (!fused.combined.empty()) {
        d.in_proj = fused.combined;
        KdaInProjLayout& o = d.in_layout;
        o.q = 0;
        o.k = o.q + d.q_proj.rows;
        o.v = o.k + d.k_proj.rows;
        o.g = o.v + d.v_proj.rows;
        o.fa = o.g + fused.parts[3].rows;
        o.b = o.fa + d.f_a.rows;
        o.n = o.b + d.b_proj.rows;
        o.ld = (o.n + 7) / 8 * 8;
      }
      // The fused kernel reads [3 (q,k,v)][P][kernel] fp32.
      std::vector<float> conv;
      for (const WeightMatrix* c : {&k.q_conv, &k.k_conv, &k.v_conv}) {
        std::vector<float> rows(static_cast<size_t>(c->rows * c->cols));
        for (int64_t r = 0; r < c->rows; ++r) c->row_to_float(r, rows.data() + r * c->cols);
        conv.insert(conv.end(), rows.begin(), rows.end());
      }
      d.conv = keep(std::move(conv));
      d.dt_bias = upload_floats(k.dt_bias);
      d.a_log = upload_floats(k.a_log);
      d.o_norm = upload_floats(k.o_norm);
    } else {
      const MlaWeights& m = L.mla;
      DevMla& d = D.mla;
      d.q_a = upload(m.q_a);
      d.q_b = upload(m.q_b);
      d.q_proj = upload(m.q_proj);
      d.kv_a = upload(m.kv_a);
      K3_CHECK(m.kv_b.format == WeightFormat::BF16, "the CUDA MLA path needs a bf16 kv_b_proj; ",
               m.kv_b.name, " is ", weight_format_name(m.kv_b.format));
      d.kv_b = upload(m.kv_b);
      d.g_proj = upload(m.g_proj);
      d.o_proj = upload(m.o_proj);
      d.q_a_norm = upload_floats(m.q_a_norm);
      d.kv_a_norm = upload_floats(m.kv_a_norm);
      if (m.indexer) {
        d.has_indexer = true;
        d.indexer.wq_b = upload(m.indexer->wq_b);
        d.indexer.wk = upload(m.indexer->wk);
        d.indexer.weights_proj = upload(m.indexer->weights_proj);
        d.indexer.k_norm_w = upload_floats(m.indexer->k_norm_w);
        d.indexer.k_norm_b = upload_floats(m.indexer->k_norm_b);
      }
    }
    if (L.moe) {
      const MoeWeights& m = L.moe_w;
      DevMoe& d = D.moe_w;
      d.gate = upload(m.gate);
      d.score_bias = upload_floats(m.score_bias);
      d.latent_down = upload(m.latent_down);
      d.latent_up = upload(m.latent_up);
      d.latent_norm = upload_floats(m.latent_norm);
      DevConcat su = upload_concat({&m.shared_gate, &m.shared_up});
      d.shared_gate = su.parts[0];
      d.shared_up = su.parts[1];
      d.shared_gate_up = su.combined;
      d.shared_down = upload(m.shared_down);
      d.local = held_experts(m, l);
      const ExpertWeights& first = m.experts[static_cast<size_t>(d.local.begin)];
      d.expert_format = first.w1.format;
      K3_CHECK(d.expert_format == WeightFormat::MXFP4 || d.expert_format == WeightFormat::BF16,
               "the CUDA path runs MXFP4 or bf16 experts; layer ", l, " has ",
               weight_format_name(d.expert_format));
      d.inter = first.w1.rows;
      d.io = first.w1.cols;
      std::vector<const void*> w1, w3, w2;
      std::vector<const uint8_t*> s1, s3, s2;
      bool w13 = true;  // every expert's [w1; w3] in one allocation
      for (int i = 0; i < d.local.count; ++i) {
        const ExpertWeights& e = m.experts[static_cast<size_t>(d.local.begin + i)];
        for (const WeightMatrix* x : {&e.w1, &e.w3, &e.w2})
          K3_CHECK(x->format == d.expert_format, "expert ", x->name, " is ",
                   weight_format_name(x->format), ", the other experts ",
                   weight_format_name(d.expert_format));
        const DevConcat p = upload_concat({&e.w1, &e.w3});
        w13 = w13 && !p.combined.empty() && e.w1.rows == d.inter && e.w3.rows == d.inter &&
              e.w1.cols == d.io;
        const DevMatrix a = p.parts[0], b = p.parts[1], c = upload(e.w2);
        w1.push_back(a.data);
        w3.push_back(b.data);
        w2.push_back(c.data);
        s1.push_back(a.scales);
        s3.push_back(b.scales);
        s2.push_back(c.scales);
      }
      d.w1 = keep(std::move(w1));
      d.w3 = keep(std::move(w3));
      d.w2 = keep(std::move(w2));
      d.w1_scales = keep(std::move(s1));
      d.w3_scales = keep(std::move(s3));
      d.w2_scales = keep(std::move(s2));
      if (w13) {  // w1[e] already points at the fused pair: share the tables
        d.w13 = d.w1;
        d.w13_scales = d.expert_format == WeightFormat::MXFP4 ? d.w1_scales : nullptr;
      }
    } else if (!L.dense.gate.empty()) {
      DevConcat gu = upload_concat({&L.dense.gate, &L.dense.up});
      D.dense.gate = gu.parts[0];
      D.dense.up = gu.parts[1];
      D.dense.gate_up = gu.combined;
      D.dense.down = upload(L.dense.down);
    }
  }
  K3_CHECK(static_cast<int>(layers.size()) == cfg.num_hidden_layers, "weights bound for ",
           layers.size(), " layers, config has ", cfg.num_hidden_layers);
}

}  // namespace k3::cuda
