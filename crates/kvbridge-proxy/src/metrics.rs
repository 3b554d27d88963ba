//! Prometheus metrics of the proxy, kept in atomics and rendered as text on `/metrics`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// How a request ended; each request is counted under exactly one outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered in full.
    Ok,
    /// The request was malformed (4xx from the proxy itself).
    BadRequest,
    /// A worker rejected the request with a 4xx that was passed on.
    Rejected,
    /// No healthy prefiller or decoder (503).
    NoWorker,
    /// Admission was full (429).
    AdmissionFull,
    /// The prefill failed (502) or timed out (504).
    PrefillError,
    /// A rank reported `KvFailed` (502).
    KvFailed,
    /// No KV-ready outcome arrived before `--kv-ready-timeout` (504).
    KvTimeout,
    /// The prefiller holding the KV was lost before every rank reported (502).
    PrefillerLost,
    /// The decoder failed before or while answering (502/504 or an SSE error event).
    DecodeError,
    /// The client went away before the answer was complete.
    Cancelled,
}

impl Outcome {
    /// Every outcome, in the order used for rendering.
    pub const ALL: [Outcome; 11] = [
        Outcome::Ok,
        Outcome::BadRequest,
        Outcome::Rejected,
        Outcome::NoWorker,
        Outcome::AdmissionFull,
        Outcome::PrefillError,
        Outcome::KvFailed,
        Outcome::KvTimeout,
        Outcome::PrefillerLost,
        Outcome::DecodeError,
        Outcome::Cancelled,
    ];

    /// The label value used in `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::BadRequest => "bad_request",
            Outcome::Rejected => "rejected",
            Outcome::NoWorker => "no_worker",
            Outcome::AdmissionFull => "admission_full",
            Outcome::PrefillError => "prefill_error",
            Outcome::KvFailed => "kv_failed",
            Outcome::KvTimeout => "kv_timeout",
            Outcome::PrefillerLost => "prefiller_lost",
            Outcome::DecodeError => "decode_error",
            Outcome::Cancelled => "cancelled",
        }
    }
}

const BUCKETS: [f64; 18] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];

/// A latency histogram with fixed buckets (seconds).
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    /// Number of observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[BUCKETS.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let sum = self.sum_ns.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cum}");
    }
}

/// All process-wide counters, gauges and histograms of the proxy.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [AtomicU64; Outcome::ALL.len()],
    /// Requests being served now.
    pub in_flight: AtomicI64,
    /// Requests waiting for an admission slot now.
    pub admission_queue: AtomicI64,
    /// Requests waiting for their KV-ready outcome now (owned by the waiter task).
    pub kv_waits_pending: AtomicI64,
    /// Outcome messages received, by type: ProxyNotif, KvReady, KvFailed.
    pub kv_outcomes: [AtomicU64; 3],
    /// KV waits failed because their prefiller was lost (ejected, or an outcome connection
    /// of it closed) before every rank reported.
    pub kv_waits_prefiller_lost: AtomicU64,
    /// Outcome messages for request ids nobody waits for (late or foreign); dropped.
    pub kv_outcomes_unknown: AtomicU64,
    /// Messages on the notification socket that could not be decoded.
    pub kv_outcomes_malformed: AtomicU64,
    /// Outcomes refused because a secret is set and their tag is missing or wrong.
    pub kv_outcomes_unauthenticated: AtomicU64,
    /// Outcome-port connections closed for breaking ZMTP or its limits (oversized frames,
    /// garbage, a handshake or frame not done within its deadline).
    pub outcome_conns_refused: AtomicU64,
    /// Outcome-port connections closed to make room for a new one at the connection cap.
    pub outcome_conns_evicted: AtomicU64,
    /// HTTP connections closed at once because the connection cap was reached.
    pub http_conns_refused: AtomicU64,
    /// Requests refused with 413 because their body exceeded `--max-body-bytes`.
    pub body_too_large: AtomicU64,
    /// Requests started over on another decoder because the prefiller could not reach
    /// theirs (`kv_receiver_unreachable`; no KV had moved).
    pub decoder_retries: AtomicU64,
    /// sglang flow: decode requests cancelled because their prefill failed first (the
    /// decode server would otherwise wait for KV that never comes).
    pub decodes_cancelled: AtomicU64,
    /// sglang flow: requests started over with another prefiller (and a new room) because
    /// theirs refused the connection.
    pub prefiller_retries: AtomicU64,
    /// Time from arrival to the first byte of the answer.
    pub ttft: Histogram,
    /// Duration of the prefill request.
    pub prefill: Histogram,
    /// Time from the end of the prefill to the last rank's KV-ready outcome.
    pub kv_wait: Histogram,
    /// Duration of the decode request, to its last byte.
    pub decode: Histogram,
    /// Whole request duration as seen by the proxy.
    pub request: Histogram,
}

impl Metrics {
    /// Counts one finished request.
    pub fn count_request(&self, o: Outcome) {
        let i = Outcome::ALL.iter().position(|x| *x == o).unwrap_or(0);
        self.requests[i].fetch_add(1, Relaxed);
    }

    /// Requests finished with outcome `o` so far.
    pub fn requests(&self, o: Outcome) -> u64 {
        let i = Outcome::ALL.iter().position(|x| *x == o).unwrap_or(0);
        self.requests[i].load(Relaxed)
    }

    /// Renders the process-wide part of `/metrics`; worker lines are appended by the caller.
    pub fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP kvbridge_proxy_requests_total Requests finished, by outcome.\n\
             # TYPE kvbridge_proxy_requests_total counter\n",
        );
        for o in Outcome::ALL {
            let _ = writeln!(
                out,
                "kvbridge_proxy_requests_total{{outcome=\"{}\"}} {}",
                o.as_str(),
                self.requests(o)
            );
        }
        let gauges = [
            ("in_flight", "Requests being served.", &self.in_flight),
            (
                "admission_queue",
                "Requests waiting for an admission slot.",
                &self.admission_queue,
            ),
            (
                "kv_waits_pending",
                "Request ids waiting for KV-ready outcomes.",
                &self.kv_waits_pending,
            ),
        ];
        for (n, h, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP kvbridge_proxy_{n} {h}\n# TYPE kvbridge_proxy_{n} gauge\nkvbridge_proxy_{n} {}",
                v.load(Relaxed)
            );
        }
        out.push_str(
            "# HELP kvbridge_proxy_kv_outcomes_total Outcome messages received, by type.\n\
             # TYPE kvbridge_proxy_kv_outcomes_total counter\n",
        );
        for (i, t) in ["ProxyNotif", "KvReady", "KvFailed"].iter().enumerate() {
            let _ = writeln!(
                out,
                "kvbridge_proxy_kv_outcomes_total{{type=\"{t}\"}} {}",
                self.kv_outcomes[i].load(Relaxed)
            );
        }
        self.render_counters(out);
        self.render_durations(out);
    }

    /// The process-wide counters of refusals and retries, one `_total` line each.
    fn render_counters(&self, out: &mut String) {
        let counters = [
            (
                "kv_outcomes_unknown_total",
                "Outcomes for ids nobody waits for (dropped).",
                &self.kv_outcomes_unknown,
            ),
            (
                "kv_outcomes_malformed_total",
                "Undecodable notification messages.",
                &self.kv_outcomes_malformed,
            ),
            (
                "kv_outcomes_unauthenticated_total",
                "Outcomes refused for a missing or wrong tag (a secret is set).",
                &self.kv_outcomes_unauthenticated,
            ),
            (
                "outcome_conns_refused_total",
                "Outcome-port connections closed for breaking ZMTP, its limits or its deadlines.",
                &self.outcome_conns_refused,
            ),
            (
                "outcome_conns_evicted_total",
                "Idle outcome-port connections closed to make room at the connection cap.",
                &self.outcome_conns_evicted,
            ),
            (
                "http_conns_refused_total",
                "HTTP connections closed at once at the connection cap.",
                &self.http_conns_refused,
            ),
            (
                "body_too_large_total",
                "Requests refused because their body exceeded --max-body-bytes.",
                &self.body_too_large,
            ),
            (
                "kv_waits_prefiller_lost_total",
                "KV waits failed at once because their prefiller was lost (ejected, or an outcome connection of it closed).",
                &self.kv_waits_prefiller_lost,
            ),
            (
                "decoder_retries_total",
                "Requests started over on another decoder because the prefiller could not reach theirs.",
                &self.decoder_retries,
            ),
            (
                "decodes_cancelled_total",
                "sglang flow: decode requests cancelled because their prefill failed first.",
                &self.decodes_cancelled,
            ),
            (
                "prefiller_retries_total",
                "sglang flow: requests started over with another prefiller because theirs refused the connection.",
                &self.prefiller_retries,
            ),
        ];
        for (n, h, v) in counters {
            let _ = writeln!(
                out,
                "# HELP kvbridge_proxy_{n} {h}\n# TYPE kvbridge_proxy_{n} counter\nkvbridge_proxy_{n} {}",
                v.load(Relaxed)
            );
        }
    }

    /// The request phases' duration histograms.
    fn render_durations(&self, out: &mut String) {
        self.ttft.render(
            out,
            "kvbridge_proxy_ttft_seconds",
            "Time to first byte of the answer.",
        );
        self.prefill.render(
            out,
            "kvbridge_proxy_prefill_seconds",
            "Prefill request duration.",
        );
        self.kv_wait.render(
            out,
            "kvbridge_proxy_kv_wait_seconds",
            "Wait for KV-ready after prefill.",
        );
        self.decode.render(
            out,
            "kvbridge_proxy_decode_seconds",
            "Decode request duration.",
        );
        self.request.render(
            out,
            "kvbridge_proxy_request_seconds",
            "Whole request duration.",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_counts_overflow() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(100));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(1000));
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.0005\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"0.005\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"300\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn every_outcome_is_rendered() {
        let m = Metrics::default();
        m.count_request(Outcome::KvTimeout);
        let mut s = String::new();
        m.render(&mut s);
        for o in Outcome::ALL {
            assert!(s.contains(&format!("outcome=\"{}\"", o.as_str())));
        }
        assert!(s.contains("kvbridge_proxy_requests_total{outcome=\"kv_timeout\"} 1\n"));
        assert!(s.contains("kvbridge_proxy_kv_waits_pending 0\n"));
    }
}
