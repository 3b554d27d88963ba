#!/usr/bin/env bash
# LMCache's own transfer-channel benchmark (python -m lmcache.tools.transfer_channel_benchmark,
# unmodified) with kvbridge against mooncake_te (Mooncake over TCP) and nixl (UCX), in one
# sitting, on this machine's loopback, every read verified (--verify).
#
# Usage: bench/lmcache.sh [REPS]          (default 3)
# Env:   SIZES    object sizes (default "10MB 256KB 1MB 4MB"; 10MB is the tool's default)
#        CHANNELS (default "kvbridge kvbridge-tcp mooncake_te nixl"; kvbridge-tcp is
#                  kvbridge with KVBRIDGE_TRANSPORT=tcp, the same transport as mooncake_te;
#                  kvbridge-cma1 is kvbridge with KVBRIDGE_CMA_THREADS=1 (each
#                  cross-memory-attach copy on one thread);
#                  kvbridge-ucx is kvbridge with KVBRIDGE_TRANSPORT=ucx over
#                  UCX_TLS=posix,cma,self, in a package built with UCX)
#        NUM_OBJECTS (default 100, the tool's), SOURCE_OBJECTS (default 200; the tool's
#                  default, 5x, needs a 5 GB arena at 10 MB), ITERS (10), WARMUP (2)
#        KVBRIDGE_VENV (default .venv), OUT_DIR (default docs/results)
# Needs, in the venv: kvbridge, lmcache 0.5.6, mooncake-transfer-engine-non-cuda (+ the
# Debian libibverbs1), nixl + nixl-cu13 (--no-deps, see docs/lmcache.md).
#
# Each run: a server process (fills NUM_OBJECTS.. source objects, serves its catalog) and a
# client process that reads NUM_OBJECTS random objects per iteration, ITERS times after
# WARMUP, verifies the bytes and prints best/median/mean. The page is the tool's 512 KiB,
# or the object size where that is smaller. Runs alternate channels within each repetition.
# Per channel and size the table gives the median over REPS of each run's median GB/s
# (decimal GB), with the min-max of those run medians, and kvbridge's ratios to the others
# computed from those medians. A run that fails, times out or prints no "verify OK" fails
# the whole script: it prints which, and no throughput.
# Raw output: $OUT_DIR/lmcache-bench-<commit>.json and .txt.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SIZES=${SIZES:-10MB 256KB 1MB 4MB}
CHANNELS=${CHANNELS:-kvbridge kvbridge-tcp mooncake_te nixl}
NUM_OBJECTS=${NUM_OBJECTS:-100}
SOURCE_OBJECTS=${SOURCE_OBJECTS:-200}
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-2}
VENV=${KVBRIDGE_VENV:-.venv}
PY="$VENV/bin/python"
OUT_DIR=${OUT_DIR:-docs/results}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}

die() { echo "bench/lmcache.sh: FAILED: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no Python at $PY"
"$PY" -c "import kvbridge, lmcache" || die "$PY cannot import kvbridge and lmcache"

commit=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- python/kvbridge python/src crates bench || commit="$commit-dirty"
LOGS=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill -KILL "$server_pid" 2>/dev/null || true; fi
  rm -rf "$LOGS"
}
trap cleanup EXIT

# python -m kvbridge.lmcache.run MODULE installs kvbridge's hooks, then runs MODULE
if "$PY" -c "import kvbridge.lmcache.run" 2>/dev/null; then
  launch=("$PY" -m kvbridge.lmcache.run lmcache.tools.transfer_channel_benchmark)
else
  launch=("$PY" -c 'import runpy, sys
from kvbridge.lmcache import distributed
distributed.register()
sys.argv[0] = "transfer_channel_benchmark"
runpy.run_module("lmcache.tools.transfer_channel_benchmark", run_name="__main__", alter_sys=True)')
fi

free_ports() {  # N ports the kernel just handed out on 127.0.0.1 (closed again at once)
  "$PY" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

to_bytes() { "$PY" -c "from lmcache.tools.transfer_channel_benchmark.config import parse_size as p; print(p('$1'))"; }

# one server + client pair; prints the client's log path
run_one() {  # channel size rep
  local channel=$1 size=$2 rep=$3 type=$1 env=()
  case $channel in
    kvbridge-tcp) type=kvbridge; env=(KVBRIDGE_TRANSPORT=tcp) ;;
    kvbridge-ucx) type=kvbridge; env=(KVBRIDGE_TRANSPORT=ucx UCX_TLS=posix,cma,self) ;;
    kvbridge-cma1) type=kvbridge; env=(KVBRIDGE_CMA_THREADS=1) ;;
    mooncake_te) env=(MC_TE_PROTOCOL=tcp) ;;
  esac
  local obj page buffer ports url ctl lis tag
  obj=$(to_bytes "$size")
  page=$(( obj < 524288 ? obj : 524288 ))
  buffer=$(( SOURCE_OBJECTS * obj + 64 * 1024 * 1024 ))
  read -r p1 p2 p3 <<<"$(free_ports 3)"
  url=127.0.0.1:$p1; lis=127.0.0.1:$p2; ctl=127.0.0.1:$p3
  tag="$channel-$size-$rep"
  local common=(--transfer-channel-type "$type" --url "$url" --control-url "$ctl"
    --page-size "$page" --object-size "$obj" --num-source-objects "$SOURCE_OBJECTS")
  env "${env[@]}" timeout -s KILL "$RUN_TIMEOUT" "${launch[@]}" --role server "${common[@]}" \
    --buffer-size "$buffer" --server-timeout "$RUN_TIMEOUT" >"$LOGS/$tag.server" 2>&1 &
  server_pid=$!
  # the client's catalog request waits (ZMQ) until the server is ready: no sleep needed
  local rc=0 client_pid
  env "${env[@]}" timeout -s KILL "$RUN_TIMEOUT" "${launch[@]}" --role client "${common[@]}" \
    --listen-url "$lis" --num-objects "$NUM_OBJECTS" --iters "$ITERS" --warmup "$WARMUP" \
    --verify >"$LOGS/$tag.client" 2>&1 &
  client_pid=$!
  # a server that dies first (bad flag, out of memory) would leave the client waiting for its
  # catalog until RUN_TIMEOUT: whichever ends first decides
  wait -n "$client_pid" "$server_pid" || true
  if kill -0 "$client_pid" 2>/dev/null; then
    echo "---- $tag: the server exited before the client finished" >&2
    kill -KILL "$client_pid" 2>/dev/null || true
  fi
  wait "$client_pid" || rc=$?
  # the server serves until its timeout; SIGINT ends its loop and closes its context
  kill -INT "$server_pid" 2>/dev/null || true
  timeout 30 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
  if [ $rc -ne 0 ] || ! grep -q "verify OK" "$LOGS/$tag.client" \
      || ! grep -q "median :" "$LOGS/$tag.client"; then
    echo "---- $tag: client exit $rc; client log tail:" >&2
    tail -n 25 "$LOGS/$tag.client" >&2
    echo "---- $tag: server log tail:" >&2
    tail -n 15 "$LOGS/$tag.server" >&2
    die "run $tag did not finish verified (exit $rc)"
  fi
  echo "$LOGS/$tag.client"
}

started=$(date -u +%FT%TZ)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
runs=()
for rep in $(seq 1 "$REPS"); do
  for size in $SIZES; do
    for channel in $CHANNELS; do
      log=$(run_one "$channel" "$size" "$rep")
      runs+=("$channel|$size|$rep|$log")
      echo "  $channel $size rep $rep: $(grep 'median :' "$log" | sed 's/ \+/ /g')" >&2
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

mkdir -p "$OUT_DIR"
json="$OUT_DIR/lmcache-bench-$commit.json"
txt="$OUT_DIR/lmcache-bench-$commit.txt"
printf '%s\n' "${runs[@]}" >"$LOGS/runs"
"$PY" - "$json" "$txt" "$LOGS/runs" <<EOF
import json, re, statistics, sys
json_path, txt_path = sys.argv[1], sys.argv[2]
meta = dict(commit="$commit", started="$started", finished="$(date -u +%FT%TZ)",
            load_before="$load_before", load_after="$load_after", reps=$REPS,
            num_objects=$NUM_OBJECTS, source_objects=$SOURCE_OBJECTS, iters=$ITERS,
            warmup=$WARMUP, channels="$CHANNELS".split(), sizes="$SIZES".split(),
            command="bench/lmcache.sh $REPS", host_cores=$(nproc))
line = re.compile(r"^\s*(best|median|mean)\s*:\s*([\d.]+) ms\s+([\d.]+) GB/s", re.M)
runs = []
for row in open(sys.argv[3]).read().split("\n"):
    if not row:
        continue
    channel, size, rep, log = row.split("|")
    text = open(log).read()
    figures = {k: {"ms": float(ms), "gbps": float(g)} for k, ms, g in line.findall(text)}
    if set(figures) != {"best", "median", "mean"} or "verify OK" not in text:
        sys.exit(f"unparsed or unverified run {channel} {size} {rep}")
    payload = re.search(r"payload per read : ([\d.]+) GB", text).group(1)
    runs.append(dict(channel=channel, size=size, rep=int(rep), payload_gb=float(payload),
                     verified=True, **figures, log=text))
table = {}
for r in runs:
    table.setdefault((r["size"], r["channel"]), []).append(r["median"]["gbps"])
summary = {f"{s}|{c}": dict(median_gbps=statistics.median(v), min_gbps=min(v), max_gbps=max(v), n=len(v))
           for (s, c), v in table.items()}
json.dump(dict(meta=meta, summary=summary, runs=runs), open(json_path, "w"), indent=1)
out = []
out.append(f"LMCache transfer_channel_benchmark, {meta['started']}..{meta['finished']}, commit {meta['commit']}")
out.append(f"load before {meta['load_before']}, after {meta['load_after']} ({meta['host_cores']} cores, shared host)")
out.append(f"{meta['num_objects']} objects/read, {meta['source_objects']} source objects, "
           f"{meta['iters']} iters + {meta['warmup']} warmup, {meta['reps']} reps, every run --verify OK")
out.append("GB/s (decimal): median over reps of each run's median [min-max of run medians]")
chans = meta["channels"]
ours = [c for c in chans if c.startswith("kvbridge")]
refs = [c for c in chans if not c.startswith("kvbridge")]
pairs = [(k, r) for k in ours for r in refs]
out.append("object   " + "".join(f"{c:>24}" for c in chans)
           + "".join(f"{k + '/' + r:>26}" for k, r in pairs))
for s in meta["sizes"]:
    cells = []
    for c in chans:
        m = summary[f"{s}|{c}"]
        cells.append(f"{m['median_gbps']:7.2f} [{m['min_gbps']:.2f}-{m['max_gbps']:.2f}]".rjust(24))
    ratios = [f"{summary[f'{s}|{k}']['median_gbps'] / summary[f'{s}|{r}']['median_gbps']:.2f}x"
              .rjust(26) for k, r in pairs]
    out.append(f"{s:<9}" + "".join(cells) + "".join(ratios))
open(txt_path, "w").write("\n".join(out) + "\n")
print("\n".join(out))
EOF
echo "raw: $json $txt" >&2
