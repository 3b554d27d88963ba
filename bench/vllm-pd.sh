#!/usr/bin/env bash
# TTFT, load time and KV GiB/s of a real 1P1D vLLM CPU deployment behind `kvbridge proxy --flow vllm`:
# KvbridgeConnector against vLLM's NixlConnector in the same run, on the same locally made
# random-weight Llama and the same prompts (bench/vllm_pd.py). One pair of servers is up at a
# time: each run starts a pair, measures it, stops it, then does the same with the other.
#
# Usage: bench/vllm-pd.sh [bench/vllm_pd.py flags: --runs 3 --requests 10 --prompt-tokens 900
#                          --prefill-tp 1|2 --decode-tp 1|2 --lease-s S
#                          --layers 8 --kv-heads 4 --head-dim 64 --connectors kvbridge,nixl
#                          --load-timer on|off --keep-affinity]
# Load time per request and decoder rank comes from bench/vllm_load_timer.py around the
# decoder's connector (--load-timer off: without it); --keep-affinity is a diagnostic that
# undoes NixlConnector's move of the worker thread that builds it (docs/vllm.md).
# Env: BENCH_DIR (default /tmp/kvbridge-vllm-pd), KVBRIDGE_BIN (default target/release/kvbridge,
#      else target/debug/kvbridge), RESULTS=file to also save the output (with the commit).
# Needs scripts/test-vllm.sh's .venv. NixlConnector needs `nixl`, which this script installs
# into .venv on first use (a benchmark-time install, not a test dependency): the nixl meta
# package picks its CUDA 13 variant from torch's CUDA version, so both are installed without
# their dependencies (../shared/design/cpu-real-engines.md, B1).
# A run in which any request failed prints FAILED, no figure, and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${KVBRIDGE_VENV:-$PWD/.venv}/bin/python
NIXL_VERSION=1.5.1
[ -x "$PY" ] || { echo "bench/vllm-pd.sh: no .venv; run scripts/test-vllm.sh --setup-only" >&2; exit 1; }
if [[ " $* " != *" --connectors kvbridge "* ]] && ! "$PY" -c "import nixl._api" 2>/dev/null; then
  echo "bench/vllm-pd.sh: installing nixl $NIXL_VERSION (benchmark only)" >&2
  "$PY" -m pip install --quiet --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
fi
WORK=${BENCH_DIR:-/tmp/kvbridge-vllm-pd}
rm -rf "$WORK" && mkdir -p "$WORK"
out=$WORK/output.txt
{
  echo "# bench/vllm-pd.sh $* on $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- python bench crates || echo '+dirty'), $(date -u +%FT%TZ)"
  echo "# host: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), kvbridge binary ${KVBRIDGE_BIN:-target/release or debug}"
} | tee "$out"
"$PY" bench/vllm_pd.py --work "$WORK" "$@" 2>"$WORK/stderr.txt" | tee -a "$out" || {
  tail -20 "$WORK/stderr.txt" >&2
  echo "bench/vllm-pd.sh: FAILED (logs in $WORK/logs)" >&2
  exit 1
}
if [ -n "${RESULTS:-}" ]; then cp "$out" "$RESULTS"; fi
