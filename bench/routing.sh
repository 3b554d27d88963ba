#!/usr/bin/env bash
# The routing policies side by side on one workload, in one run: the kvbridge proxy's
# least-loaded, cache-aware and kv-events (PD reference engines behind it) and SGLang
# router's cache_aware (regular mode, in front of colocated reference engines: as many
# engines as the PD cluster's prefillers and decoders together, same cost model, same prefix
# cache). Each `kvbridge demo --workload shared-prefix` run starts its own engines; the
# policies take turns within each round so that the host's noise falls on all of them.
#
# Usage: bench/routing.sh   (env: RUNS=3, REQUESTS=128, CONCURRENCY=8, KVBRIDGE=path/to/kvbridge,
#                            POLICIES="least-loaded cache-aware kv-events sglang",
#                            OUT=raw results file (JSON lines), DEMO_ARGS=extra demo flags)
# Needs: python3; SGLang's router installs itself on first use into
# ${PEERS_DIR:-~/.cache/kvbridge-peers}/venv (sglang-router 0.3.2).
# Prints a markdown table: medians over the runs, (min-max). A run in which any request
# failed measured failures, not routing: the script says FAILED on stderr, exits 1 and prints
# no figure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-3}
REQUESTS=${REQUESTS:-128}
CONCURRENCY=${CONCURRENCY:-8}
POLICIES=${POLICIES:-least-loaded cache-aware kv-events sglang}
KVB=${KVBRIDGE:-${CARGO_TARGET_DIR:-$ROOT/target}/release/kvbridge}
PEERS=${PEERS_DIR:-$HOME/.cache/kvbridge-peers}
OUT=${OUT:-$(mktemp /tmp/kvbridge-routing.XXXXXX.jsonl)}
[ -x "$KVB" ] || { echo "no kvbridge binary at $KVB: cargo build --release -p kvbridge-cli" >&2; exit 2; }
export HF_ENDPOINT=http://127.0.0.1:9 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ " $POLICIES " == *" sglang "* ]] && [ ! -x "$PEERS/venv/bin/python" -o ! -x "$PEERS/venv/bin/sglang-router" ]; then
  [ -x "$PEERS/venv/bin/python" ] || python3 -m venv "$PEERS/venv"
  "$PEERS/venv/bin/pip" install -q sglang-router==0.3.2
fi
# The router's flags; WORKER_URLS, ROUTER_PORT and METRICS_PORT come from the demo.
SGLANG="$PEERS/venv/bin/python -m sglang_router.launch_router --worker-urls \$WORKER_URLS \
--policy cache_aware --host 127.0.0.1 --port \$ROUTER_PORT --prometheus-host 127.0.0.1 \
--prometheus-port \$METRICS_PORT --log-level warn"
common=(demo --workload shared-prefix --layers 2 --requests "$REQUESTS"
  --concurrency "$CONCURRENCY" --compare 2 --ttft-samples 0 --ceiling-reps 0 --json)
read -ra extra <<<"${DEMO_ARGS:-}"
: >"$OUT"
echo "# $(date -u +%FT%TZ) commit $(git -C "$ROOT" rev-parse --short=12 HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for r in $(seq "$RUNS"); do
  for p in $POLICIES; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    if [ "$p" = sglang ]; then
      line=$("$KVB" "${common[@]}" "${extra[@]}" --peer-router "$SGLANG") || rc=$?
    else
      line=$("$KVB" "${common[@]}" "${extra[@]}" --routing "$p") || rc=$?
    fi
    if [ "${rc:-0}" != 0 ] || [ -z "$line" ]; then
      echo "FAILED: run $r of $p exited ${rc:-0}: $line" >&2
      exit 1
    fi
    echo "$line" | python3 -c 'import json,sys
v=json.load(sys.stdin); v["policy"]=sys.argv[1]; v["run"]=int(sys.argv[2]); v["load1"]=float(sys.argv[3])
print(json.dumps(v))' "$p" "$r" "$load" >>"$OUT"
    echo "run $r $p done (load $load)" >&2
  done
done
echo "# raw results: $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
bad = [r for r in rows if r.get("failed", 1) or r.get("ok") != r.get("requests")
       or r.get("kv_mismatches", 0) or r.get("kv_missing", 0)
       or r.get("outputs_match_colocated", True) is False]
if bad:
    for r in bad:
        print(f"FAILED: {r['policy']} run {r['run']}: ok {r.get('ok')} of {r.get('requests')}, "
              f"errors {r.get('errors')}", file=sys.stderr)
    sys.exit(1)
def fmt(vals, f):
    m = statistics.median(vals)
    return f"{f(m)} ({f(min(vals))}-{f(max(vals))})"
ms = lambda v: f"{v:.0f}"
kt = lambda v: f"{v/1000:.1f}k"
mib = lambda v: f"{v/2**20:.0f}"
pc = lambda v: f"{v:.0f}%"
order = []
for r in rows:
    if r["policy"] not in order:
        order.append(r["policy"])
first = rows[0]
print(f"prompt tokens {first['prompt_tokens']}, shared {first['shared_prompt_tokens']} "
      f"({100*first['shared_fraction']:.1f}%), prefix cache {first['prefix_cache_tokens']} tokens per engine")
# The goal on the shared fraction's own base: the prompt tokens a run did not compute.
if "shared_chunk_tokens" in first:
    sc = first["shared_chunk_tokens"] / first["prompt_tokens"]
    print(f"goal on all prompt tokens: spared at least {100*first['shared_fraction']-10:.1f}% "
          f"(shared {100*first['shared_fraction']:.1f}% less 10 points; in whole chunks "
          f"{100*sc:.1f}%, the most the caches can spare)")
# The fraction routing can act on: the shared tokens beyond the prefix every prompt starts
# with (each engine caches it under any router), over the prompt tokens beyond it.
if "routable_shared_fraction" in first:
    rf = first["routable_shared_fraction"]
    print(f"common prefix {first['common_prefix_tokens']} tokens; routable shared "
          f"{first['routable_shared_tokens']} ({100*rf:.1f}%): goal, a cut of at least "
          f"{100*rf-10:.1f}% against least-loaded")
    ll = [r["prefill_tokens_computed"] for r in rows if r["policy"] == "least-loaded"]
    if ll:
        o = first["oracle_prefill_tokens"]
        print(f"oracle (every request where its longest earlier prompt is cached, one cache, "
              f"no eviction): {o/1000:.1f}k computed, a cut of "
              f"{100*(1-o/statistics.median(ll)):.0f}% against least-loaded's median")
print()
print("| routing | TTFT p50 ms | TTFT p99 ms | prefill tokens computed | spared of prompt tokens | cut vs least-loaded | KV moved MiB | decoder alone | load avg |")
print("|---|---|---|---|---|---|---|---|---|")
base = [r["prefill_tokens_computed"] for r in rows if r["policy"] == "least-loaded"]
for p in order:
    rs = [r for r in rows if r["policy"] == p]
    cut = "-"
    if base and p != "least-loaded":
        cut = fmt([1 - r["prefill_tokens_computed"] / statistics.median(base) for r in rs],
                  lambda v: f"{100*v:.0f}%")
    name = "SGLang router cache_aware" if p == "sglang" else p
    dec = fmt([r.get("decode_only", 0) for r in rs], lambda v: f"{v:.0f}") if p != "sglang" else "(colocated)"
    print(f"| {name} | {fmt([r['ttft_p50_ms'] for r in rs], ms)} | {fmt([r['ttft_p99_ms'] for r in rs], ms)} "
          f"| {fmt([r['prefill_tokens_computed'] for r in rs], kt)} "
          f"| {fmt([r['prefill_tokens_spared_fraction'] for r in rs], lambda v: f'{100*v:.1f}%')} | {cut} "
          f"| {fmt([r['kv_bytes_moved'] for r in rs], mib)} | {dec} "
          f"| {fmt([r['load1'] for r in rs], lambda v: f'{v:.1f}')} |")
PY
