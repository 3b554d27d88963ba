#!/usr/bin/env bash
# kvbridge's transports against NIXL's UCX backend, side by side in one run.
#
#   RUNS=5 bench/transfer.sh            (after scripts/setup.sh and a release build:
#                                        cargo build --release -p kvbridge-cli --features kvbridge/ucx)
#
# Each run measures, in turn and with the same shape (batches of BATCH writes of each block
# size, 2 batches in flight, TOTAL bytes per size): kvbridge over tcp and shm, kvbridge over
# UCX (when the binary was built with UCX) with UCX_TLS=tcp, sm,self,tcp and posix,cma,self
# (the last without KVBRIDGE_UCX_TRUSTED_FABRIC, which it does not need), and NIXL's UCX
# backend (bench/nixl_transfer.py, the `nixl` wheel) with tcp and sm,self,tcp (its UCX cannot
# create the endpoint to itself it needs with shared-memory transports alone).
# Then connect plus first write: `kvbridge bench handshake` (over tcp, and with
# `--transport ucx` over UCX with the three UCX_TLS: connect, the UCX negotiation, the first write
# over UCX) against NIXL's metadata exchange plus first write. Both sides read back and compare
# every byte they wrote. Prints medians over the runs with the lowest and highest run, and the
# load average at the start and end of each run; raw lines go to $OUT (default
# target/bench-transfer.jsonl). Any failed run fails the script, loudly, and no figure is
# printed. NIXL is installed into $PY's environment (default .venv) without dependencies on
# first use (a benchmark-time install, as bench/vllm-pd.sh does); PY=path/to/python picks
# another environment. NIXL runs with kvbridge's UCX defaults (crates/kvbridge-ucx/src/
# context.rs: UCX_TCP_TX_SEG_SIZE, UCX_TCP_RX_SEG_SIZE) exported, so both sides start from the
# same UCX settings; a UCX_* set by the caller wins on both sides.
# kvbridge's UCX runs declare the fabric trusted (KVBRIDGE_UCX_TRUSTED_FABRIC=1): tcp and sysv,
# which both UCX_TLS open, reach beyond this user, and kvbridge refuses them without it
# (docs/ucx.md, "Who can reach a UCX worker"). Run it on a host whose other users and
# network peers you trust, as NIXL's runs here assume anyway.
set -euo pipefail
export KVBRIDGE_UCX_TRUSTED_FABRIC=1
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
SIZES=${SIZES:-65536,262144,1048576,4194304}
BATCH=${BATCH:-16}
TOTAL=${TOTAL:-256M}
OUT=${OUT:-target/bench-transfer.jsonl}
KVB=${KVB:-target/release/kvbridge}
PY=${PY:-.venv/bin/python}
NIXL_VERSION=1.5.1

[ -x "$KVB" ] || { echo "bench/transfer.sh: build $KVB first (see the header)" >&2; exit 2; }
if ! "$PY" -c "import nixl._api" 2>/dev/null; then
  echo "bench/transfer.sh: installing nixl $NIXL_VERSION (benchmark only)" >&2
  "$PY" -m pip install --quiet --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
fi
fail() { echo "bench/transfer.sh: FAILED: $*" >&2; exit 1; }
UCX=0
if probe=$(UCX_TLS=tcp timeout 120 "$KVB" bench transfer --transport ucx --block-sizes 65536 --batch 1 \
    --total 64K --reps 1 --json 2>&1); then
  UCX=1
elif grep -q "this build has no UCX" <<<"$probe"; then
  echo "bench/transfer.sh: this kvbridge has no UCX transport: measuring NIXL, tcp and shm only" >&2
else
  fail "kvbridge over UCX does not run: $probe"
fi
: > "$OUT"
load() { # the host's load average, a row of its own
  echo "{\"run\": $run, \"label\": \"load $1\", \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >> "$OUT"
}
kvb() { # label, then env assignments and flags
  local label=$1; shift
  local line
  line=$(env "$@" --block-sizes "$SIZES" --batch "$BATCH" --inflight 2 --total "$TOTAL" --reps 1 --json) \
    || fail "kvbridge $label (run $run)"
  echo "{\"run\": $run, \"label\": \"$label\", \"kvbridge\": $line}" >> "$OUT"
}
nixl() { # UCX_TLS
  local line
  line=$(UCX_TLS=$1 UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-1M} \
    UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-1M} timeout 600 "$PY" bench/nixl_transfer.py --block-sizes "$SIZES" --batch "$BATCH" \
    --total "$TOTAL" --json 2>/dev/null | tail -1) || fail "NIXL UCX_TLS=$1 (run $run)"
  [ -n "$line" ] || fail "NIXL UCX_TLS=$1 printed nothing (run $run)"
  echo "{\"run\": $run, \"label\": \"nixl $1\", \"nixl\": $line}" >> "$OUT"
}
for run in $(seq 1 "$RUNS"); do
  echo "run $run of $RUNS" >&2
  load start
  kvb "tcp" "$KVB" bench transfer --transport tcp
  kvb "shm" "$KVB" bench transfer --transport shm
  if [ "$UCX" = 1 ]; then
    kvb "ucx tcp" UCX_TLS=tcp "$KVB" bench transfer --transport ucx
    kvb "ucx sm,self,tcp" UCX_TLS=sm,self,tcp "$KVB" bench transfer --transport ucx
    # The transports only this user reaches: run without the declaration, as a user would.
    kvb "ucx posix,cma,self" -u KVBRIDGE_UCX_TRUSTED_FABRIC UCX_TLS=posix,cma,self "$KVB" \
      bench transfer --transport ucx
  fi
  nixl tcp
  nixl sm,self,tcp
  hs=$("$KVB" bench handshake --peers 50 --json) || fail "kvbridge handshake (run $run)"
  echo "{\"run\": $run, \"label\": \"handshake tcp\", \"handshake\": $hs}" >> "$OUT"
  if [ "$UCX" = 1 ]; then
    for tls in tcp sm,self,tcp posix,cma,self; do
      hs=$(UCX_TLS=$tls "$KVB" bench handshake --transport ucx --peers 50 --json) \
        || fail "kvbridge ucx handshake UCX_TLS=$tls (run $run)"
      echo "{\"run\": $run, \"label\": \"handshake ucx $tls\", \"handshake\": $hs}" >> "$OUT"
    done
  fi
  load end
done
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tput, hs, loads = {}, {}, []
for r in rows:
    if "load" in r:
        loads.append(f"{r['label']} {r['run']}: {r['load']}")
    elif "kvbridge" in r:
        for x in r["kvbridge"]["results"]:
            tput.setdefault((r["label"], x["block_size"]), []).append(x["gib_per_s"])
    elif "nixl" in r:
        for x in r["nixl"]["results"]:
            tput.setdefault((r["label"], x["block_size"]), []).append(x["gib_per_s"])
        hs.setdefault(r["label"], []).append(r["nixl"]["handshake_first_write_ms"])
    else:
        hs.setdefault(r["label"], []).append(r["handshake"]["p50_ms"])
def fmt(v):
    return f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"
labels = sorted({k[0] for k in tput}, key=lambda l: (l.startswith("nixl"), l))
sizes = sorted({k[1] for k in tput})
print(f"GiB/s, median [min-max] of {max(r['run'] for r in rows)} runs")
print("| block | " + " | ".join(labels) + " |")
print("|---" * (len(labels) + 1) + "|")
for s in sizes:
    print(f"| {s >> 10} KiB | " + " | ".join(fmt(tput[(l, s)]) if (l, s) in tput else "-" for l in labels) + " |")
print()
print("load average (1, 5, 15 min): " + "; ".join(loads))
print()
print("connect + first write, ms (kvbridge: p50 of 50 initiators per run; NIXL: one per run)")
for l, v in sorted(hs.items()):
    print(f"  {l:<24} {fmt(v)}")
EOF
