#!/usr/bin/env bash
# kvbridge (tcp and shm) against Mooncake's own transfer_engine_bench (tcp), at the same
# block sizes, in one sitting, on this machine's loopback. Prints one table with ratios.
#
# Usage: bench/compare.sh [REPS] [BLOCK_SIZES...]     (defaults: 3, 65536 262144 1048576 4194304)
# Needs ../shared/peers/mooncake-tcp-bench.sh (installs Mooncake on first use); set
# MOONCAKE=skip to leave it out. The machine is shared: compare only figures of one run.
#
# Patterns: Mooncake writes a batch of 128 blocks to the same 128 offsets every iteration
# (working set 128 x block, cache-hot at small blocks). kvbridge is measured with that
# pattern (--same-offsets) and with its own (cycling through a 1 GiB region); the Mooncake
# ratio uses the same pattern; "cma" is caller memory copied with process_vm_writev (n/a
# where the kernel refuses it). "tcp xN" is the same pattern with each batch split over
# SESSIONS (default 4) sessions, one TCP data connection each (Mooncake opens one connection
# per block); its ceiling ("ceil xN") is that many parallel socket streams.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}; shift $(( $# > 0 ? 1 : 0 )) || true
SIZES=${*:-65536 262144 1048576 4194304}
CSV=$(echo $SIZES | tr ' ' ',')
BIN=${KVBRIDGE_BIN:-target/release/kvbridge}
[ -x "$BIN" ] || cargo build --release -p kvbridge-cli
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
run() { "$BIN" bench transfer --block-sizes "$CSV" --reps "$REPS" --json "$@"; }
SESSIONS=${SESSIONS:-4}
run --transport tcp --same-offsets >"$OUT/tcp_same.json"
run --transport tcp --same-offsets --sessions "$SESSIONS" >"$OUT/tcp_multi.json"
run --transport tcp >"$OUT/tcp_scatter.json"
run --transport shm --same-offsets >"$OUT/shm_same.json"
run --transport shm >"$OUT/shm_scatter.json"
# Caller memory on the same host (process_vm_writev); where the kernel refuses it the
# column says n/a.
run --transport cma >"$OUT/cma_scatter.json" 2>"$OUT/cma.err" || : >"$OUT/cma_scatter.json"
if [ "${MOONCAKE:-}" != skip ]; then
  ../shared/peers/mooncake-tcp-bench.sh "$REPS" 4 $SIZES >"$OUT/mooncake.txt" \
    || /work/shared/peers/mooncake-tcp-bench.sh "$REPS" 4 $SIZES >"$OUT/mooncake.txt"
else
  : >"$OUT/mooncake.txt"
fi
python3 - "$OUT" <<'PY'
import json, sys, re, os
d = sys.argv[1]
def load(n):
    j = json.load(open(os.path.join(d, n)))
    return {r["block_size"]: r for r in j["results"]}
ts, tc, ss, sc, tm = (load(n) for n in ("tcp_same.json", "tcp_scatter.json", "shm_same.json", "shm_scatter.json", "tcp_multi.json"))
try:
    cm = load("cma_scatter.json")
except ValueError:
    cm = {}
mc = {}
for line in open(os.path.join(d, "mooncake.txt")):
    m = re.search(r"block=(\d+) GiB/s: .* median=([0-9.]+)", line)
    if m:
        mc[int(m.group(1))] = float(m.group(2))
print("GiB/s, medians; same = Mooncake's pattern (128 blocks at the same offsets), scatter = cycling through 1 GiB")
n = json.load(open(os.path.join(d, "tcp_multi.json")))["sessions"]
h = ("block", "tcp same", "tcp scat", "sock ceil", "mooncake", "tcp/mc", "tcp x%d" % n, "ceil x%d" % n, "x%d/mc" % n, "shm same", "shm scat", "memcpy", "shm/memcpy", "cma scat", "cma memcpy", "cma/memcpy")
print("%8s " * len(h) % h)
for b in sorted(ts):
    m = mc.get(b)
    row = (b >> 10, ts[b]["gib_per_s"], tc[b]["gib_per_s"], tc[b]["ceiling_gib_per_s"],
           m if m else float("nan"), ts[b]["gib_per_s"] / m if m else float("nan"),
           tm[b]["gib_per_s"], tm[b]["ceiling_gib_per_s"], tm[b]["gib_per_s"] / m if m else float("nan"),
           ss[b]["gib_per_s"], sc[b]["gib_per_s"], sc[b]["ceiling_gib_per_s"], sc[b]["ratio"],
           *((cm[b]["gib_per_s"], cm[b]["ceiling_gib_per_s"], cm[b]["ratio"]) if b in cm else (float("nan"),) * 3))
    print("%7dK " % row[0] + "%8.2f " * (len(row) - 1) % row[1:])
PY
