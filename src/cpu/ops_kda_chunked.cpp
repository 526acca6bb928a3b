// Chunk-parallel KDA recurrence (the prefill form of spec 3.2 step 6), fp32.
//
// Derivation. Per head, inside one chunk with local tokens t = 1..L and incoming state S_0:
//   S_t = D_t S_{t-1} + k_t u_t^T,  D_t = diag(exp(g_t)),  u_t = b_t (v_t - (D_t S_{t-1})^T k_t).
// Let G_t = sum_{s<=t} g_s (per key channel, cumulative log-decay from the chunk start) and
// F_ts = diag(exp(G_t - G_s)) for s <= t (the decay from token s to token t). Unrolling,
//   S_t = diag(exp(G_t)) S_0 + sum_{s<=t} F_ts k_s u_s^T,                                  (1)
// and D_t S_{t-1} is (1) minus its s = t term. Substituting into u_t:
//   u_t + sum_{s<t} M_ts u_s = b_t (v_t - S_0^T (exp(G_t) . k_t)),  M_ts = b_t k_t^T F_ts k_s,
// i.e. (I + M) U = diag(b) (V - Kd S_0) with M strictly lower triangular and row t of Kd equal
// to exp(G_t) . k_t. Because the system is linear in S_0 it splits into the WY form
//   (I + M) W = diag(b) Kd,   (I + M) Ut = diag(b) V,   U = Ut - W S_0,
// where W and Ut depend only on the chunk's own tokens (on a GPU: all chunks in parallel; the
// inverse (I + M)^-1, the "UT transform", is never formed here: forward substitution on the
// [W | Ut] right-hand sides costs the same as applying it). Outputs from (1):
//   o_t = scale ((exp(G_t) . q_t)^T S_0 + sum_{s<=t} P_ts u_s^T),  P_ts = q_t^T F_ts k_s,
// (inter-chunk part + causal intra-chunk attention, diagonal included: o reads the updated
// state), and the state advances once per chunk with (1) at t = L.
//
// Numerics: G_t reaches about -5 * 64 = -320 over a chunk, so exp(G_t) and exp(-G_s) on their own
// under/overflow in fp32; every factor used here instead has an exponent <= 0 (exp(G_t),
// exp(G_t - G_s) for s <= t, exp(G_L - G_s)), lies in [0, 1], and flushes to 0 harmlessly when
// tiny (that decay is real). The pairwise exponent G_t - G_s is accumulated directly as
// sum_{r=s+1..t} g_r, column by column, not as a difference of two prefix sums: in fp32 a prefix
// sum near -300 carries an absolute error ~1e-5 that would become a relative error of every
// decay factor (measured: chunk 64 then drifts ~2e-5 from the step form instead of ~1e-6).
// The running sums cost the same C^2 K adds as the differences would.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "cpu/ops_kda.h"

namespace k3::cpu {
namespace {

// Strided views of one head's rows: token t of a [T][heads][head_dim] tensor.
struct HeadSeq {
  const float* base;  // [T][heads][head_dim] fp32, already offset to (chunk start, head h)
  int64_t stride;     // heads * head_dim
  const float* row(int64_t t) const { return base + t * stride; }
};

}  // namespace

void kda_recurrence_chunked(float* state, const float* q, const float* k, const float* v,
                            const float* g, const float* beta, int64_t T, int heads, int head_dim,
                            float scale, int chunk_size, float* o) {
  // state: [heads][head_dim][head_dim] fp32 (rows = key channel), updated in place;
  // q, k, v, g, o: [T][heads][head_dim] fp32; beta: [T][heads] fp32
  K3_CHECK(T >= 0, "kda_recurrence_chunked: T = ", T);
  K3_CHECK(heads > 0 && head_dim > 0, "kda_recurrence_chunked: heads = ", heads,
           ", head_dim = ", head_dim);
  K3_CHECK(chunk_size >= 1, "kda_recurrence_chunked: chunk_size = ", chunk_size);
  K3_CHECK(state && q && k && v && g && beta && o, "kda_recurrence_chunked: null input/output");
  if (T == 0) return;

  const int64_t D = head_dim;                           // K = V = head_dim
  const int64_t C = std::min<int64_t>(chunk_size, T);   // no scratch beyond the longest chunk
  const int64_t tok = static_cast<int64_t>(heads) * D;  // token stride of q, k, v, g, o
  std::vector<float> cum(C * D);   // [C][K] fp32: G_t, cumulative log-decay within the chunk
  std::vector<float> M(C * C);     // [C][C] fp32: strictly lower M_ts
  std::vector<float> P(C * C);     // [C][C] fp32: lower (with diagonal) P_ts
  std::vector<float> W(C * D);     // [C][K] fp32: WY "W"
  std::vector<float> U(C * D);     // [C][V] fp32: Ut, then U = Ut - W S_0
  std::vector<float> kend(C * D);  // [C][K] fp32: exp(G_L - G_s) . k_s, keys decayed to chunk end
  std::vector<float> acc(D);       // [K] fp32: running pairwise exponent sum_{r=s+1..t} g_r
  std::vector<float> dq(D);        // [K] fp32: exp(G_t) . q_t

  for (int64_t start = 0; start < T; start += C) {
    const int64_t L = std::min(C, T - start);  // tokens in this chunk (the last may be short)
    for (int h = 0; h < heads; ++h) {
      float* S = state + h * D * D;  // [K][V] fp32, the state entering this chunk
      const int64_t off = start * tok + h * D;
      const HeadSeq qs{q + off, tok}, ks{k + off, tok}, vs{v + off, tok}, gs{g + off, tok};
      auto b = [&](int64_t t) { return beta[(start + t) * heads + h]; };

      // Prefix log-decays G_t (used only as exp(G_t): accurate relative to itself).
      for (int64_t t = 0; t < L; ++t)
        for (int64_t i = 0; i < D; ++i)
          cum[t * D + i] = gs.row(t)[i] + (t > 0 ? cum[(t - 1) * D + i] : 0.0f);

      // Intra-chunk matrices, one key column s at a time: acc = sum_{r=s+1..t} g_r is the
      // exponent of F_ts, grown as t advances; at t = L-1 it gives the key decayed to the chunk
      // end, exp(G_L - G_s) . k_s, for the state update.
      for (int64_t s = 0; s < L; ++s) {
        const float* ksr = ks.row(s);  // [K]
        for (int64_t i = 0; i < D; ++i) acc[i] = 0.0f;
        for (int64_t t = s; t < L; ++t) {
          const float* kt = ks.row(t);  // [K]
          const float* qt = qs.row(t);  // [K]
          if (t > s)
            for (int64_t i = 0; i < D; ++i) acc[i] += gs.row(t)[i];
          float kk = 0.0f, qk = 0.0f;
          for (int64_t i = 0; i < D; ++i) {
            const float decayed_ks = std::exp(acc[i]) * ksr[i];  // (F_ts k_s)_i
            kk += kt[i] * decayed_ks;
            qk += qt[i] * decayed_ks;
          }
          M[t * C + s] = t > s ? b(t) * kk : 0.0f;
          P[t * C + s] = qk;
        }
        for (int64_t i = 0; i < D; ++i) kend[s * D + i] = std::exp(acc[i]) * ksr[i];
      }

      // Forward substitution for the WY pair: row t of (I + M) [W | Ut] = b_t [Kd_t | v_t].
      for (int64_t t = 0; t < L; ++t) {
        float* Wt = &W[t * D];  // [K]
        float* Ut = &U[t * D];  // [V]
        for (int64_t i = 0; i < D; ++i) Wt[i] = b(t) * std::exp(cum[t * D + i]) * ks.row(t)[i];
        for (int64_t j = 0; j < D; ++j) Ut[j] = b(t) * vs.row(t)[j];
        for (int64_t s = 0; s < t; ++s) {
          const float m = M[t * C + s];
          for (int64_t i = 0; i < D; ++i) Wt[i] -= m * W[s * D + i];
          for (int64_t j = 0; j < D; ++j) Ut[j] -= m * U[s * D + j];
        }
      }

      // U = Ut - W S_0: the actual per-token updates u_t, given the incoming state.
      for (int64_t t = 0; t < L; ++t)
        for (int64_t i = 0; i < D; ++i) {
          const float w = W[t * D + i];
          for (int64_t j = 0; j < D; ++j) U[t * D + j] -= w * S[i * D + j];
        }

      // Outputs: inter-chunk read of S_0 with decayed queries + causal intra-chunk attention.
      for (int64_t t = 0; t < L; ++t) {
        float* ot = o + (start + t) * tok + h * D;  // [V]
        for (int64_t i = 0; i < D; ++i) dq[i] = std::exp(cum[t * D + i]) * qs.row(t)[i];
        for (int64_t j = 0; j < D; ++j) ot[j] = 0.0f;
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) ot[j] += dq[i] * S[i * D + j];
        for (int64_t s = 0; s <= t; ++s) {
          const float p = P[t * C + s];
          for (int64_t j = 0; j < D; ++j) ot[j] += p * U[s * D + j];
        }
        for (int64_t j = 0; j < D; ++j) ot[j] *= scale;
      }

      // State update, (1) at t = L: S <- diag(exp(G_L)) S_0 + sum_s (exp(G_L - G_s) . k_s) u_s^T.
      const float* last = &cum[(L - 1) * D];  // [K] G_L
      for (int64_t i = 0; i < D; ++i) {
        const float a = std::exp(last[i]);
        for (int64_t j = 0; j < D; ++j) S[i * D + j] *= a;
      }
      for (int64_t s = 0; s < L; ++s)
        for (int64_t i = 0; i < D; ++i) {
          const float kd = kend[s * D + i];
          for (int64_t j = 0; j < D; ++j) S[i * D + j] += kd * U[s * D + j];
        }
    }
  }
}

}  // namespace k3::cpu
