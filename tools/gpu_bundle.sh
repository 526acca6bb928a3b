#!/usr/bin/env bash
# Packs the GPU binaries of build/ and the shared libraries they need that a bare GPU machine
# lacks (ICU, cpp-httplib, brotli, CUPTI, ...; not glibc, libstdc++, CUDA or NCCL, which it has) into
# .gpu_carry/bundle.tar.xz (about 20 MB), for the device tool's `carry`. tools/gpu_check.sh
# unpacks it there when it finds no built binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
bins=(k3 k3_gpu_tests k3_gpu_nccl_tests k3_bench_ops k3_bench_attn k3_bench_step k3_nccl_check)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for b in "${bins[@]}"; do
  if [ -x "build/$b" ]; then cp "build/$b" "$stage/"; fi
done
mkdir "$stage/lib"
ldd "$stage"/k3* | awk '$2 == "=>" && $3 ~ /^\/(usr\/)?lib/ {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
# CUPTI (k3_bench_step --trace) lives beside the toolkit, which a bare GPU machine may lack.
ldd "$stage"/k3* | awk '$2 == "=>" && $3 ~ /libcupti/ {print $3}' | sort -u |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
mkdir -p .gpu_carry
tar -C "$stage" -cJf .gpu_carry/bundle.tar.xz .
ls -la .gpu_carry/bundle.tar.xz
