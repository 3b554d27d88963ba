#!/usr/bin/env bash
# The fault-injection suite of docs/reliability.md, by test name: each row of the table is run
# here, and a test that no longer exists under its name fails the script (0 tests run is an
# error, not a pass).
#   scripts/faults.sh          the quick suite (also part of `cargo test --workspace`)
#   scripts/faults.sh --long   plus the 20,000-seed simulation and a 2-minute chaos soak
set -euo pipefail
cd "$(dirname "$0")/.."
LONG=${1:-}

# package  test-target  test names...
SUITE=(
  "kvbridge-sim killed killed_prefiller_fails_its_requests_cleanly_and_leaks_no_page killed_decoder_fails_its_streams_cleanly_and_the_rest_succeed"
  "kvbridge-sim soak chaos_kills_lose_nothing_and_hang_nothing without_chaos_every_request_succeeds"
  "kvbridge-pd pd_e2e sender_killed_mid_transfer no_three_way_deadlock_when_buffer_nearly_full request_larger_than_buffer_fails_fast_naming_sizes no_page_reuse_while_cancelled_write_in_flight"
  "kvbridge-pd alloc_failure a_region_larger_than_memory_is_a_typed_error_naming_its_size a_receive_buffer_that_cannot_be_allocated_fails_start_and_frees_its_port"
  "kvbridge-pd pd_fence"
  "kvbridge-pd outcome_reconnect"
  "kvbridge handshake restarted_peer_replaces_its_session_and_old_work_fails_peer_restarted killed_listener_mid_handshake_then_restart_succeeds thirty_two_initiators_are_not_blocked_by_a_stalled_peer"
  "kvbridge simulation handshake_and_first_write_under_1000_seeds"
  "kvbridge hostile_peer"
  "kvbridge bytes_in_flight"
  "kvbridge shm_peer_death"
  "kvbridge shm_detach"
  "kvbridge tls plaintext_initiator_is_refused_by_a_tls_listener_with_a_typed_error tls_initiator_against_a_plaintext_listener_fails_typed untrusted_certificate_fails_typed expired_certificate_fails_typed a_listener_that_never_answers_the_tls_handshake_times_out_typed"
  "kvbridge-cli processes listener_process_killed_mid_handshake_then_restarted"
  "kvbridge-proxy e2e kv_outcome_never_arrives_gives_504_within_the_deadline kv_failed_gives_502_at_once decoder_dies_mid_stream_gives_an_sse_error_event"
  "kvbridge-proxy outcome_faults"
)

fail=0
for row in "${SUITE[@]}"; do
  read -r pkg target names <<<"$row"
  log=$(mktemp)
  if [ -z "$names" ]; then
    cargo test -q -p "$pkg" --test "$target" >"$log" 2>&1 || fail=1
    grep -Eq "test result: ok\. [1-9][0-9]* passed" "$log" || { echo "FAIL $pkg/$target"; cat "$log"; fail=1; continue; }
    echo "ok   $pkg/$target (all)"
  else
    # shellcheck disable=SC2086
    cargo test -p "$pkg" --test "$target" -- --exact $names >"$log" 2>&1 || fail=1
    for n in $names; do
      if grep -q "test $n ... ok" "$log"; then echo "ok   $pkg/$target::$n"; else echo "FAIL $pkg/$target::$n"; fail=1; fi
    done
    [ $fail -eq 0 ] || tail -40 "$log"
  fi
  rm -f "$log"
done

# A real partition between network namespaces: needs root and iproute2.
if ip netns add kvb-faults-probe 2>/dev/null; then
  ip netns del kvb-faults-probe
  log=$(mktemp)
  if cargo test -p kvbridge-cli --test netns_partition -- --ignored --exact partition_mid_write_fails_within_the_deadline_and_heals >"$log" 2>&1 \
     && grep -q "test partition_mid_write_fails_within_the_deadline_and_heals ... ok" "$log"; then
    echo "ok   kvbridge-cli/netns_partition::partition_mid_write_fails_within_the_deadline_and_heals"
  else
    echo "FAIL kvbridge-cli/netns_partition"; tail -40 "$log"; fail=1
  fi
  rm -f "$log"
else
  echo "skip kvbridge-cli/netns_partition (network namespaces need root)"
fi

if [ "$LONG" = "--long" ]; then
  cargo test -p kvbridge --test simulation -- --ignored handshake_and_first_write_under_20000_seeds || fail=1
  cargo run --release -q -p kvbridge-cli -- demo --duration 2m --chaos || fail=1
fi
[ $fail -eq 0 ] && echo "fault suite: PASS" || { echo "fault suite: FAIL"; exit 1; }
