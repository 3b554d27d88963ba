#!/usr/bin/env bash
# Two commits of kvbridge side by side, alternated in one sitting: is NEW slower than OLD?
#
# Usage: bench/regression.sh OLD [NEW] [ROUNDS]      (NEW defaults to HEAD, ROUNDS to 5)
# Env:   PARTS  what to measure (default "transfer demo lmcache")
#        TRANSPORTS (default "tcp shm cma ucx"), SIZES (default 64K,256K,1M,4M)
#        LMCACHE_CHANNELS (default "kvbridge kvbridge-tcp kvbridge-ucx"),
#        LMCACHE_SIZES (default "1MB 4MB"), KVBRIDGE_VENV (default .venv)
#        OUT    the report (default docs/results/regression-<old>-<new>.txt)
#
# Each commit is checked out in a detached worktree under target/regression/ and built
# there: the `kvbridge` command (release, with UCX) and the Python package (a release wheel
# with UCX built by pip, unpacked; the venv's other packages, LMCache among them, are shared). Builds
# share one cargo target folder, and are skipped when the commit's outputs exist.
#
# Each round runs every part for both builds, old first in odd rounds and new first in even
# ones, so that the host's drift falls on both alike:
# - transfer: `kvbridge bench transfer --transport T --block-sizes SIZES --reps 1 --json`;
# - demo: `kvbridge demo --json --ceiling-reps 0` (its TTFT p50 under the workload and the
#   unloaded disaggregated TTFT p50); a demo with a failed request fails the script;
# - lmcache: bench/lmcache.sh with REPS=1 for the channels above, the build's package first
#   on PYTHONPATH (every read verified, as that script does).
# The report gives per cell each build's median over the rounds with its range and the
# ratio new/old of the medians, and the same ratio within each round (old and new back to
# back) as a median with its range, oriented so that a ratio below 1 means NEW is worse
# (throughput new/old; TTFT old/new). Any failed run fails the whole script and prints no
# figure.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: bench/regression.sh OLD [NEW] [ROUNDS]}
NEW=${2:-HEAD}
ROUNDS=${3:-5}
PARTS=${PARTS:-transfer demo lmcache}
TRANSPORTS=${TRANSPORTS:-tcp shm cma ucx}
SIZES=${SIZES:-64K,256K,1M,4M}
LMCACHE_CHANNELS=${LMCACHE_CHANNELS:-kvbridge kvbridge-tcp kvbridge-ucx}
LMCACHE_SIZES=${LMCACHE_SIZES:-1MB 4MB}
VENV=${KVBRIDGE_VENV:-.venv}
ROOT=$PWD
PY=$ROOT/$VENV/bin/python
REG=$ROOT/target/regression

die() { echo "bench/regression.sh: FAILED: $*" >&2; exit 1; }
old=$(git rev-parse --short=12 "$OLD^{commit}") || die "no commit $OLD"
new=$(git rev-parse --short=12 "$NEW^{commit}") || die "no commit $NEW"
OUT=${OUT:-docs/results/regression-$old-$new.txt}
mkdir -p "$REG"

build() {  # commit -> $REG/<commit>/{kvbridge,py/}
  local c=$1 dir=$REG/$1 src=$REG/src-$1
  if [ -x "$dir/kvbridge" ] && [ -d "$dir/py/kvbridge" ]; then return; fi
  [ -d "$src" ] || git worktree add --detach "$src" "$c" >&2
  mkdir -p "$dir"
  (cd "$src" && CARGO_TARGET_DIR=$REG/cargo cargo build --release -p kvbridge-cli \
    --features kvbridge/ucx >&2)
  cp "$REG/cargo/release/kvbridge" "$dir/kvbridge"
  rm -rf "$dir/wheel" "$dir/py"
  (cd "$src" && CARGO_TARGET_DIR=$REG/cargo MATURIN_PEP517_ARGS="--features ucx" \
    "$PY" -m pip wheel --quiet --no-deps -w "$dir/wheel" ./python >&2)
  "$PY" -m zipfile -e "$dir"/wheel/*.whl "$dir/py"
}
for c in "$old" "$new"; do build "$c"; done

LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
results=$LOGS/results.jsonl
: >"$results"

measure() {  # build round
  local b=$1 r=$2 dir=$REG/$1 t j
  for part in $PARTS; do
    case $part in
      transfer)
        for t in $TRANSPORTS; do
          # UCX on this host's own transports, as bench/transfer.sh runs it (docs/ucx.md)
          tls=()
          [ "$t" = ucx ] && tls=(UCX_TLS=posix,cma,self)
          # CPU seconds of the whole run (its peer process included): less of the host's
          # noise than the rates, though the same work (the socket and memcpy ceilings too)
          j=$(env "${tls[@]}" /usr/bin/time -f "%U %S" -o "$LOGS/cpu" "$dir/kvbridge" bench transfer \
            --transport "$t" --block-sizes "$SIZES" --reps 1 --json) || die "bench transfer $t on $b (round $r)"
          cpu=$(awk '{print $1 + $2}' "$LOGS/cpu")
          echo "{\"build\":\"$b\",\"round\":$r,\"part\":\"transfer\",\"transport\":\"$t\",\"cpu_s\":$cpu,\"out\":$j}" >>"$results"
        done ;;
      demo)
        j=$("$dir/kvbridge" demo --json --ceiling-reps 0 2>"$LOGS/demo.err") \
          || { tail -n 20 "$LOGS/demo.err" >&2; die "demo on $b (round $r)"; }
        echo "{\"build\":\"$b\",\"round\":$r,\"part\":\"demo\",\"out\":$j}" >>"$results" ;;
      lmcache)
        mkdir -p "$LOGS/lm-$b-$r"
        PYTHONPATH=$dir/py OUT_DIR=$LOGS/lm-$b-$r CHANNELS=$LMCACHE_CHANNELS \
          SIZES=$LMCACHE_SIZES bench/lmcache.sh 1 >"$LOGS/lm.out" 2>&1 \
          || { tail -n 30 "$LOGS/lm.out" >&2; die "bench/lmcache.sh on $b (round $r)"; }
        j=$(cat "$LOGS"/lm-"$b"-"$r"/lmcache-bench-*.json | "$PY" -c \
          'import json,sys; print(json.dumps(json.load(sys.stdin)["summary"]))')
        echo "{\"build\":\"$b\",\"round\":$r,\"part\":\"lmcache\",\"out\":$j}" >>"$results" ;;
      *) die "unknown part $part" ;;
    esac
  done
}

started=$(date -u +%FT%TZ)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="$old $new"; else order="$new $old"; fi
  for b in $order; do
    echo "round $r: $b ($(cut -d' ' -f1 /proc/loadavg))" >&2
    measure "$b" "$r"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

mkdir -p "$(dirname "$OUT")"
"$PY" - "$results" "$old" "$new" "$OUT" <<EOF
import json, statistics, sys
path, old, new, out_path = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
cells = {}  # (label, unit, higher_is_better) -> build -> [values]
def add(label, unit, better_high, build, v):
    cells.setdefault((label, unit, better_high), {}).setdefault(build, []).append(v)
for r in rows:
    b, o = r["build"], r["out"]
    if r["part"] == "transfer":
        if "cpu_s" in r:
            add(f"transfer {r['transport']} CPU seconds of the run", "s", False, b, r["cpu_s"])
        for x in o["results"]:
            add(f"transfer {r['transport']} {x['block_size'] // 1024} KiB", "GiB/s", True, b, x["gib_per_s"])
    elif r["part"] == "demo":
        if o.get("failed", 0) != 0:
            sys.exit(f"demo on {b} round {r['round']}: {o['failed']} failed requests")
        add("demo TTFT p50 under load", "ms", False, b, o["ttft_p50_ms"])
        add("demo TTFT p50 unloaded, disaggregated", "ms", False, b, o["ttft_unloaded_disagg_p50_ms"])
    else:
        for key, m in o.items():
            size, channel = key.split("|")
            add(f"lmcache {channel} {size}", "GB/s", True, b, m["median_gbps"])
lines = [f"# bench/regression.sh {old} {new} $ROUNDS, PARTS='$PARTS', $started..$(date -u +%FT%TZ)",
         f"# load average before {'$load_before'}, after {'$load_after'}; $(nproc) cores, shared host",
         "# builds: release kvbridge command and Python wheel, both with UCX; alternated, old first in odd rounds",
         "# ratio: new/old of the medians for throughput, old/new for TTFT (below 1: new is worse)",
         "",
         "# paired: the ratio within each round (old and new ran back to back), median and range",
         "| cell | unit | old median (range) | new median (range) | ratio | paired ratio (range) | rounds |",
         "|---|---|---|---|---|---|---|"]
for (label, unit, hi), by in cells.items():
    o, n = by.get(old, []), by.get(new, [])
    mo, mn = statistics.median(o), statistics.median(n)
    ratio = mn / mo if hi else mo / mn
    pairs = [(a / c if hi else c / a) for a, c in zip(n, o)]  # round by round, in order
    lines.append(f"| {label} | {unit} | {mo:.2f} ({min(o):.2f}-{max(o):.2f}) | {mn:.2f} ({min(n):.2f}-{max(n):.2f}) | {ratio:.3f} "
                 f"| {statistics.median(pairs):.3f} ({min(pairs):.2f}-{max(pairs):.2f}) | {min(len(o), len(n))} |")
lines += ["", "# raw"] + [json.dumps(r) for r in rows]
open(out_path, "w").write("\n".join(lines) + "\n")
print("\n".join(lines[:len(cells) + 8]))
EOF
echo "report: $OUT" >&2
