#!/usr/bin/env bash
# Loom models of kvbridge's lock-free state: the writer queue's fast lane
# (crates/kvbridge/src/fast_lane.rs) and the per-peer bytes in flight (in_flight.rs).
# Each model runs the real type under every interleaving loom explores, bounded to
# LOOM_MAX_PREEMPTIONS preemptions per execution (3 unless set).
#
# The models build under `--cfg kvbridge_loom` (not `--cfg loom`, which would change tokio
# and other dependencies too), in their own target directory so the usual build stays warm.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTFLAGS="${RUSTFLAGS:-} --cfg kvbridge_loom"
export CARGO_TARGET_DIR="${KVBRIDGE_LOOM_TARGET:-target-loom}"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
exec cargo test -p kvbridge --lib --release loom_ -- --test-threads=2 "$@"
