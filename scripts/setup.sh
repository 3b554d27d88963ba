#!/usr/bin/env bash
# Installs what building and testing kvbridge needs beyond the Rust toolchain, on a fresh
# Debian machine. Idempotent; CI (.ci/run) calls it first.
#   - Debian packages: libucx-dev (UCX headers and libraries) and libclang-dev (bindgen) for
#     the `ucx` feature of crates/kvbridge-ucx; wrk and curl for the proxy benchmark's tests
#     (crates/kvbridge-cli/tests/bench_proxy.rs); nothing else needs any (every other Rust
#     dependency is pure Rust or vendored). Benchmarks against peers install their own.
#   - Python packages for the interop tests: pyzmq and msgspec speak to our ZMQ outcomes the
#     way LMCache's proxy does; openai is the official client streaming through the proxy.
set -euo pipefail
APT_PACKAGES=(libucx-dev libclang-dev wrk curl)
if [ ${#APT_PACKAGES[@]} -gt 0 ]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
if ! python3 -c "import zmq, msgspec, openai" 2>/dev/null; then
  python3 -m pip install --quiet pyzmq msgspec openai
fi
command -v cargo-clippy >/dev/null && command -v rustfmt >/dev/null || rustup component add clippy rustfmt
echo "setup: ok"
