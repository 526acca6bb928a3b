// The K3.1 DSA lightning indexer inside the stock CUDA step (cpu/layer_mla.cpp dsa_select):
// cache this token's index key, score every cached key, keep the top index_topk.
#include <cmath>

#include "cuda/backbone.h"
#include "cuda/backbone_buffers.h"
#include "cuda/dsa_indexer.h"

namespace k3::cuda {

void CudaBackbone::dsa_select(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevMla& m = weights_->layers[static_cast<size_t>(l)].mla;
  const DevDsa& d = m.indexer;
  const auto& dc = cfg_.dsa_config;
  const int64_t H = cfg_.hidden_size, ql = m.q_a.rows;
  const int hd = dc.index_head_dim, nh = dc.index_n_heads;
  const bool layer_norm = dc.index_k_norm_type == "layernorm";

  linear(d.wk, b.x.data(), H, R, b.dsa_key.data(), hd, false, stream_);
  dsa_index_key_append(b.dsa_key.data(), R, hd, d.k_norm_w, layer_norm ? d.k_norm_b : nullptr,
                       cfg_.rms_norm_eps, b.row_table.data(), pool_->pages_per_slot(),
                       b.row_pos.data(), pool_->page_size(), pool_->index_keys(l),
                       pool_->index_scales(l), stream_);
  // Query heads from the normed q latent; per-head weights from x.
  linear(d.wq_b, b.mla_r.data(), ql, R, b.dsa_q.data(), static_cast<int64_t>(nh) * hd, false,
         stream_);
  linear(d.weights_proj, b.x.data(), H, R, b.dsa_w.data(), nh, false, stream_);
  dsa_index_scores(b.dsa_q.data(), b.dsa_w.data(),
                   1.0f / std::sqrt(static_cast<float>(nh) * static_cast<float>(hd)), R, nh, hd,
                   pool_->index_keys(l), pool_->index_scales(l), b.row_table.data(),
                   pool_->pages_per_slot(), b.row_seq.data(), pool_->page_size(),
                   b.dsa_scores.data(), pool_->max_context(), dsa_tensor_cores(), stream_);
  dsa_topk(b.dsa_scores.data(), pool_->max_context(), b.row_seq.data(), R, dc.index_topk,
           b.dsa_sel.data(), b.dsa_nsel.data(), b.dsa_ws.data(), dsa_topk_split(), stream_);
}

}  // namespace k3::cuda
