#!/usr/bin/env bash
# Per-kernel times of one decode step under Nsight Compute, on the GPU machine: profiles
# k3_bench_step (an --layers 8 real-shape rank, one batch, one path, model-ranked plans) with the
# SM clock locked to base (unlocked clocks made latency-bound kernels vary 2-3x between runs),
# then prints the last step's kernels in order and a per-kernel summary (tools/ncu_table.py).
# Slow: every launch of the run is profiled (synthesis, capture warm-ups, the timed steps); on
# 2026-12-03 a run with the default verify table (q = 2, 4, 8) did not finish in 600 s, so the
# verify table is off here.
# Usage: tools/ncu_step.sh [batch] [specialized|stock] [extra k3_bench_step flags]
# Environment: K3_BIN_DIR (binaries, default build), OUT (log folder, default /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
batch="${1:-1}"
path="${2:-specialized}"
shift $(( $# > 2 ? 2 : $# ))
bin="${K3_BIN_DIR:-build}"
out="${OUT:-/tmp}"
ncu_bin="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
export K3_LINEAR_TUNING=0  # no tuning launches in the profile; the model's plans
"$ncu_bin" --clock-control base --graph-profiling node \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
  "$bin/k3_bench_step" --layers 8 --replays 1 --batch "$batch" --context 1024 --no-profile \
  --no-tuning --verify-q 1 --paths "$path" "$@" >"$out/ncu_step.csv" 2>"$out/ncu_step.err"
python3 tools/ncu_table.py "$out/ncu_step.csv"
