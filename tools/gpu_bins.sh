# shellcheck shell=bash
# Sourced by the GPU scripts (gpu_check.sh, gpu_ab.sh) from the repo root: sets bin_dir to the
# first of $K3_BIN_DIR, build/, build-cuda/, .gpu_carry/ that has the GPU binaries, unpacking
# .gpu_carry/bundle.tar.xz (tools/gpu_bundle.sh) when none is built; builds build/ with
# tools/setup.sh as the last resort (its output into $1). Returns 1 when the build fails.
if [ -z "${K3_BIN_DIR:-}" ] && [ ! -x build/k3_gpu_tests ] && [ -f .gpu_carry/bundle.tar.xz ]; then
  K3_BIN_DIR=/tmp/k3_bundle
  mkdir -p "$K3_BIN_DIR" && tar -C "$K3_BIN_DIR" -xJf .gpu_carry/bundle.tar.xz
  export LD_LIBRARY_PATH="$K3_BIN_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
bin_dir=""
for d in "${K3_BIN_DIR:-}" build build-cuda .gpu_carry; do
  if [ -n "$d" ] && [ -x "$d/k3_gpu_tests" ] && [ -x "$d/k3_bench_ops" ]; then
    bin_dir="$d"
    break
  fi
done
if [ -z "$bin_dir" ]; then
  echo "== building (tools/setup.sh)" | tee -a "$1"
  if ! tools/setup.sh >>"$1" 2>&1; then
    echo "build failed; see $1" >&2
    tail -n 40 "$1" >&2
    return 1
  fi
  bin_dir=build
fi
