#!/usr/bin/env bash
# Runs every fuzz target in turn, SECONDS each (default 600), one fuzzer process at a time
# (niced), starting from the committed seeds, then minimizes the working corpus
# (fuzz/corpus/<target>, not committed) with -merge=1.
#   fuzz/run.sh [SECONDS]            all targets
#   TARGETS="handshake" fuzz/run.sh 60
# Needs cargo-fuzz (`cargo install cargo-fuzz`); works on stable (no sanitizer). A crash
# leaves its input in fuzz/artifacts/<target>/ and stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
read -r -a targets <<<"${TARGETS:-frame_decoder handshake op_validation proxy_request proxy_http zmtp_pull}"
# proxy_http takes proxy_request's inputs and starts from its seeds.
seeds_of() { if [ "$1" = proxy_http ]; then echo proxy_request; else echo "$1"; fi; }
flags=(--sanitizer none -O -a)
cargo fuzz build "${flags[@]}"
mkdir -p fuzz/logs
for t in "${targets[@]}"; do
    seeds="fuzz/seeds/$(seeds_of "$t")"
    mkdir -p "fuzz/corpus/$t" "$seeds"
    echo "== $t: ${secs}s" >&2
    rc=0
    nice -n 10 cargo fuzz run "${flags[@]}" "$t" "fuzz/corpus/$t" "$seeds" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1 >"fuzz/logs/$t.log" 2>&1 || rc=$?
    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "fuzz/logs/$t.log" >&2 || true
    if [ "$rc" -ne 0 ]; then
        echo "$t: crash (exit $rc), see fuzz/logs/$t.log and fuzz/artifacts/$t/" >&2
        exit 1
    fi
    # Keep the working corpus minimal: only the inputs that add coverage. The committed
    # seeds (fuzz/seeds) are a small hand-picked subset; see fuzz/README.md.
    rm -rf "fuzz/corpus/$t.min" && mkdir "fuzz/corpus/$t.min"
    cargo fuzz run "${flags[@]}" "$t" "fuzz/corpus/$t.min" "fuzz/corpus/$t" "$seeds" \
        -- -merge=1 >"fuzz/logs/$t.merge.log" 2>&1
    rm -rf "fuzz/corpus/$t" && mv "fuzz/corpus/$t.min" "fuzz/corpus/$t"
    echo "$t: corpus of $(ls "fuzz/corpus/$t" | wc -l) inputs" >&2
done
