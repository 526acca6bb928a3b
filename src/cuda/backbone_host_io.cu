// What the host reads back from the CUDA backbone: the per-stage profile of a step (event marks
// captured into the graph), logits, hidden states, greedy ids, and the layer tap (k3 diff).
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cuda/argmax.h"
#include "cuda/backbone.h"
#include "cuda/backbone_buffers.h"
#include "cuda/check.h"
#include "cuda/graph_pdl.h"

namespace k3::cuda {

void CudaBackbone::mark(const char* stage) {
  if (!marks_) return;
  Marks& m = *marks_;
  if (m.used == m.events.size()) {
    cudaEvent_t e = nullptr;
    K3_CUDA_CHECK(cudaEventCreate(&e));
    m.events.push_back(e);
    m.names.emplace_back();
  }
  m.names[m.used] = stage;
  cudaStreamCaptureStatus st{};
  K3_CUDA_CHECK(cudaStreamIsCapturing(stream_, &st));
  // In a capture, an external record becomes an event node the replay records (for timing).
  if (st == cudaStreamCaptureStatusActive)
    K3_CUDA_CHECK(cudaEventRecordWithFlags(m.events[m.used], stream_, cudaEventRecordExternal));
  else
    K3_CUDA_CHECK(cudaEventRecord(m.events[m.used], stream_));
  ++m.used;
}

std::vector<StageTime> CudaBackbone::profile_step(std::span<const int32_t> slots,
                                                  std::span<const int32_t> tokens, StepPath path,
                                                  int replays) {
  K3_CHECK(replays >= 1, "profile_step: replays must be >= 1");
  K3_CHECK(!tap_, "profile_step with a layer tap set");
  Marks marks;
  std::vector<std::vector<double>> per_stage;
  std::vector<std::string> order;
  cudaGraphExec_t exec = nullptr;
  marks_ = &marks;
  try {
    step(slots, tokens, path);  // eager: attributes, plans
    marks.used = 0;
    // Capture by hand (step() would replay the plain graph): inputs are already staged.
    cudaGraph_t graph = nullptr;
    foreign_nodes_.clear();
    const ForeignNodeScope foreign(foreign_nodes_);
    K3_CUDA_CHECK(cudaStreamBeginCapture(stream_, capture_mode()));
    mark("start");
    enqueue(static_cast<int64_t>(slots.size()), path);
    mark("end");
    K3_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (path == StepPath::Specialized && opt_.tuning.pdl_for(static_cast<int64_t>(slots.size())))
      make_kernel_edges_programmatic(graph, foreign_nodes_);
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    K3_CUDA_CHECK(inst);
    for (int i = 0; i < replays; ++i) {
      K3_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::map<std::string, double> sum;
      for (size_t j = 1; j < marks.used; ++j) {
        float t = 0;
        K3_CUDA_CHECK(cudaEventElapsedTime(&t, marks.events[j - 1], marks.events[j]));
        // The interval before mark j belongs to the stage mark j - 1 opened.
        const std::string& st = marks.names[j - 1];
        if (sum.find(st) == sum.end() && i == 0) order.push_back(st);
        sum[st] += t;
      }
      if (per_stage.empty()) per_stage.resize(order.size());
      for (size_t k = 0; k < order.size(); ++k) per_stage[k].push_back(sum[order[k]]);
    }
  } catch (...) {
    marks_ = nullptr;
    if (exec) (void)cudaGraphExecDestroy(exec);
    for (cudaEvent_t e : marks.events) (void)cudaEventDestroy(e);
    throw;
  }
  marks_ = nullptr;
  K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  for (cudaEvent_t e : marks.events) K3_CUDA_CHECK(cudaEventDestroy(e));
  // The replays advanced the positions on the device; mirror them on the host.
  for (const int32_t s : slots) host_pos_[static_cast<size_t>(s)] += replays;
  std::vector<StageTime> out;
  for (size_t k = 0; k < order.size(); ++k) {
    auto& v = per_stage[k];
    std::sort(v.begin(), v.end());
    out.push_back({order[k] == "start" ? "embed" : order[k], v[v.size() / 2]});
  }
  return out;
}

void CudaBackbone::logits_to_host(int64_t rows, float* out) {
  copy_to_host_async(out, buf_->logits.data(), static_cast<size_t>(rows * cfg_.vocab_size),
                     stream_);
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackbone::logits_rows_to_host(std::span<const int64_t> rows, std::span<float* const> out) {
  K3_CHECK(rows.size() == out.size(), "logits_rows_to_host: ", rows.size(), " rows, ", out.size(),
           " outputs");
  const auto V = static_cast<size_t>(cfg_.vocab_size);
  for (size_t i = 0; i < rows.size(); ++i) {
    K3_CHECK(rows[i] >= 0 && rows[i] < opt_.max_rows, "logits_rows_to_host: row ", rows[i]);
    copy_to_host_async(out[i], buf_->logits.data() + static_cast<size_t>(rows[i]) * V, V, stream_);
  }
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// Waits for the stream and copies n bf16 device values to the host as floats.
void CudaBackbone::bf16_to_host(const __nv_bfloat16* src, size_t n, float* out) {
  std::vector<uint16_t> bits(n);
  copy_to_host_async(bits.data(), src, n, stream_);
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(bits[i]);
}

void CudaBackbone::hidden_to_host(int64_t rows, float* out) {
  K3_CHECK(rows >= 0 && rows <= opt_.max_rows, "hidden_to_host: ", rows, " rows");
  bf16_to_host(buf_->x.data(), static_cast<size_t>(rows * cfg_.hidden_size), out);
}

void CudaBackbone::greedy(int64_t rows, int32_t* ids) {
  argmax(buf_->logits.data(), cfg_.vocab_size, rows, cfg_.vocab_size, buf_->ids.data(), stream_);
  copy_to_host_async(ids, buf_->ids.data(), static_cast<size_t>(rows), stream_);
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackbone::tap(int layer, const char* part, int64_t rows) {
  if (!tap_) return;
  std::vector<float> out(static_cast<size_t>(rows * cfg_.hidden_size));
  bf16_to_host(buf_->sub.data(), out.size(), out.data());
  tap_(layer, part, out);
}

}  // namespace k3::cuda
