#!/usr/bin/env bash
# The fault-injection suite of docs/reliability.md. Its tests come from scripts/faults.tsv
# (one line per row and test), and the script fails when:
#   - the table of docs/reliability.md and faults.tsv disagree: a row of the doc with no test
#     in the tsv, a tsv test its doc row does not name, or a test the doc names that the tsv
#     does not list;
#   - a test of the tsv no longer exists under its name (`cargo test -- --list`);
#   - a test fails, or does not report `ok` under its name.
# Usage:
#   scripts/faults.sh           the quick suite (also part of `cargo test --workspace`)
#   scripts/faults.sh --long    plus the ignored long runs (20,000 simulator seeds) and a
#                               2-minute chaos soak
#   scripts/faults.sh --check   only the checks above that run no test: doc <-> tsv, and
#                               that every named test exists
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
TSV=scripts/faults.tsv
DOC=docs/reliability.md
fail=0

# --- 1. The doc's table and the tsv name the same tests --------------------------------
# The doc's rows: "| N | scenario | expected | observed | tests |"; the tests column is the last.
doc_rows=$(grep -E '^\| [0-9]+ \|' "$DOC" | awk -F'|' '{gsub(/ /,"",$2); print $2}')
tsv_lines=$(grep -Ev '^(#|$)' "$TSV")

doc_tests_col() { # the tests column of doc row $1
  grep -E "^\| $1 \|" "$DOC" | awk -F'|' '{print $(NF-1)}'
}

# Python tests (`python/...py`, `file.py::name`) run in scripts/test.sh's suites, not here: a
# row that names only those needs no line in the tsv.
rust_tokens() { grep -oE '`[^` ]+`' | tr -d '`' | grep -v '\.py' || true; }
for r in $doc_rows; do
  if ! awk -F'\t' -v r="$r" '$1==r {found=1} END {exit !found}' <<<"$tsv_lines" \
    && [ -n "$(doc_tests_col "$r" | rust_tokens | grep -E '(\.rs|^[a-z][a-z0-9_:]+)$')" ]; then
    echo "FAIL doc row $r names no test in $TSV"; fail=1
  fi
done
while IFS=$'\t' read -r row pkg target name mode; do
  col=$(doc_tests_col "$row")
  if [ -z "$col" ]; then echo "FAIL $TSV: row $row is not in $DOC"; fail=1; continue; fi
  short=${name##*::}
  # A test is named in its row either by name or by its whole file (`crate/tests/x.rs`).
  if ! grep -qE -- "(^|[^a-z0-9_])$short([^a-z0-9_]|\$)" <<<"$col" && ! grep -qF -- "$pkg/tests/$target.rs\`" <<<"$col"; then
    echo "FAIL $DOC row $row does not name $pkg/$target::$name"; fail=1
  fi
done <<<"$tsv_lines"
for r in $doc_rows; do
  # Every backticked test name of the row (not a file, not a command) is in the tsv.
  for tok in $(doc_tests_col "$r" | rust_tokens); do
    case "$tok" in *.rs) continue ;; esac
    short=${tok##*::}
    [[ "$short" =~ ^[a-z][a-z0-9_]+$ ]] || continue
    if ! awk -F'\t' -v r="$r" -v n="$short" '$1==r && ($4==n || $4 ~ ("::" n "$")) {f=1} END {exit !f}' <<<"$tsv_lines"; then
      echo "FAIL $DOC row $r names \`$tok\`, which $TSV does not list for that row"; fail=1
    fi
  done
done
[ $fail -eq 0 ] && echo "ok   $DOC and $TSV agree ($(wc -l <<<"$tsv_lines") entries, $(wc -w <<<"$doc_rows") rows)"

# --- 2. Every test exists under its name ------------------------------------------------
target_args() { if [ "$2" = lib ]; then echo "-p $1 --lib"; else echo "-p $1 --test $2"; fi; }
groups=$(awk -F'\t' '{print $2"\t"$3}' <<<"$tsv_lines" | sort -u)
while IFS=$'\t' read -r pkg target; do
  # shellcheck disable=SC2046
  if ! list=$(cargo test -q $(target_args "$pkg" "$target") -- --list 2>&1 </dev/null); then
    echo "FAIL $pkg/$target does not build:"; tail -30 <<<"$list"; fail=1; continue
  fi
  for name in $(awk -F'\t' -v p="$pkg" -v t="$target" '$2==p && $3==t {print $4}' <<<"$tsv_lines" | sort -u); do
    grep -qx -- "$name: test" <<<"$list" || { echo "FAIL $pkg/$target::$name does not exist"; fail=1; }
  done
done <<<"$groups"
[ $fail -eq 0 ] || { echo "fault suite: FAIL"; exit 1; }
echo "ok   every test of $TSV exists"
[ "$MODE" = --check ] && { echo "fault suite: checks PASS (no test run)"; exit 0; }

# --- 3. Run them --------------------------------------------------------------------------
run_group() { # pkg target mode names...
  local pkg=$1 target=$2 mode=$3; shift 3
  local log extra=()
  log=$(mktemp)
  [ "$mode" = quick ] || extra=(--ignored)
  # shellcheck disable=SC2046
  cargo test $(target_args "$pkg" "$target") -- "${extra[@]}" --exact "$@" >"$log" 2>&1 </dev/null || true
  local bad=0
  for n in "$@"; do
    if grep -q "^test $n \.\.\. ok" "$log"; then echo "ok   $pkg/$target::$n"; else echo "FAIL $pkg/$target::$n"; bad=1; fi
  done
  [ $bad -eq 0 ] || { tail -60 "$log"; fail=1; }
  rm -f "$log"
}

netns_ok=0
if ip netns add kvb-faults-probe 2>/dev/null; then ip netns del kvb-faults-probe; netns_ok=1; fi

while IFS=$'\t' read -r pkg target; do
  for mode in quick long root; do
    mapfile -t names < <(awk -F'\t' -v p="$pkg" -v t="$target" -v m="$mode" '$2==p && $3==t && $5==m {print $4}' <<<"$tsv_lines" | sort -u)
    [ ${#names[@]} -gt 0 ] || continue
    case "$mode" in
      long) [ "$MODE" = --long ] || { echo "skip $pkg/$target: ${names[*]} (--long)"; continue; } ;;
      root) [ $netns_ok -eq 1 ] || { echo "skip $pkg/$target: ${names[*]} (network namespaces need root)"; continue; } ;;
    esac
    run_group "$pkg" "$target" "$mode" "${names[@]}"
  done
done <<<"$groups"

if [ "$MODE" = --long ]; then
  # Row 16 at a smaller scale (the 30-minute run is `kvbridge demo --duration 30m --chaos`).
  cargo run --release -q -p kvbridge-cli -- demo --duration 2m --chaos </dev/null || fail=1
fi
[ $fail -eq 0 ] && echo "fault suite: PASS" || { echo "fault suite: FAIL"; exit 1; }
