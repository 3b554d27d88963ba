//! A per-request timeline of the PD path, for `kvbridge demo --timeline`.
//!
//! The proxy, the engines and the demo's client mark the steps of a request with `tracing`
//! events of target [`TARGET`] (level `DEBUG`, fields `stage` and optionally `id` and
//! `chunk`). They cost nothing beyond tracing's disabled-callsite check unless `RUST_LOG`
//! enables them (then the log shows them with timestamps) or [`layer`] is installed and
//! recording is switched on ([`start`]); the demo does this around its one-at-a-time
//! replay, where every mark between a request's send and its end belongs to that request.
//! All marks use one monotonic clock (the demo runs every component in one process).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

/// The `tracing` target of timeline marks.
pub const TARGET: &str = kvbridge_pd::TIMELINE;

static ON: AtomicBool = AtomicBool::new(false);
static MARKS: Mutex<Vec<Mark>> = Mutex::new(Vec::new());
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// One step of a request, as it happened.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    /// When (monotonic).
    pub at: Instant,
    /// What happened (`proxy.received`, `prefill.chunk_ready`, ...).
    pub stage: String,
    /// The request id the component knows it by, when it has one.
    pub id: Option<String>,
    /// The KV chunk, for per-chunk steps.
    pub chunk: Option<u64>,
}

/// Collects the fields of a timeline event.
#[derive(Default)]
struct Fields {
    stage: Option<String>,
    id: Option<String>,
    chunk: Option<u64>,
}

impl Visit for Fields {
    fn record_str(&mut self, f: &Field, v: &str) {
        match f.name() {
            "stage" => self.stage = Some(v.to_string()),
            "id" => self.id = Some(v.to_string()),
            _ => {}
        }
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        if f.name() == "chunk" {
            self.chunk = Some(v);
        }
    }
    fn record_i64(&mut self, f: &Field, v: i64) {
        if f.name() == "chunk" {
            self.chunk = u64::try_from(v).ok();
        }
    }
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        match f.name() {
            "stage" => self.stage = Some(format!("{v:?}").trim_matches('"').to_string()),
            "id" => self.id = Some(format!("{v:?}").trim_matches('"').to_string()),
            _ => {}
        }
    }
}

/// The `tracing_subscriber` layer that records timeline marks while recording is on.
#[derive(Debug, Default, Clone, Copy)]
pub struct TimelineLayer;

impl<S: Subscriber> Layer<S> for TimelineLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != TARGET || !ON.load(Ordering::Relaxed) {
            return;
        }
        let at = Instant::now();
        let mut f = Fields::default();
        event.record(&mut f);
        if let Some(stage) = f.stage {
            lock().push(Mark {
                at,
                stage,
                id: f.id,
                chunk: f.chunk,
            });
        }
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<Mark>> {
    MARKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The layer to add to the process's subscriber, filtered to timeline events only (so it
/// sees them whatever `RUST_LOG` says). Marks what [`installed`] reports.
pub fn layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    INSTALLED.store(true, Ordering::Relaxed);
    TimelineLayer.with_filter(tracing_subscriber::filter::filter_fn(|m| {
        m.target() == TARGET
    }))
}

/// Whether [`layer`] was installed in this process (otherwise [`start`] records nothing).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Clears the marks and starts recording.
pub fn start() {
    lock().clear();
    ON.store(true, Ordering::Relaxed);
}

/// Stops recording and returns the marks since [`start`], in time order.
pub fn take() -> Vec<Mark> {
    ON.store(false, Ordering::Relaxed);
    let mut v = std::mem::take(&mut *lock());
    v.sort_by_key(|m| m.at);
    v
}

/// Marks `stage` of request `id` now (the demo's client side).
pub fn mark(stage: &'static str, id: &str) {
    tracing::debug!(target: TARGET, stage, id);
}

/// One request's marks, with the client's send time and time to first text.
#[derive(Debug, Clone)]
pub struct Trace {
    /// When the client sent the request.
    pub sent: Instant,
    /// The client's time to the first generated text.
    pub ttft: std::time::Duration,
    /// The marks recorded while the request ran.
    pub marks: Vec<Mark>,
}

/// A step of a path: a mark and its median time after the client sent the request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Step {
    /// The mark (`stage`, with `[0]` or `[last]` for the first and last KV chunk).
    pub step: String,
    /// Median time from the client's send, ms.
    pub at_ms: f64,
    /// Median time from the previous step of the path, ms (0 for the first).
    pub delta_ms: f64,
}

impl Trace {
    /// Each mark's time after the send, ms, keyed by stage (per-chunk stages: only the
    /// first and the last chunk, as `stage[0]` and `stage[last]`; a stage seen more than
    /// once, e.g. on several ranks: the latest). Includes `client.sent` (0) and
    /// `client.first_text`.
    pub fn offsets(&self) -> std::collections::BTreeMap<String, f64> {
        let ms = |at: Instant| at.saturating_duration_since(self.sent).as_secs_f64() * 1e3;
        let mut last_chunk: std::collections::HashMap<&str, u64> = Default::default();
        for m in &self.marks {
            if let Some(c) = m.chunk {
                let e = last_chunk.entry(m.stage.as_str()).or_insert(0);
                *e = (*e).max(c);
            }
        }
        let mut out = std::collections::BTreeMap::new();
        out.insert("client.sent".to_string(), 0.0);
        out.insert(
            "client.first_text".to_string(),
            self.ttft.as_secs_f64() * 1e3,
        );
        for m in &self.marks {
            let key = match m.chunk {
                None => m.stage.clone(),
                Some(c) if Some(&c) == last_chunk.get(m.stage.as_str()) => {
                    format!("{}[last]", m.stage)
                }
                Some(0) => format!("{}[0]", m.stage),
                Some(_) => continue,
            };
            let t = ms(m.at);
            let e = out.entry(key).or_insert(t);
            *e = e.max(t);
        }
        out
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

/// The steps of `path` (mark keys in their expected order) that were recorded, with their
/// median times over `traces`; each step's `delta_ms` is the median over traces of the time
/// since the previous step of the path that the trace recorded.
pub fn path(traces: &[Trace], keys: &[&str]) -> Vec<Step> {
    let offs: Vec<_> = traces.iter().map(Trace::offsets).collect();
    let mut out: Vec<Step> = Vec::new();
    for k in keys {
        let Some(at) = median(offs.iter().filter_map(|o| o.get(*k).copied()).collect()) else {
            continue;
        };
        // The median of each trace's own time since the previous step it recorded.
        let deltas = offs
            .iter()
            .filter_map(|o| {
                let t = o.get(*k)?;
                let prev = out.iter().rev().find_map(|p| o.get(&p.step))?;
                Some(t - prev)
            })
            .collect();
        out.push(Step {
            step: k.to_string(),
            at_ms: at,
            delta_ms: median(deltas).unwrap_or(0.0),
        });
    }
    out
}

/// Every recorded step over `traces`, by median time.
pub fn all_steps(traces: &[Trace]) -> Vec<Step> {
    let offs: Vec<_> = traces.iter().map(Trace::offsets).collect();
    let mut keys: Vec<String> = offs.iter().flat_map(|o| o.keys().cloned()).collect();
    keys.sort();
    keys.dedup();
    let mut steps: Vec<Step> = keys
        .into_iter()
        .filter_map(|k| {
            let at = median(offs.iter().filter_map(|o| o.get(&k).copied()).collect())?;
            Some(Step {
                step: k,
                at_ms: at,
                delta_ms: 0.0,
            })
        })
        .collect();
    steps.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    for i in 1..steps.len() {
        steps[i].delta_ms = steps[i].at_ms - steps[i - 1].at_ms;
    }
    steps
}

/// The disaggregated path's marks in order (lmcache flow, push or pull).
pub const DISAGG_PATH: &[&str] = &[
    "client.sent",
    "proxy.received",
    "proxy.prefill_sent",
    "prefill.received",
    "prefill.announce",
    "prefill.announced",
    "prefill.allocated",
    "prefill.chunk_ready[0]",
    "prefill.chunk_computed[last]",
    "prefill.chunk_ready[last]",
    "sender.write_done[last]",
    "sender.chunk_landed[last]",
    "receiver.written[last]",
    "sender.finished",
    "proxy.outcome_received",
    "proxy.kv_ready",
    "proxy.decode_sent",
    "decode.received",
    "decode.chunk_digested[last]",
    "decode.kv_found",
    "decode.kv_loaded",
    "decode.first_token",
    "proxy.first_token_sent",
    "client.first_text",
];

/// The disaggregated path's marks in order when the proxy sends the decode as soon as the
/// prefill answered (lmcache flow, the default): the decode request reaches the decoder
/// while the last chunk is still moving, and `KvReady` races the decoder's answer. With
/// `first_token_on_kv_ready` the first token leaves the proxy on `KvReady`
/// (`proxy.first_token_sent`), and the decoder's steps are off the path to it.
pub const DISAGG_PATH_EARLY_DECODE: &[&str] = &[
    "client.sent",
    "proxy.received",
    "proxy.prefill_sent",
    "prefill.received",
    "prefill.announce",
    "prefill.announced",
    "prefill.allocated",
    "prefill.chunk_ready[0]",
    "prefill.chunk_computed[last]",
    "prefill.chunk_ready[last]",
    "proxy.prefill_answered",
    "proxy.decode_sent",
    "decode.received",
    "decode.kv_by_id",
    "sender.write_done[last]",
    "sender.chunk_landed[last]",
    "receiver.written[last]",
    "decode.chunk_landed[last]",
    "decode.chunk_digested[last]",
    "decode.kv_loaded",
    "decode.first_token",
    "sender.finished",
    "proxy.outcome_received",
    "proxy.kv_ready",
    "proxy.first_token_sent",
    "client.first_text",
];

/// The colocated path's marks in order.
pub const COLOCATED_PATH: &[&str] = &[
    "client.sent",
    "local.received",
    "local.chunk_ready[0]",
    "local.chunk_computed[last]",
    "local.chunk_ready[last]",
    "local.first_token",
    "client.first_text",
];

/// Renders steps as an aligned table.
pub fn render(title: &str, steps: &[Step]) -> String {
    let mut s = format!("{title}\n");
    for st in steps {
        s.push_str(&format!(
            "  {:<32} {:>8.2} ms  (+{:.2})\n",
            st.step, st.at_ms, st.delta_ms
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn mk(t0: Instant, ms: u64, stage: &str, chunk: Option<u64>) -> Mark {
        Mark {
            at: t0 + Duration::from_millis(ms),
            stage: stage.into(),
            id: None,
            chunk,
        }
    }

    #[test]
    fn offsets_keep_first_and_last_chunks_and_paths_take_medians() {
        let t0 = Instant::now();
        let tr = |k: u64| Trace {
            sent: t0,
            ttft: Duration::from_millis(10 + k),
            marks: vec![
                mk(t0, 1, "a", None),
                mk(t0, 2, "c", Some(0)),
                mk(t0, 3, "c", Some(1)),
                mk(t0, 4 + k, "c", Some(2)),
            ],
        };
        let o = tr(0).offsets();
        assert_eq!(o.get("c[0]"), Some(&2.0));
        assert_eq!(o.get("c[last]"), Some(&4.0));
        assert!(!o.keys().any(|k| k == "c[1]"));
        let traces = [tr(0), tr(2), tr(4)];
        let p = path(
            &traces,
            &[
                "client.sent",
                "a",
                "missing",
                "c[last]",
                "client.first_text",
            ],
        );
        let got: Vec<(&str, f64, f64)> = p
            .iter()
            .map(|s| (s.step.as_str(), s.at_ms, s.delta_ms))
            .collect();
        assert_eq!(
            got,
            vec![
                ("client.sent", 0.0, 0.0),
                ("a", 1.0, 1.0),
                ("c[last]", 6.0, 5.0),
                ("client.first_text", 12.0, 6.0)
            ]
        );
        let all = all_steps(&traces);
        assert_eq!(all.first().map(|s| s.step.as_str()), Some("client.sent"));
        assert_eq!(
            all.last().map(|s| s.step.as_str()),
            Some("client.first_text")
        );
    }
}

/// The TTFT gap between the disaggregated and the colocated path, split into parts that add
/// up to it: medians over pairs of replays of the same request (each part's median; the
/// medians need not add up exactly).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Gap {
    /// Pairs with every mark needed.
    pub pairs: u64,
    /// Disaggregated TTFT minus colocated TTFT, ms.
    pub gap_ms: f64,
    /// Before the first chunk exists (proxy hop, announce, allocation), minus the same on
    /// the colocated path, ms.
    pub before_first_chunk_ms: f64,
    /// First to last chunk ready, minus the same on the colocated path (a slower prefill:
    /// CPU contention with the transfer and the decoder on a small host), ms.
    pub prefill_slower_ms: f64,
    /// Last chunk ready on the prefiller to landed on the decoder (its transfer), ms.
    pub last_chunk_transfer_ms: f64,
    /// Last chunk landed to the client's first text (finish, `KvReady`, proxy, decode
    /// request, decoder's KV load and first token), minus last chunk ready to first text on
    /// the colocated path, ms.
    pub after_last_chunk_ms: f64,
}

/// Splits the TTFT gap of each pair (`disagg[i]`, `colocated[i]`: the same request).
pub fn gap(disagg: &[Trace], colocated: &[Trace]) -> Gap {
    let mut parts: [Vec<f64>; 5] = Default::default();
    for (d, c) in disagg.iter().zip(colocated) {
        let (d, c) = (d.offsets(), c.offsets());
        let g = |o: &std::collections::BTreeMap<String, f64>, k: &str| o.get(k).copied();
        let first = |o: &std::collections::BTreeMap<String, f64>, stage: &str| {
            g(o, &format!("{stage}[0]")).or_else(|| g(o, &format!("{stage}[last]")))
        };
        let (Some(d0), Some(dl), Some(dland), Some(dt), Some(c0), Some(cl), Some(ct)) = (
            first(&d, "prefill.chunk_ready"),
            g(&d, "prefill.chunk_ready[last]"),
            g(&d, "sender.chunk_landed[last]"),
            g(&d, "client.first_text"),
            first(&c, "local.chunk_ready"),
            g(&c, "local.chunk_ready[last]"),
            g(&c, "client.first_text"),
        ) else {
            continue;
        };
        parts[0].push(dt - ct);
        parts[1].push(d0 - c0);
        parts[2].push((dl - d0) - (cl - c0));
        parts[3].push(dland - dl);
        parts[4].push((dt - dland) - (ct - cl));
    }
    let pairs = parts[0].len() as u64;
    let [a, b, c, d, e] = parts.map(|v| median(v).unwrap_or(0.0));
    Gap {
        pairs,
        gap_ms: a,
        before_first_chunk_ms: b,
        prefill_slower_ms: c,
        last_chunk_transfer_ms: d,
        after_last_chunk_ms: e,
    }
}
