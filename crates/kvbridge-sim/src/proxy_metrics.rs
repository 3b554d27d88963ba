//! Counters read from the proxy's `/metrics` (Prometheus text), as an operator's scraper
//! reads them: `kvbridge demo` reports how its proxy routed from there.

/// The sum of the samples of metric `name` whose labels include every `(label, value)` of
/// `labels` (all of its samples when `labels` is empty); 0 when there is none. Comments and
/// other metrics are skipped; a sample whose value does not parse counts 0.
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (set, value) = match rest.strip_prefix('{') {
                Some(r) => {
                    let (set, v) = r.split_once('}')?;
                    (set, v)
                }
                None if rest.starts_with(' ') => ("", rest),
                None => return None,
            };
            let has = |&(k, v): &(&str, &str)| set.split(',').any(|p| p == format!("{k}=\"{v}\""));
            labels
                .iter()
                .all(has)
                .then(|| value.split_whitespace().next()?.parse::<f64>().ok())
                .map(|v| v.unwrap_or(0.0))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP kvbridge_proxy_tokenize_total Prompts.\n\
        # TYPE kvbridge_proxy_tokenize_total counter\n\
        kvbridge_proxy_tokenize_total{result=\"ok\"} 7\n\
        kvbridge_proxy_tokenize_total{result=\"timeout\"} 2\n\
        kvbridge_proxy_tokenize_total_other{result=\"ok\"} 100\n\
        kvbridge_proxy_tokenize_ok_seconds_total 0.25\n\
        kvbridge_proxy_routing_decisions_total{role=\"prefill\",policy=\"kv-events\",matched=\"true\"} 3\n\
        kvbridge_proxy_routing_decisions_total{role=\"decode\",policy=\"kv-events\",matched=\"true\"} 4\n\
        kvbridge_proxy_routing_decisions_total{role=\"decode\",policy=\"kv-events\",matched=\"false\"} 5\n";

    #[test]
    fn sums_the_samples_with_the_labels_asked() {
        let t = "kvbridge_proxy_tokenize_total";
        assert_eq!(sum(TEXT, t, &[("result", "ok")]), 7.0);
        assert_eq!(
            sum(TEXT, t, &[]),
            9.0,
            "not the other metric sharing the prefix"
        );
        assert_eq!(sum(TEXT, t, &[("result", "status")]), 0.0);
        assert_eq!(
            sum(TEXT, "kvbridge_proxy_tokenize_ok_seconds_total", &[]),
            0.25
        );
        let r = "kvbridge_proxy_routing_decisions_total";
        assert_eq!(sum(TEXT, r, &[("matched", "true")]), 7.0);
        assert_eq!(
            sum(TEXT, r, &[("role", "decode"), ("matched", "true")]),
            4.0
        );
        assert_eq!(sum(TEXT, "absent", &[]), 0.0);
    }
}
