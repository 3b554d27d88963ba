//! How each decoder's requests got their KV: loaded over kvbridge, or computed by vLLM itself
//! (a silent recompute), as the decoder's own `/metrics` says (`--flow vllm`, decoders running
//! KvbridgeConnector: `python/kvbridge/vllm/prom.py`).
//!
//! [`parse`] reads the connector's series out of a Prometheus text and sums them over vLLM's
//! engine labels; [`scrape`] fetches one decoder's `/metrics` under a deadline and a size cap;
//! [`Board`] keeps each decoder's latest figures and renders them on the proxy's `/metrics`.
//!
//! A decoder's `/metrics` is not trusted: whoever controls the decoder writes it. The parser
//! never panics, allocates at most in proportion to its input, and turns anything it cannot
//! read as a counter of the connector (a value that is not a finite number from 0 to 2^53, a
//! line of one of its series that does not parse, the same series twice, a body without the
//! connector's series) into a typed [`Unknown`]: the decoder's figures are then shown as
//! unknown, never as zero. A hostile decoder can still report any figures it likes for itself;
//! it cannot change another decoder's, nor put anything of its own into the proxy's output
//! (the proxy labels each decoder with its configured address).

use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

/// The largest decoder `/metrics` body read: a vLLM server's is some tens of KiB per engine.
pub const MAX_METRICS_BYTES: usize = 4 << 20;

/// The most series of the connector's four counters one body may carry (a vLLM server has one
/// per engine, and nine causes of failure per engine).
pub const MAX_SERIES: usize = 4096;

/// The largest value taken as a count: every integer up to it is exact in an `f64`.
const MAX_COUNT: f64 = 9_007_199_254_740_992.0;

/// A decoder's load counters, each summed over its engines, as its `/metrics` last showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadCounts {
    /// Loads whose KV came over kvbridge (`vllm:kvbridge_loads_ok_total`).
    pub loaded: u64,
    /// Requests with KV on a prefiller that vLLM computed itself instead
    /// (`vllm:kvbridge_loads_recomputed_total`); `None` when the series is absent.
    pub recomputed: Option<u64>,
    /// Loads checked against the prefiller's integrity digests
    /// (`vllm:kvbridge_loads_checked_total`); `None` when the series is absent (connectors
    /// before integrity digests).
    pub checked: Option<u64>,
    /// Failed loads, every cause (`vllm:kvbridge_load_failures_total{cause}`); `None` when the
    /// series is absent.
    pub failed: Option<u64>,
}

impl LoadCounts {
    /// Each outcome's label value and count, in rendering order; absent series left out.
    pub fn outcomes(&self) -> impl Iterator<Item = (&'static str, u64)> {
        [
            ("loaded", Some(self.loaded)),
            ("recomputed", self.recomputed),
            ("checked", self.checked),
            ("failed", self.failed),
        ]
        .into_iter()
        .filter_map(|(o, v)| Some((o, v?)))
    }
}

/// Why a decoder's figures are unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unknown {
    /// Not scraped yet.
    NotYet,
    /// No connection, or the connection failed before the whole answer came.
    Unreachable(String),
    /// No whole answer within the deadline.
    Timeout(Duration),
    /// `/metrics` answered with a status other than 200.
    Status(u16),
    /// The body is larger than [`MAX_METRICS_BYTES`].
    TooLarge,
    /// The body has no `vllm:kvbridge_loads_ok_total` (not a KvbridgeConnector decoder).
    NoSeries,
    /// A line of one of the connector's series could not be read as one.
    Malformed {
        /// Its 1-based line number.
        line: usize,
        /// What was wrong with it.
        why: &'static str,
    },
}

impl Unknown {
    /// A short name of the reason, for logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Unknown::NotYet => "not_yet",
            Unknown::Unreachable(_) => "unreachable",
            Unknown::Timeout(_) => "timeout",
            Unknown::Status(_) => "status",
            Unknown::TooLarge => "too_large",
            Unknown::NoSeries => "no_series",
            Unknown::Malformed { .. } => "malformed",
        }
    }
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unknown::NotYet => write!(f, "not scraped yet"),
            Unknown::Unreachable(e) => write!(f, "GET /metrics failed: {e}"),
            Unknown::Timeout(d) => write!(f, "GET /metrics: no whole answer within {d:?}"),
            Unknown::Status(s) => write!(f, "GET /metrics answered {s}"),
            Unknown::TooLarge => write!(f, "/metrics is larger than {MAX_METRICS_BYTES} bytes"),
            Unknown::NoSeries => write!(f, "/metrics has no vllm:kvbridge_loads_ok_total"),
            Unknown::Malformed { line, why } => write!(f, "/metrics line {line}: {why}"),
        }
    }
}

/// A sample's labels, sorted by name, values unescaped: with the series' name, what makes
/// two samples the same series.
type Labels<'a> = Vec<(&'a str, String)>;

/// The connector's series the proxy reads, in [`LoadCounts`] order.
const SERIES: [&str; 4] = [
    "vllm:kvbridge_loads_ok_total",
    "vllm:kvbridge_loads_recomputed_total",
    "vllm:kvbridge_loads_checked_total",
    "vllm:kvbridge_load_failures_total",
];

/// The connector's load counters in a Prometheus text (vLLM's `/metrics`), each summed over
/// all its series (vLLM's engine labels, and `cause` for failures). Lines of other series are
/// skipped unread, whatever they hold; one of the connector's series that cannot be read, or
/// appears twice with the same labels, makes the whole text [`Unknown::Malformed`].
pub fn parse(text: &str) -> Result<LoadCounts, Unknown> {
    let mut sums: [Option<u64>; 4] = [None; 4];
    let mut seen: HashSet<(usize, Labels)> = HashSet::new();
    for (n, line) in text.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let Some((which, rest)) = SERIES
            .iter()
            .enumerate()
            .find_map(|(i, s)| Some((i, line.strip_prefix(s)?)))
        else {
            continue;
        };
        // `vllm:kvbridge_loads_ok_totalx` is another series.
        if !(rest.starts_with('{') || rest.starts_with([' ', '\t'])) {
            continue;
        }
        let bad = |why| Unknown::Malformed { line: n + 1, why };
        let (labels, value) = sample(rest).map_err(bad)?;
        if seen.len() >= MAX_SERIES {
            return Err(bad("more series than the proxy reads"));
        }
        if !seen.insert((which, labels)) {
            return Err(bad("the same series twice"));
        }
        let sum = sums[which].get_or_insert(0);
        *sum = sum.saturating_add(value);
    }
    let [Some(loaded), recomputed, checked, failed] = sums else {
        return Err(Unknown::NoSeries);
    };
    Ok(LoadCounts {
        loaded,
        recomputed,
        checked,
        failed,
    })
}

/// A sample's labels (sorted by name) and value, from the text after its metric name:
/// `{name="value",...} value [timestamp]`.
fn sample(rest: &str) -> Result<(Labels<'_>, u64), &'static str> {
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(r) => labels(r)?,
        None => (Vec::new(), rest),
    };
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("no value")?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| "a timestamp that is no integer")?;
    }
    if fields.next().is_some() {
        return Err("text after the value and timestamp");
    }
    if !rest.starts_with([' ', '\t']) {
        return Err("no space before the value");
    }
    Ok((labels, count(value)?))
}

/// A counter's value: a finite number from 0 to 2^53 (a fraction is cut off).
fn count(v: &str) -> Result<u64, &'static str> {
    let x: f64 = v.parse().map_err(|_| "a value that is no number")?;
    if !x.is_finite() {
        return Err("a value that is not finite");
    }
    if !(0.0..=MAX_COUNT).contains(&x) {
        return Err("a value out of a count's range");
    }
    Ok(x as u64)
}

/// The labels of a sample from the text after its `{`, sorted by name, and the text after
/// the closing `}`. Values are unescaped (`\\`, `\"`, `\n`).
fn labels(mut s: &str) -> Result<(Labels<'_>, &str), &'static str> {
    let mut out: Labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', '\t']);
        if let Some(r) = s.strip_prefix('}') {
            out.sort_unstable();
            if out.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err("a label twice");
            }
            return Ok((out, r));
        }
        let end = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .ok_or("labels not closed")?;
        let (name, r) = s.split_at(end);
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err("a label name that is none");
        }
        let r = r.trim_start_matches([' ', '\t']);
        let r = r.strip_prefix('=').ok_or("a label without '='")?;
        let r = r.trim_start_matches([' ', '\t']);
        let r = r.strip_prefix('"').ok_or("a label value without quotes")?;
        let (value, r) = quoted(r)?;
        out.push((name, value));
        let r = r.trim_start_matches([' ', '\t']);
        s = match r.strip_prefix(',') {
            Some(r) => r,
            None if r.starts_with('}') => r,
            None => return Err("labels not separated by ','"),
        };
    }
}

/// A label value from the text after its opening quote, unescaped, and the text after its
/// closing quote.
fn quoted(s: &str) -> Result<(String, &str), &'static str> {
    let mut v = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((v, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, '\\')) => v.push('\\'),
                Some((_, '"')) => v.push('"'),
                Some((_, 'n')) => v.push('\n'),
                _ => return Err("a label value with a bad escape"),
            },
            c => v.push(c),
        }
    }
    Err("a label value not closed")
}

/// The HTTP client the proxy scrapes decoders with.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One decoder's load counters: `GET uri` (its `/metrics`), the whole answer within
/// `deadline` and [`MAX_METRICS_BYTES`], parsed.
pub async fn scrape(
    client: &HttpClient,
    uri: Uri,
    deadline: Duration,
) -> Result<LoadCounts, Unknown> {
    let req = Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| Unknown::Unreachable(e.to_string()))?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| Unknown::Unreachable(format!("{e:#}")))?;
        let (parts, body) = resp.into_parts();
        if parts.status != hyper::StatusCode::OK {
            return Err(Unknown::Status(parts.status.as_u16()));
        }
        let declared = parts
            .headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_METRICS_BYTES as u64) {
            return Err(Unknown::TooLarge);
        }
        let bytes = Limited::new(body, MAX_METRICS_BYTES)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    Unknown::TooLarge
                } else {
                    Unknown::Unreachable(format!("reading the body: {e}"))
                }
            })?
            .to_bytes();
        parse(&String::from_utf8_lossy(&bytes))
    };
    match tokio::time::timeout(deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err(Unknown::Timeout(deadline)),
    }
}

/// Every scraped decoder's latest figures, by index in the decode pool.
#[derive(Debug, Default)]
pub struct Board {
    decoders: Vec<(String, Mutex<Result<LoadCounts, Unknown>>)>,
}

impl Board {
    /// A board for the decoders labelled `labels` (`host:port`), every one not scraped yet.
    pub fn new(labels: impl IntoIterator<Item = String>) -> Board {
        Board {
            decoders: labels
                .into_iter()
                .map(|l| (l, Mutex::new(Err(Unknown::NotYet))))
                .collect(),
        }
    }

    /// Records decoder `idx`'s latest scrape; returns the one it replaces.
    pub fn set(
        &self,
        idx: usize,
        r: Result<LoadCounts, Unknown>,
    ) -> Option<Result<LoadCounts, Unknown>> {
        let (_, m) = self.decoders.get(idx)?;
        let mut l = m.lock().unwrap_or_else(|p| p.into_inner());
        Some(std::mem::replace(&mut *l, r))
    }

    /// Decoder `idx`'s latest figures, or why they are unknown.
    pub fn get(&self, idx: usize) -> Option<Result<LoadCounts, Unknown>> {
        let (_, m) = self.decoders.get(idx)?;
        let l = m.lock().unwrap_or_else(|p| p.into_inner());
        Some(l.clone())
    }

    /// Appends the decoders' lines to a `/metrics` text: whether each one's figures are known,
    /// and the known ones.
    pub fn render(&self, out: &mut String) {
        if self.decoders.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "# HELP kvbridge_proxy_decoder_kv_loads_known 1 when the decoder's last /metrics scrape gave its load counters.\n\
             # TYPE kvbridge_proxy_decoder_kv_loads_known gauge"
        );
        let latest: Vec<_> = (0..self.decoders.len())
            .filter_map(|i| self.get(i))
            .collect();
        for ((label, _), r) in self.decoders.iter().zip(&latest) {
            let _ = writeln!(
                out,
                "kvbridge_proxy_decoder_kv_loads_known{{worker=\"{label}\"}} {}",
                r.is_ok() as u8
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvbridge_proxy_decoder_kv_loads_total The decoder's requests with KV on a prefiller, by outcome, as its /metrics said at the last scrape.\n\
             # TYPE kvbridge_proxy_decoder_kv_loads_total counter"
        );
        for ((label, _), r) in self.decoders.iter().zip(&latest) {
            let Ok(c) = r else { continue };
            for (outcome, v) in c.outcomes() {
                let _ = writeln!(
                    out,
                    "kvbridge_proxy_decoder_kv_loads_total{{worker=\"{label}\",outcome=\"{outcome}\"}} {v}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM `/metrics` excerpt of a decoder with two engines, as prometheus_client writes it.
    const TWO_ENGINES: &str = r#"# HELP vllm:kvbridge_loads_ok_total Decoder loads of a prompt's KV from a prefiller that completed.
# TYPE vllm:kvbridge_loads_ok_total counter
vllm:kvbridge_loads_ok_total{engine="0",model_name="m"} 3.0
vllm:kvbridge_loads_ok_total{engine="1",model_name="m"} 4.0
# HELP vllm:kvbridge_loads_ok_created Decoder loads of a prompt's KV from a prefiller that completed.
# TYPE vllm:kvbridge_loads_ok_created gauge
vllm:kvbridge_loads_ok_created{engine="0",model_name="m"} 1.7650e+09
vllm:kvbridge_loads_recomputed_total{engine="0",model_name="m"} 2.0
vllm:kvbridge_loads_recomputed_total{engine="1",model_name="m"} 0.0
vllm:kvbridge_load_failures_total{cause="timeout",engine="0",model_name="m"} 1.0
vllm:kvbridge_load_failures_total{cause="peer_lost",engine="1",model_name="m"} 2.0
vllm:kvbridge_load_failures_total{cause="timeout",engine="1",model_name="m"} 0.0
vllm:kvbridge_bytes_read_total{engine="0",model_name="m"} 4.096e+06
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"#;

    fn malformed(text: &str) -> &'static str {
        match parse(text) {
            Err(Unknown::Malformed { why, .. }) => why,
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    #[test]
    fn sums_over_engines_and_causes_and_skips_other_series() {
        let c = parse(TWO_ENGINES).unwrap();
        assert_eq!(
            c,
            LoadCounts {
                loaded: 7,
                recomputed: Some(2),
                checked: None,
                failed: Some(3),
            }
        );
        let outcomes: Vec<_> = c.outcomes().collect();
        assert_eq!(outcomes, [("loaded", 7), ("recomputed", 2), ("failed", 3)]);
        let with_checked =
            format!("{TWO_ENGINES}vllm:kvbridge_loads_checked_total{{engine=\"0\"}} 5\r\n");
        assert_eq!(parse(&with_checked).unwrap().checked, Some(5));
    }

    #[test]
    fn a_text_without_the_connectors_series_is_unknown() {
        for t in [
            "",
            "\n\n",
            "vllm:num_requests_running 1\n",
            "\u{0}\u{fffd}garbage{{{\"\n",
            "# vllm:kvbridge_loads_ok_total 1\n",
        ] {
            assert_eq!(parse(t), Err(Unknown::NoSeries), "{t:?}");
        }
        // Another series whose name starts with one of ours is not ours.
        assert_eq!(
            parse("vllm:kvbridge_loads_ok_totalx 5\n"),
            Err(Unknown::NoSeries)
        );
        // Only failures and recomputes: no loads series, so not the connector's figures.
        assert_eq!(
            parse("vllm:kvbridge_loads_recomputed_total 5\n"),
            Err(Unknown::NoSeries)
        );
    }

    #[test]
    fn values_that_are_no_count_make_it_unknown() {
        for v in [
            "NaN",
            "nan",
            "+Inf",
            "-Inf",
            "inf",
            "-1",
            "-0.5",
            "1e300",
            "9007199254740993e10",
            "0x10",
            "",
            "1_000",
            "ten",
        ] {
            let t = format!("vllm:kvbridge_loads_ok_total{{engine=\"0\"}} {v}\n");
            malformed(&t);
        }
        // Accepted: prometheus_client's float form, exponent, a timestamp, -0, a fraction cut.
        for (v, want) in [
            ("3.0", 3),
            ("4.096e+03", 4096),
            ("7 1700000000000", 7),
            ("-0", 0),
            ("2.9", 2),
            ("9007199254740992", 1 << 53),
        ] {
            let t = format!("vllm:kvbridge_loads_ok_total {v}\n");
            assert_eq!(parse(&t).unwrap().loaded, want, "{v}");
        }
        malformed("vllm:kvbridge_loads_ok_total 1 notatime\n");
        malformed("vllm:kvbridge_loads_ok_total 1 2 3\n");
        malformed("vllm:kvbridge_loads_ok_total{}1\n");
    }

    #[test]
    fn a_series_twice_is_malformed_whatever_the_label_order() {
        malformed("vllm:kvbridge_loads_ok_total 1\nvllm:kvbridge_loads_ok_total 1\n");
        let t = "vllm:kvbridge_loads_ok_total{engine=\"0\",model_name=\"m\"} 1\n\
                 vllm:kvbridge_loads_ok_total{ model_name = \"m\" , engine=\"0\", } 1\n";
        assert_eq!(malformed(t), "the same series twice");
        // The same labels on another of the connector's series are another series.
        let t = "vllm:kvbridge_loads_ok_total{engine=\"0\"} 1\nvllm:kvbridge_loads_recomputed_total{engine=\"0\"} 1\n";
        assert_eq!(parse(t).unwrap().recomputed, Some(1));
        assert_eq!(
            malformed("vllm:kvbridge_loads_ok_total{engine=\"0\",engine=\"1\"} 1\n"),
            "a label twice"
        );
    }

    #[test]
    fn label_values_with_quotes_escapes_and_braces_are_read_whole() {
        let t = "vllm:kvbridge_loads_ok_total{model_name=\"a\\\"} 99\\n\\\\\",engine=\"0\"} 2\n\
                 vllm:kvbridge_loads_ok_total{model_name=\"a\\\"} 99\\n\\\\\",engine=\"1\"} 3\n\
                 vllm:kvbridge_loads_ok_total{model_name=\"}{,=\",engine=\"0\"} 4\n";
        assert_eq!(parse(t).unwrap().loaded, 9);
        for bad in [
            "{model_name=\"a} 1\n",
            "{model_name=\"a\\x\"} 1\n",
            "{model_name=a} 1\n",
            "{model_name\"a\"} 1\n",
            "{=\"a\"} 1\n",
            "{1a=\"a\"} 1\n",
            "{a=\"1\" b=\"2\"} 1\n",
            "{a=\"1\"",
            "{a=\"1\\",
            "{\u{e9}=\"1\"} 1\n",
        ] {
            malformed(&format!("vllm:kvbridge_loads_ok_total{bad}"));
        }
    }

    #[test]
    fn giant_lines_and_many_series_are_bounded() {
        // A giant line of another series is skipped; a giant label value of ours is read.
        let big = "x".repeat(MAX_METRICS_BYTES);
        let t =
            format!("vllm:other{{a=\"{big}\"}} 1\nvllm:kvbridge_loads_ok_total{{a=\"{big}\"}} 1\n");
        assert_eq!(parse(&t).unwrap().loaded, 1);
        // A giant line of garbage after our name.
        malformed(&format!("vllm:kvbridge_loads_ok_total {big}\n"));
        malformed(&format!("vllm:kvbridge_loads_ok_total{{{big}\n"));
        // More series than any decoder has.
        let mut t = String::new();
        for i in 0..=MAX_SERIES {
            t.push_str(&format!(
                "vllm:kvbridge_loads_ok_total{{engine=\"{i}\"}} 1\n"
            ));
        }
        assert_eq!(malformed(&t), "more series than the proxy reads");
        // Sums saturate instead of overflowing.
        let mut t = String::new();
        for i in 0..MAX_SERIES {
            t.push_str(&format!(
                "vllm:kvbridge_loads_ok_total{{engine=\"{i}\"}} 9007199254740992\n"
            ));
        }
        assert_eq!(parse(&t).unwrap().loaded, u64::MAX);
    }

    #[test]
    fn the_board_renders_known_figures_and_marks_the_rest_unknown() {
        let b = Board::new(["a:1".to_string(), "b:2".to_string()]);
        let mut s = String::new();
        b.render(&mut s);
        assert!(
            s.contains("kvbridge_proxy_decoder_kv_loads_known{worker=\"a:1\"} 0\n"),
            "{s}"
        );
        assert!(!s.contains("kvbridge_proxy_decoder_kv_loads_total{"), "{s}");
        assert_eq!(b.set(0, parse(TWO_ENGINES)), Some(Err(Unknown::NotYet)));
        assert_eq!(
            b.set(1, Err(Unknown::Status(404))),
            Some(Err(Unknown::NotYet))
        );
        assert_eq!(b.set(2, Err(Unknown::Status(404))), None, "no such decoder");
        let mut s = String::new();
        b.render(&mut s);
        for want in [
            "kvbridge_proxy_decoder_kv_loads_known{worker=\"a:1\"} 1\n",
            "kvbridge_proxy_decoder_kv_loads_known{worker=\"b:2\"} 0\n",
            "kvbridge_proxy_decoder_kv_loads_total{worker=\"a:1\",outcome=\"loaded\"} 7\n",
            "kvbridge_proxy_decoder_kv_loads_total{worker=\"a:1\",outcome=\"recomputed\"} 2\n",
            "kvbridge_proxy_decoder_kv_loads_total{worker=\"a:1\",outcome=\"failed\"} 3\n",
        ] {
            assert!(s.contains(want), "{want}\n{s}");
        }
        assert!(
            !s.contains("outcome=\"checked\""),
            "an absent series is not shown as 0: {s}"
        );
        assert!(!s.contains("worker=\"b:2\",outcome"), "{s}");
        assert!(b.set(0, Err(Unknown::TooLarge)).is_some_and(|p| p.is_ok()));
        let mut s = String::new();
        b.render(&mut s);
        assert!(
            s.contains("kvbridge_proxy_decoder_kv_loads_known{worker=\"a:1\"} 0\n"),
            "{s}"
        );
        assert!(
            !s.contains("kvbridge_proxy_decoder_kv_loads_total{"),
            "stale figures are dropped: {s}"
        );
        let mut s = String::new();
        Board::default().render(&mut s);
        assert!(s.is_empty(), "no decoders scraped, no lines");
    }
}
