#!/usr/bin/env bash
# Side-by-side benchmark of `kvbridge proxy --flow vllm` against SGLang's and vLLM's Rust PD
# routers (../shared/peers/routers.sh), all in front of the same 2 prefill + 2 decode mock
# backends (../shared/peers/mock-backend, built outside the repo). Loopback only; every load
# run is bounded by wrk's duration.
#
# Usage: bench/proxy.sh            (env: DUR=5 seconds per run, ROUTERS="sglang vllm",
#                                   KVBRIDGE=path/to/kvbridge, BENCH_DIR=/tmp/kvbridge-bench,
#                                   KVB_CONFIGS="name:binary:extra args;..." to measure
#                                   several kvbridge builds or flags in the same run (empty
#                                   binary = $KVBRIDGE; default "kvbridge::"),
#                                   RESULTS=file to append one tab-separated line per proxy:
#                                   name cpu_us rps p50_ms added_ms rss_mb stream_ms errors)
#        bench/proxy.sh --build   (only builds the mock backends, then exits; `kvbridge bench
#                                  proxy` runs this first, so that its time limit per run
#                                  counts the runs, not a first build)
#        MOCK=path/to/backend     (another backend binary taking the mock's flags; tests use it)
# `kvbridge bench proxy` runs this several times and prints the medians.
# Needs: wrk (apt-get install -y wrk), curl, cargo; the routers install themselves on first use.
# Prints a markdown table. CPU per request is the fairest figure on a shared machine; compare
# only figures taken in the same run. A run in which any request failed (a non-2xx answer, a
# socket error, a streamed request that did not answer 200) measured failures, not a proxy:
# it stops at once with FAILED on stderr, exits 1 and prints no figure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
WORK=${BENCH_DIR:-/tmp/kvbridge-bench}
DUR=${DUR:-5}
ROUTERS=${ROUTERS-sglang vllm}
KVB_CONFIGS=${KVB_CONFIGS:-kvbridge::}
KVB=${KVBRIDGE:-${CARGO_TARGET_DIR:-$ROOT/target}/release/kvbridge}
PORT_P=(18100 18101) PORT_D=(18200 18201) PORT_X=18000
mkdir -p "$WORK/logs"

# --- mock backends, built in a copy outside the repo
if [ -z "${MOCK:-}" ] && [ ! -x "$WORK/mock-target/release/mock_backend" ]; then
  rm -rf "$WORK/mock-backend" && cp -r "$SHARED/peers/mock-backend" "$WORK/mock-backend"
  (cd "$WORK/mock-backend" && CARGO_TARGET_DIR="$WORK/mock-target" cargo build -q -j 1 --release)
fi
MOCK=${MOCK:-$WORK/mock-target/release/mock_backend}
[ "${1:-}" = --build ] && exit 0
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install -y wrk" >&2; exit 2; }
[ -x "$KVB" ] || { echo "no kvbridge binary at $KVB: cargo build --release -p kvbridge-cli" >&2; exit 2; }
PIDS=()
cleanup() {
  "$SHARED/peers/routers.sh" stop >/dev/null 2>&1 || true
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
wait_health() { # url
  for _ in $(seq 100); do curl -sf -m 1 -o /dev/null "$1/health" && return 0; sleep 0.1; done
  echo "no answer from $1/health" >&2; return 1
}
for p in "${PORT_P[@]}"; do "$MOCK" --port "$p" --role prefill --model bench-mock >"$WORK/logs/mock-$p.log" 2>&1 & PIDS+=($!); done
# Decoders drip streamed tokens 2 ms apart (non-streamed answers are immediate), so that a
# Nagle stall on any hop shows in the streaming figure.
for p in "${PORT_D[@]}"; do "$MOCK" --port "$p" --role decode --model bench-mock --token-delay-ms 2 >"$WORK/logs/mock-$p.log" 2>&1 & PIDS+=($!); done
for p in "${PORT_P[@]}" "${PORT_D[@]}"; do wait_health "http://127.0.0.1:$p"; done

cat >"$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench-mock","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":8}'
LUA

ticks() { # pid -> utime+stime of it and its descendants, in clock ticks
  local t=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo $t
}
rss_mb() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"; }
wrk_rps() { awk '/Requests\/sec/ {print $2}'; }
wrk_reqs() { awk '/requests in/ {print $1}'; }
wrk_p50_ms() { awk '$1 == "50%" { v = $2; if (v ~ /us$/) { sub(/us/, "", v); v /= 1000 } else if (v ~ /ms$/) { sub(/ms/, "", v) } else if (v ~ /s$/) { sub(/s/, "", v); v *= 1000 }; print v }'; }
failed() { # what detail: a run that saw a failed request reports no figure
  echo "FAILED: $1 saw failed requests ($2); no figures are reported" >&2
  exit 1
}
check_wrk() { # name file: fails the run when wrk saw a socket error or a non-2xx answer
  local errs
  errs=$(awk '/Non-2xx|Socket errors/ {printf "%s ", $0}' "$2")
  [ -z "$errs" ] || failed "$1" "$errs"
}
stream_ms() { # name url -> median time (ms) of 5 streamed requests of 8 tokens, 2 ms apart
  local i r ts=()
  for i in 1 2 3 4 5; do
    r=$(curl -s -N -o /dev/null -w '%{http_code} %{time_total}' -m 10 -H 'Content-Type: application/json' \
      -d '{"model":"bench-mock","prompt":"hi","max_tokens":8,"stream":true}' "$2/v1/completions" || true)
    [ "${r%% *}" = 200 ] || failed "$1" "a streamed request answered '${r%% *}'"
    ts+=("${r#* }")
  done
  printf '%s\n' "${ts[@]}" | sort -n | awk 'NR == 3 {printf "%.1f", $1 * 1000}'
}

# Baseline: one decode backend straight.
URL=http://127.0.0.1:${PORT_D[0]}
wrk -t1 -c1 -d"${DUR}s" --latency -s "$WORK/post.lua" "$URL/v1/completions" >"$WORK/logs/direct-c1.txt"
check_wrk direct "$WORK/logs/direct-c1.txt"
DIRECT_P50=$(wrk_p50_ms <"$WORK/logs/direct-c1.txt")
DIRECT_STREAM=$(stream_ms direct "$URL")

ROWS=()
measure() { # name pid url
  local name=$1 pid=$2 url=$3
  wrk -t1 -c16 -d1s -s "$WORK/post.lua" "$url/v1/completions" >"$WORK/logs/$name-warmup.txt"
  check_wrk "$name (warm-up)" "$WORK/logs/$name-warmup.txt"
  local t0 t1 out
  t0=$(ticks "$pid")
  out=$(wrk -t1 -c16 -d"${DUR}s" -s "$WORK/post.lua" "$url/v1/completions")
  t1=$(ticks "$pid")
  echo "$out" >"$WORK/logs/$name-c16.txt"
  check_wrk "$name" "$WORK/logs/$name-c16.txt"
  local reqs rps cpu_us
  reqs=$(echo "$out" | wrk_reqs)
  rps=$(echo "$out" | wrk_rps)
  cpu_us=$(awk -v d=$((t1 - t0)) -v n="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.1f", d / hz * 1e6 / n}')
  local c1 p50 added rss st
  c1=$(wrk -t1 -c1 -d"${DUR}s" --latency -s "$WORK/post.lua" "$url/v1/completions")
  echo "$c1" >"$WORK/logs/$name-c1.txt"
  check_wrk "$name (1 connection)" "$WORK/logs/$name-c1.txt"
  p50=$(echo "$c1" | wrk_p50_ms)
  added=$(awk -v a="$p50" -v b="$DIRECT_P50" 'BEGIN {printf "%.3f", a - b}')
  rss=$(rss_mb "$pid")
  st=$(stream_ms "$name" "$url")
  ROWS+=("| $name | $cpu_us us | $rps | $p50 ms (+$added) | $rss MB | $st ms |")
  if [ -n "${RESULTS:-}" ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$cpu_us" "$rps" "$p50" "$added" "$rss" "$st" none >>"$RESULTS"
  fi
}

# kvbridge proxy (vllm flow), once per configuration.
IFS=';' read -ra CONFIGS <<<"$KVB_CONFIGS"
for c in "${CONFIGS[@]}"; do
  IFS=: read -r cname cbin cargs <<<"$c"
  cbin=${cbin:-$KVB}
  [ -x "$cbin" ] || { echo "no kvbridge binary at $cbin" >&2; exit 2; }
  # shellcheck disable=SC2086 # extra args are split on purpose
  RUST_LOG=warn "$cbin" proxy --flow vllm --host 127.0.0.1 --port $PORT_X \
    --prefiller-host 127.0.0.1 --prefiller-port "${PORT_P[0]},${PORT_P[1]}" \
    --decoder-host 127.0.0.1 --decoder-port "${PORT_D[0]},${PORT_D[1]}" $cargs >"$WORK/logs/$cname.log" 2>&1 & KPID=$!; PIDS+=($KPID)
  wait_health http://127.0.0.1:$PORT_X
  measure "$cname" "$KPID" http://127.0.0.1:$PORT_X
  kill "$KPID"; wait "$KPID" 2>/dev/null || true
done

PS=http://127.0.0.1:${PORT_P[0]},http://127.0.0.1:${PORT_P[1]}
DS=http://127.0.0.1:${PORT_D[0]},http://127.0.0.1:${PORT_D[1]}
for r in $ROUTERS; do
  "$SHARED/peers/routers.sh" start "$r" 18020 "$PS" "$DS" >/dev/null
  RPID=$(cat "${PEERS_DIR:-$HOME/.cache/kvbridge-peers}/run/router.pid")
  measure "$r-router" "$RPID" http://127.0.0.1:18020
  "$SHARED/peers/routers.sh" stop >/dev/null
done

if [ -n "${RESULTS:-}" ]; then
  printf 'direct\t\t\t%s\t\t\t%s\tnone\n' "$DIRECT_P50" "$DIRECT_STREAM" >>"$RESULTS"
fi
echo
echo "direct backend: p50 $DIRECT_P50 ms at 1 connection; streamed 8 tokens (2 ms apart): $DIRECT_STREAM ms"
echo
echo "every request of every measurement answered 2xx"
echo
echo "| proxy | CPU per request | rps at 16 conns | p50 at 1 conn (added) | RSS | streamed 8 tokens |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
