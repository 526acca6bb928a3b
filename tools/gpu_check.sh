#!/usr/bin/env bash
# On a GPU machine, from anywhere in the repo: runs the CUDA tests (k3_gpu_tests), the kernel
# benchmarks (k3_bench_ops, k3_bench_attn), the whole-step benchmark (k3_bench_step: stock and
# specialized paths against the byte floor) and `k3 diff` on the tiny presets, logs everything
# to ${OUT:-/tmp}/gpu_check.log and prints a short summary last.
#
# Binaries are taken from $K3_BIN_DIR, build/, build-cuda/ or .gpu_carry/ (first that has both),
# or unpacked from .gpu_carry/bundle.tar.xz (tools/gpu_bundle.sh); when none has them,
# tools/setup.sh builds build/ first.
# Extra arguments go to k3_bench_ops (e.g. --quick, --no-sweep, --filter 768x7168).
# Environment: K3_GPU_FILTER (gtest filter), K3_SKIP_OPS / K3_SKIP_ATTN / K3_SKIP_STEP /
# K3_SKIP_DIFF (skip a part), K3_STEP_ARGS (flags for k3_bench_step, e.g. "--layers 8 --batch 1,8,64"),
# K3_STEP_VARIANTS (space-separated variants, each VAR=VALUE or several joined by commas, e.g.
# "K3_CUBLAS_PLANS=0 K3_MLA_RING=4,K3_DSA_MMA=0": k3_bench_step once more under each, without the
# flips, into bench_step_<variant>.log),
# K3_OPS_VARIANTS (variants as above: k3_bench_ops once more under each, with the same
# arguments, and a side-by-side table of the sweep plans' times),
# K3_TEST_VARIANTS (variants as above: k3_gpu_tests once more under each, with
# K3_TEST_VARIANT_FILTER as its gtest filter if set, e.g. "CudaMla*:CudaStepDiff*"),
# K3_SANITIZE (a gtest filter: those GPU tests again under compute-sanitizer memcheck and
# racecheck, where the machine's runtime supports it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

out_dir="${OUT:-/tmp}"
mkdir -p "$out_dir"
log="$out_dir/gpu_check.log"
: >"$log"

# shellcheck source=tools/gpu_bins.sh
source tools/gpu_bins.sh "$log" || exit 1

{
  echo "== $(date -u +%FT%TZ) binaries from $bin_dir"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 || true
} | tee -a "$log"

echo "== k3_gpu_tests" | tee -a "$log"
"$bin_dir/k3_gpu_tests" --gtest_brief=1 ${K3_GPU_FILTER:+--gtest_filter=$K3_GPU_FILTER} 2>&1 | tee -a "$log"
tests_rc=${PIPESTATUS[0]}
# The suite again under each VAR=VALUE switch of K3_TEST_VARIANTS (e.g. "K3_MLA_MMA=0"), with
# K3_TEST_VARIANT_FILTER (else K3_GPU_FILTER) if set; a failure there fails the tests.
variant_filter="${K3_TEST_VARIANT_FILTER:-${K3_GPU_FILTER:-}}"
for variant in ${K3_TEST_VARIANTS:-}; do
  echo "== $variant k3_gpu_tests ${variant_filter:+--gtest_filter=$variant_filter}" | tee -a "$log"
  # shellcheck disable=SC2086
  env ${variant//,/ } "$bin_dir/k3_gpu_tests" --gtest_brief=1 ${variant_filter:+--gtest_filter=$variant_filter} 2>&1 |
    tee -a "$log"
  rc=${PIPESTATUS[0]}
  [ "$tests_rc" -eq 0 ] && [ "$rc" -ne 0 ] && tests_rc=$rc
done

# Memory errors and shared-memory races in a subset of the GPU tests (compute-sanitizer needs
# the Firecracker runtime; gVisor refuses the device, reported as such).
sanitize_rc=0
if [ -n "${K3_SANITIZE:-}" ]; then
  : >"$out_dir/sanitizer.log"
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool k3_gpu_tests --gtest_filter=$K3_SANITIZE" |
      tee -a "$log" "$out_dir/sanitizer.log" >/dev/null
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin_dir/k3_gpu_tests" --gtest_brief=1 \
      --gtest_filter="$K3_SANITIZE" >>"$out_dir/sanitizer.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: rc $rc" | tee -a "$log" "$out_dir/sanitizer.log" >/dev/null
    [ "$rc" -ne 0 ] && sanitize_rc=$rc
  done
fi

bench_rc=0
if [ -z "${K3_SKIP_OPS:-}" ]; then
  echo "== k3_bench_ops $*" | tee -a "$log"
  "$bin_dir/k3_bench_ops" "$@" 2>&1 | tee "$out_dir/bench_ops.log" | tee -a "$log" >/dev/null
  bench_rc=${PIPESTATUS[0]}
  for variant in ${K3_OPS_VARIANTS:-}; do
    echo "== $variant k3_bench_ops $*" | tee -a "$log"
    # shellcheck disable=SC2086
    env ${variant//,/ } "$bin_dir/k3_bench_ops" "$@" 2>&1 |
      tee "$out_dir/bench_ops_${variant//[=,]/_}.log" | tee -a "$log" >/dev/null
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && bench_rc=$rc
  done
fi

# KDA / MLA / router timings (optional binary: older carried builds may lack it).
attn_rc=0
if [ -x "$bin_dir/k3_bench_attn" ] && [ -z "${K3_SKIP_ATTN:-}" ]; then
  echo "== k3_bench_attn" | tee -a "$log"
  "$bin_dir/k3_bench_attn" 2>&1 | tee "$out_dir/bench_attn.log" | tee -a "$log" >/dev/null
  attn_rc=${PIPESTATUS[0]}
fi

# The whole stock decode step at K3 per-rank shapes (optional binary; K3_STEP_ARGS adds flags).
step_rc=0
if [ -x "$bin_dir/k3_bench_step" ] && [ -z "${K3_SKIP_STEP:-}" ]; then
  echo "== k3_bench_step ${K3_STEP_ARGS:-}" | tee -a "$log"
  # The tuned plan of every GEMM goes into the log too (K3_LOG_PLANS).
  # shellcheck disable=SC2086
  K3_LOG_PLANS=1 "$bin_dir/k3_bench_step" ${K3_STEP_ARGS:-} 2>&1 | tee "$out_dir/bench_step.log" |
    tee -a "$log" >/dev/null
  step_rc=${PIPESTATUS[0]}
  for variant in ${K3_STEP_VARIANTS:-}; do
    echo "== $variant k3_bench_step ${K3_STEP_ARGS:-} --no-flips" | tee -a "$log"
    # shellcheck disable=SC2086
    env ${variant//,/ } "$bin_dir/k3_bench_step" ${K3_STEP_ARGS:-} --no-flips 2>&1 |
      tee "$out_dir/bench_step_${variant//[=,]/_}.log" | tee -a "$log" >/dev/null
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && step_rc=$rc
  done
fi

# The specialized step against the stock one, per layer (optional binary: `k3 diff`).
diff_rc=0
if [ -x "$bin_dir/k3" ] && [ -z "${K3_SKIP_DIFF:-}" ]; then
  : >"$out_dir/k3_diff.log"
  for preset in tiny tiny-k3.1 tiny-kimi-linear; do
    echo "== k3 diff --model $preset" | tee -a "$log" >>"$out_dir/k3_diff.log"
    "$bin_dir/k3" diff --model "$preset" 2>&1 | tee -a "$log" >>"$out_dir/k3_diff.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && diff_rc=$rc
  done
fi

# Summary: test verdict, failures, then the bench's own compact tables (printed last by it).
{
  echo
  echo "================ summary ================"
  case $tests_rc in
    0) echo "k3_gpu_tests: PASS ($(grep -m1 -oE '[0-9]+ tests? from [0-9]+ test suites? ran' "$log" || true))" ;;
    77) echo "k3_gpu_tests: SKIPPED (no usable GPU)" ;;
    *) echo "k3_gpu_tests: FAIL (rc $tests_rc)"
       grep -E '^\[  FAILED  \]' "$log" | sort -u | head -20
       grep -E 'Failure|outside tolerance|not written|differ' "$log" | head -20 ;;
  esac
  if [ -n "${K3_SANITIZE:-}" ]; then
    grep -E '^compute-sanitizer|ERROR SUMMARY|Device not supported' "$out_dir/sanitizer.log"
  fi
  [ -f "$out_dir/bench_ops.log" ] && echo "k3_bench_ops: rc $bench_rc (full output: $out_dir/bench_ops.log)"
  # This GPU's measured read curve (the %card column's mark).
  [ -f "$out_dir/bench_ops.log" ] && grep -m1 '^read curve' "$out_dir/bench_ops.log"
  if [ ! -f "$out_dir/bench_ops.log" ]; then
    :
  elif grep -q '^plan sweep' "$out_dir/bench_ops.log"; then
    awk '/^plan sweep/{p=1} p' "$out_dir/bench_ops.log"
  else
    awk '/^kernel +shape/{p=1} p' "$out_dir/bench_ops.log"
  fi
  if [ "$bench_rc" -ne 0 ]; then tail -n 5 "$out_dir/bench_ops.log"; fi
  # Each sweep plan's batched us under the defaults and under each K3_OPS_VARIANTS variant
  # (same binary, same run), side by side.
  if [ -n "${K3_OPS_VARIANTS:-}" ] && [ -f "$out_dir/bench_ops.log" ]; then
    files=("$out_dir/bench_ops.log")
    header="defaults"
    for variant in ${K3_OPS_VARIANTS}; do
      files+=("$out_dir/bench_ops_${variant//[=,]/_}.log")
      header="$header | $variant"
    done
    echo "sweep us: $header"
    awk 'FNR == 1 { f++ }
         /^ +sweep / { key = $2 " " $3 " " substr($0, index($0, "model") + 14)
                       if (!(key in seen)) { seen[key] = 1; order[++n] = key }
                       us[key, f] = $4 }
         END { for (i = 1; i <= n; i++) { line = sprintf("  %-60s", order[i])
                 for (j = 1; j <= f; j++) line = line sprintf(" %8s", ((order[i], j) in us) ? us[order[i], j] : "-")
                 print line } }' "${files[@]}"
  fi
  # Skipped benches leave no log.
  if [ -f "$out_dir/bench_attn.log" ]; then
    echo "k3_bench_attn: rc $attn_rc (full output: $out_dir/bench_attn.log)"
    awk '/^kernel +shape/{p=1} p' "$out_dir/bench_attn.log"
  fi
  if [ -f "$out_dir/k3_diff.log" ]; then
    echo "k3 diff: rc $diff_rc"
    grep -E '^== k3 diff|^result:' "$out_dir/k3_diff.log"
  fi
  if [ -f "$out_dir/bench_step.log" ]; then
    echo "k3_bench_step: rc $step_rc (full output: $out_dir/bench_step.log)"
    grep -E '^k3_bench_step' "$out_dir/bench_step.log" | head -2
    awk '/^k3 plan:/{next} /^kernel +batch/{p=1} /^=+ summary/{p=1} p' "$out_dir/bench_step.log"
    # The paths launch the same kernels: their rank logits (rel L2) and each path's rerun
    # (replay) must agree bit for bit. Rows without a stock timing have no comparison. The two
    # are the third and second columns from the end (exp/layer last).
    awk '/^k3 plan:/{next} /^ *batch +context/{p=1; next} /^$/{p=0} p && NF >= 10 && $3 != "0.000" {
           n++; if ($(NF-2) != "0.00e+00" || $(NF-1) != "0.00e+00") bad++ }
         END { if (n) printf "rank paths bit-identical (rel L2 and replay 0): %s (%d of %d rows)\n",
                             bad ? "NO" : "yes", n - bad, n }' "$out_dir/bench_step.log"
  fi
  for variant in ${K3_STEP_VARIANTS:-}; do
    f="$out_dir/bench_step_${variant//[=,]/_}.log"
    [ -f "$f" ] || continue
    echo "k3_bench_step with $variant (full output: $f)"
    awk '/^=+ summary/{p=1} p' "$f"
  done
} | tee -a "$log"

[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$attn_rc" -eq 0 ] && [ "$step_rc" -eq 0 ] &&
  [ "$diff_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ]
