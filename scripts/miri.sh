#!/usr/bin/env bash
# Runs the sans-IO crates' unit tests under miri (nightly), which fails on undefined
# behaviour: out-of-bounds or misaligned access, use after free, invalid values, data races
# between threads, and aliasing that breaks the borrow rules (Stacked Borrows).
#   kvbridge-proto: every unit test (frames, messages, handshake, auth, ZMTP parsing).
#   kvbridge-pd:    the allocator, chunk keys and layouts (`alloc::`, `key::`, `layout::`).
# Usage: scripts/miri.sh   (installs miri and rust-src for the nightly toolchain if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup run nightly cargo miri --version >/dev/null 2>&1; then
  if ! rustup toolchain install nightly --profile minimal --component miri,rust-src >/dev/null 2>&1 \
    && ! rustup component add miri rust-src --toolchain nightly >/dev/null 2>&1; then
    echo "miri.sh: cannot install miri and rust-src for the nightly toolchain" \
      "(rustup toolchain install nightly --component miri,rust-src failed: offline, or no" \
      "nightly for this host); miri was NOT run" >&2
    exit 2
  fi
fi
# Its own target directory: miri's build artefacts never mix with the normal build's.
export CARGO_TARGET_DIR="${MIRI_TARGET_DIR:-target/miri}"
# proptest looks up the working directory (for its regression files), which miri's isolation
# refuses; and each case costs ~1000x under miri, so the property tests run 16 cases each.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
export PROPTEST_CASES="${PROPTEST_CASES:-16}"
cargo +nightly miri setup >/dev/null
cargo +nightly miri test -p kvbridge-proto --lib
cargo +nightly miri test -p kvbridge-pd --lib -- alloc:: key:: layout::
echo "miri: ok"
