#!/usr/bin/env bash
# On a GPU machine: is a switch (or several) ready to be the default? For the first VARIANT (a
# space-separated set of VAR=VALUE, e.g. "K3_CUBLAS_PLANS=0") runs the GPU tests and `k3 diff`
# on the tiny presets under it, then times the whole step (k3_bench_step, no flips) under it and
# under the baseline ($K3_AB_BASE, default the defaults), alternated twice (a single timing
# carries 4-5% of spread), then once under each further variant, all within $BUDGET seconds
# (default 500). Logs go to ${OUT:-/tmp}; the summary is printed last.
#
#   BUDGET=480 tools/gpu_ab.sh "K3_CUBLAS_PLANS=0" "K3_CUBLAS_PLANS=0 K3_MXFP4_GEMV=0"
#   K3_AB_BASE="K3_MXFP4_GEMV=0" tools/gpu_ab.sh "K3_DEFAULTS=1"   # tests under the defaults
#
# Environment: K3_GPU_FILTER (gtest filter for the tests), K3_BATCHES (default 1), K3_STEP_ARGS
# (more k3_bench_step flags). The rank is the 93-layer TP16 / EP16 one where the GPU holds it
# (~108 GB: an H200), else 60 layers (an H100); compare ms only within one run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[ $# -ge 1 ] || { echo "usage: $0 VARIANT [VARIANT...]" >&2; exit 2; }
t0=$(date +%s)
out_dir="${OUT:-/tmp}"
mkdir -p "$out_dir"
log="$out_dir/gpu_ab.log"
: >"$log"
# shellcheck source=tools/gpu_bins.sh
source tools/gpu_bins.sh "$log" || exit 1
left() { echo $((${BUDGET:-500} - ($(date +%s) - t0))); }

first="$1"
gpu=$(nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1)
echo "$gpu" >>"$log"
# shellcheck disable=SC2086
env $first "$bin_dir/k3_gpu_tests" --gtest_brief=1 ${K3_GPU_FILTER:+--gtest_filter=$K3_GPU_FILTER} \
  >"$out_dir/ab_tests.log" 2>&1
tests_rc=$?
diff_rc=0
: >"$out_dir/ab_diff.log"
for preset in tiny tiny-k3.1 tiny-kimi-linear; do
  echo "== k3 diff --model $preset" >>"$out_dir/ab_diff.log"
  # shellcheck disable=SC2086
  env $first "$bin_dir/k3" diff --model "$preset" >>"$out_dir/ab_diff.log" 2>&1 || diff_rc=$?
done

mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
layers=93
[ "${mem:-0}" -lt 100000 ] && layers=60
args="--layers $layers --template-layers 4 --dir /tmp/k3_ab_rank --replays 10 --context 1024"
args="$args --verify-q 1 --no-flips --batch ${K3_BATCHES:-1} ${K3_STEP_ARGS:-}"
base="${K3_AB_BASE:-K3_DEFAULTS=1}"
runs=("$first" "$base" "$first" "$base" "${@:2}")
: >"$out_dir/ab_step.log"
for v in "${runs[@]}"; do
  l=$(left)
  if [ "$l" -lt 60 ]; then
    echo "== $v: skipped, $l s left" >>"$out_dir/ab_step.log"
    continue
  fi
  echo "== $v" >>"$out_dir/ab_step.log"
  # shellcheck disable=SC2086
  env $v timeout $((l - 10)) "$bin_dir/k3_bench_step" $args >>"$out_dir/ab_step.log" 2>&1 ||
    echo "rc $?" >>"$out_dir/ab_step.log"
done

{
  echo "================ gpu_ab summary ================"
  echo "$gpu"
  echo "k3_gpu_tests under $first: rc $tests_rc"
  grep -E '^\[  (PASSED|FAILED)  \]' "$out_dir/ab_tests.log" | sort -u | head -20
  echo "k3 diff under $first: rc $diff_rc"
  grep -E '^== k3 diff|^result:' "$out_dir/ab_diff.log"
  echo "k3_bench_step ($args):"
  awk '/^== |^rc /{print; s=0} /^=+ summary/{s=1; next} s && NF {print}' "$out_dir/ab_step.log"
} | tee -a "$log"
[ "$tests_rc" -eq 0 ] && [ "$diff_rc" -eq 0 ]
