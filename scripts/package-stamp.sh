#!/usr/bin/env bash
# Prints what the kvbridge Python package is built from: its build arguments ($1) and the
# sources of python/ and of the crates it links. scripts/test.sh and scripts/test-vllm.sh
# compare it with the stamp of the installed package (.venv/.kvbridge-src) and rebuild only
# when it changed; one stamp for both, so that neither rebuilds after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "${1:-}"
  find python crates -path python/target -prune -o -type f \( -name '*.rs' -o -name '*.py' \
    -o -name '*.pyi' -o -name '*.toml' -o -name 'Cargo.lock' \) -print \
    | grep -v -E '^python/tests/|^crates/[^/]+/(tests|benches|fuzz)/' | LC_ALL=C sort | xargs sha256sum
} | sha256sum | cut -d' ' -f1
