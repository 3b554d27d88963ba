//! The quick soak CI runs: the proxy and four workers as real processes, a workload through
//! the proxy, and `kill -9` of every worker and the proxy in turn (~1 s apart), each restarted on
//! its ports (a decoder restarting under the same id). No request may hang, no KV byte may
//! differ, no page may stay taken, and requests must succeed again once the chaos stops.
//! The long run is `kvbridge demo --duration 30m --chaos` (see docs/reliability.md).

mod common;

use kvbridge_sim::soak::{self, SoakOptions};
use std::time::Duration;

fn options(chaos: bool, duration: Duration) -> SoakOptions {
    SoakOptions {
        chaos,
        duration,
        ..common::soak_options()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kills_lose_nothing_and_hang_nothing() {
    // Five kills need five rounds of (interval, 0.2-1.5 s down, restart): at a 1 s mean
    // interval about 10 s on a quiet host; 20 s leaves room for a loaded one (at 1.5 s and 12 s
    // a loaded CI host got to four).
    let s = soak::run(SoakOptions {
        chaos_interval: Duration::from_secs(1),
        ..options(true, Duration::from_secs(20))
    })
    .await
    .expect("the soak runs");
    println!("{}", s.table());
    assert_eq!(s.hangs, 0, "{s:#?}");
    assert_eq!(s.kv_mismatches, 0, "{s:#?}");
    assert_eq!(s.outputs_mismatched, 0, "{s:#?}");
    assert_eq!(s.pages_leaked, 0, "{s:#?}");
    assert!(s.quiesced, "{s:#?}");
    assert!(
        s.kills >= 5,
        "chaos must have killed every process once: {s:#?}"
    );
    assert_eq!(s.restarts, s.kills, "{s:#?}");
    assert!(s.ok > 0 && s.outputs_compared > 0, "{s:#?}");
    assert!(s.passed(), "{}", s.table());
    // A port in the kernel's ephemeral range can be taken by any outgoing connection while its
    // worker is down, and the restart then fails for as long as that connection lives.
    let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    assert_eq!(s.addresses.len(), 5, "{s:#?}");
    for (name, addr) in &s.addresses {
        let port = addr
            .parse::<std::net::SocketAddr>()
            .expect("an address")
            .port();
        assert!(
            port < ephemeral_low,
            "{name} listens on {addr}, in the ephemeral range (from {ephemeral_low})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_chaos_every_request_succeeds() {
    let s = soak::run(options(false, Duration::from_secs(4)))
        .await
        .expect("the soak runs");
    assert_eq!(s.failed, 0, "{}", s.table());
    assert_eq!(s.kills, 0);
    assert!(s.passed(), "{}", s.table());
}

/// Under kv-events every engine publishes its KV events on a port it keeps across restarts.
/// Each kill ends the proxy's subscription to that engine and its restart starts the
/// sequence over: the proxy must drop its view of the worker and rebuild it from the new
/// stream, with no request hanging meanwhile. The proxy is spared so that its counters
/// cover the whole run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_routing_rebuilds_its_views_through_worker_kills() {
    let s = soak::run(SoakOptions {
        chaos_interval: Duration::from_secs(1),
        chaos_proxy: false,
        routing: kvbridge_proxy::routing::RoutingPolicy::KvEvents,
        ..options(true, Duration::from_secs(20))
    })
    .await
    .expect("the soak runs");
    println!("{}", s.table());
    assert!(s.kills >= 4, "every worker killed once: {s:#?}");
    assert!(s.kv_events_batches.is_some_and(|b| b > 0), "{s:#?}");
    assert!(
        s.kv_events_views_dropped.is_some_and(|d| d > 0),
        "the workers' kills reached the proxy's views: {s:#?}"
    );
    assert!(s.passed(), "{}", s.table());
}
