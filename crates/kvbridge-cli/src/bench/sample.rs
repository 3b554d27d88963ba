//! Figures of a sample of measurements, and the sizes the flags give.

/// Median of a non-empty sample.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The `q` quantile (0..=1) of a non-empty sample, nearest rank.
pub fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Parses a size with an optional K/M/G suffix (powers of two).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|e| format!("bad size {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_quantiles() {
        assert_eq!(parse_size("16K").unwrap(), 16384);
        assert_eq!(parse_size("4194304").unwrap(), 4 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("x").is_err());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(quantile((1..=100).map(f64::from).collect(), 0.99), 99.0);
        assert_eq!(quantile(vec![5.0], 0.5), 5.0);
    }
}
