#!/usr/bin/env bash
# TTFT and transfer time of a real 1P1D SGLang CPU deployment over kvbridge against SGLang's own
# NIXL and Mooncake transfer backends, in the same run, on the same locally made random-weight
# Llama and the same prompts (bench/sglang_pd.py): each backend's pair behind SGLang's router
# (sglang-router, PD mode), the kvbridge pair also behind `kvbridge proxy --flow sglang`. One
# pair of servers is up at a time; runs alternate the order of the backends.
#
# Usage: bench/sglang-pd.sh [bench/sglang_pd.py flags: --runs 3 --requests 6 --prompt-tokens 900
#                            --max-tokens 4 --chunk-tokens 256 --layers 8 --kv-heads 4 --head-dim 64
#                            --backends kvbridge,nixl,mooncake --proxy on|off --timer on|off --pin on|off
#                            --decode-allocation-policy early|prefill_complete]
# --decode-allocation-policy: SGLang's --disaggregation-decode-allocation-policy on both servers
# (default early); SGLang takes prefill_complete with Mooncake only (kvbridge's hook adds
# kvbridge), so under it the backends default to kvbridge,mooncake and nixl is refused.
# Transfer time per request comes from bench/sglang_transfer_timer.py around every backend's
# receiver and sender classes (--timer off: without it; the answers must not change).
# Env: BENCH_DIR (default /tmp/kvbridge-sglang-pd), KVBRIDGE_SGLANG_VENV (default .venv-sglang,
#      made by scripts/test-sglang.sh --setup-only), KVBRIDGE_BIN (default target/release/kvbridge,
#      else target/debug/kvbridge), RESULTS=file to also save the output (with the commit).
# SGLang's NIXL backend needs `nixl` and its Mooncake backend `mooncake-transfer-engine`, which
# this script installs into that venv on first use (benchmark-time installs, not test
# dependencies): nixl's meta package picks its CUDA 13 variant from torch's CUDA version, so
# both are installed without their dependencies (../shared/design/cpu-real-engines.md, B1);
# Mooncake's CPU-only wheel (its CUDA one does not import without CUDA) runs over TCP.
# A run in which any request failed or answered other than a single server prints FAILED, no
# figure, and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVBRIDGE_SGLANG_VENV:-$PWD/.venv-sglang}
PY=$VENV/bin/python
NIXL_VERSION=1.5.1
MOONCAKE_VERSION=0.3.13.post1
[ -x "$PY" ] || { echo "bench/sglang-pd.sh: no $VENV; run scripts/test-sglang.sh --setup-only" >&2; exit 1; }
"$PY" -c "import sglang_router" 2>/dev/null || { echo "bench/sglang-pd.sh: sglang-router missing in $VENV (scripts/test-sglang.sh installs it)" >&2; exit 1; }
if ! "$PY" -c "import nixl._api" 2>/dev/null; then
  echo "bench/sglang-pd.sh: installing nixl $NIXL_VERSION (benchmark only)" >&2
  "$PY" -m pip install --quiet --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
fi
if ! "$PY" -c "from mooncake.engine import TransferEngine" 2>/dev/null; then
  echo "bench/sglang-pd.sh: installing mooncake-transfer-engine-non-cuda $MOONCAKE_VERSION (benchmark only)" >&2
  "$PY" -m pip install --quiet "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
fi
# this tree's kvbridge package in every server, whatever the venv's own points to, so that
# the figures are those of the commit in the header
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
WORK=${BENCH_DIR:-/tmp/kvbridge-sglang-pd}
rm -rf "$WORK" && mkdir -p "$WORK"
out=$WORK/output.txt
{
  echo "# bench/sglang-pd.sh $* on $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- python bench crates || echo '+dirty'), $(date -u +%FT%TZ)"
  echo "# host: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); SGLang $("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))'), sglang-router $("$PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))'), nixl $("$PY" -c 'import importlib.metadata as m; print(m.version("nixl"))'), mooncake-transfer-engine-non-cuda $("$PY" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))'); kvbridge package $("$PY" -c 'import kvbridge, os; print(os.path.dirname(kvbridge.__file__))' 2>/dev/null), binary ${KVBRIDGE_BIN:-target/release or debug}"
} | tee "$out"
"$PY" bench/sglang_pd.py --work "$WORK" "$@" 2>"$WORK/stderr.txt" | tee -a "$out" || {
  tail -20 "$WORK/stderr.txt" >&2
  echo "bench/sglang-pd.sh: FAILED (logs in $WORK/logs)" >&2
  exit 1
}
if [ -n "${RESULTS:-}" ]; then cp "$out" "$RESULTS"; fi
