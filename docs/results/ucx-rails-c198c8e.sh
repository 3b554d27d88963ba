#!/bin/bash
# Alternated: kvbridge TCP, UCX 1.23 tcp (default rails), UCX 1.23 tcp with UCX_MAX_RMA_RAILS=2, UCX 1.13 tcp.
set -u
KVB=/work/ci/target/release/kvbridge
L123=/tmp/nixl/ucx123:/tmp/nixl/x/nixl_cu13.libs
ARGS="--block-sizes 65536,262144,1048576,4194304 --batch 16 --inflight 2 --total 256M --reps 1 --json"
export KVBRIDGE_UCX_TRUSTED_FABRIC=1
for r in $(seq 1 ${ROUNDS:-8}); do
  echo "{\"round\": $r, \"label\": \"load\", \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
  l=$(timeout 120 $KVB bench transfer --transport tcp $ARGS | tail -1) || { echo FAILED tcp >&2; exit 1; }
  echo "{\"round\": $r, \"label\": \"kvbridge tcp\", \"r\": $l}"
  l=$(UCX_TLS=tcp LD_LIBRARY_PATH=$L123 timeout 120 $KVB bench transfer --transport ucx $ARGS | tail -1) || { echo FAILED 123 >&2; exit 1; }
  echo "{\"round\": $r, \"label\": \"ucx 1.23 tcp\", \"r\": $l}"
  l=$(UCX_MAX_RMA_RAILS=2 UCX_TLS=tcp LD_LIBRARY_PATH=$L123 timeout 120 $KVB bench transfer --transport ucx $ARGS | tail -1) || { echo FAILED 123r2 >&2; exit 1; }
  echo "{\"round\": $r, \"label\": \"ucx 1.23 tcp rails 2\", \"r\": $l}"
  l=$(UCX_TLS=tcp timeout 120 $KVB bench transfer --transport ucx $ARGS | tail -1) || { echo FAILED 113 >&2; exit 1; }
  echo "{\"round\": $r, \"label\": \"ucx 1.13 tcp\", \"r\": $l}"
done
