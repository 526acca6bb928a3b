#!/usr/bin/env bash
# Starts N ranks of one job on this host, one process per GPU, each with K3_RANK, K3_LOCAL_RANK,
# K3_WORLD_SIZE, K3_MASTER_ADDR and K3_MASTER_PORT set (the TCP bootstrap reads them), and waits
# for all of them. When one rank fails the others are stopped and its exit status is returned.
#
#   tools/launch_ranks.sh N cmd [args...]
#   e.g. tools/launch_ranks.sh 8 build/k3_nccl_check
#
# Several hosts: run it on every host with the same N, K3_NNODES (hosts), this host's
# K3_NODE_RANK (0..K3_NNODES-1) and K3_MASTER_ADDR = the address of node 0. Defaults: one node,
# 127.0.0.1, port 29500. NCCL_NVLS_ENABLE defaults to 0 (NVLink multicast stays off).
set -euo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N cmd [args...]   (N ranks on this host)" >&2
  exit 2
fi
n=$1
shift
nnodes=${K3_NNODES:-1}
node_rank=${K3_NODE_RANK:-0}
world=$((n * nnodes))
export K3_MASTER_ADDR=${K3_MASTER_ADDR:-127.0.0.1}
export K3_MASTER_PORT=${K3_MASTER_PORT:-29500}
export K3_WORLD_SIZE=$world
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap 'stop_all; exit 130' INT TERM

for ((i = 0; i < n; ++i)); do
  K3_RANK=$((node_rank * n + i)) K3_LOCAL_RANK=$i "$@" &
  pids+=("$!")
done

status=0
for ((left = n; left > 0; --left)); do
  rc=0
  wait -n || rc=$?
  if [[ $rc -ne 0 && $status -eq 0 ]]; then
    status=$rc
    echo "launch_ranks: a rank exited with status $rc; stopping the others" >&2
    stop_all
  fi
done
exit "$status"
