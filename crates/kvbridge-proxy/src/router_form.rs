//! SGLang router's way of naming workers on the command line (`--prefill URL
//! [BOOTSTRAP_PORT]`, `--decode URL`), turned into worker addresses, so that a command line
//! written for `sglang_router --pd-disaggregation` works here too.

use crate::config::{BootstrapPort, WorkerAddr};

/// A worker's URL (`http://host:port`, a trailing `/` allowed; without a port, 80) as an
/// address. Only `http` (the proxy speaks plain HTTP to its workers).
pub(crate) fn worker_url(url: &str) -> anyhow::Result<WorkerAddr> {
    let bad = |why: &str| anyhow::anyhow!("worker URL {url:?}: {why}");
    let rest = url
        .trim()
        .strip_prefix("http://")
        .ok_or_else(|| bad("give it as http://host:port"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#', '@', ' ']) {
        return Err(bad("no path, query or user part, only http://host:port"));
    }
    // `[v6]:port`, `[v6]`, `host:port` or `host`.
    let (host, port) = match rest.rfind(':') {
        Some(i) if !rest[i..].contains(']') => (&rest[..i], Some(&rest[i + 1..])),
        _ => (rest, None),
    };
    if host.is_empty() || (host.contains(':') && !host.starts_with('[')) {
        return Err(bad("no host"));
    }
    let port = match port {
        None => 80,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?,
    };
    Ok(WorkerAddr {
        host: host.to_string(),
        port,
    })
}

/// The prefill servers of `--prefill URL [BOOTSTRAP_PORT]`, given any number of times, each
/// with its bootstrap port (`None` when not given or `none`). The values arrive as one list:
/// a URL (`http://…`) starts a server, a value after it is its port.
pub(crate) fn prefills(values: &[String]) -> anyhow::Result<Vec<(WorkerAddr, Option<u16>)>> {
    let mut out: Vec<(WorkerAddr, Option<u16>, bool)> = Vec::new();
    for v in values {
        if v.trim().starts_with("http") || v.contains("://") {
            out.push((worker_url(v)?, None, false));
            continue;
        }
        match out.last_mut() {
            Some((w, port, given @ false)) => {
                *port = v
                    .parse::<BootstrapPort>()
                    .map_err(|e| anyhow::anyhow!("--prefill http://{}:{}: {e}", w.host, w.port))?
                    .0;
                *given = true;
            }
            _ => anyhow::bail!(
                "--prefill takes a URL (http://host:port), then optionally its bootstrap port, not {v:?}"
            ),
        }
    }
    Ok(out.into_iter().map(|(w, p, _)| (w, p)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_as_sglang_router_takes_them() {
        let w = worker_url("http://10.0.0.1:30000").unwrap();
        assert_eq!((w.host.as_str(), w.port), ("10.0.0.1", 30000));
        let w = worker_url("http://p.local:8/").unwrap();
        assert_eq!((w.host.as_str(), w.port), ("p.local", 8));
        assert_eq!(worker_url("http://h").unwrap().port, 80);
        let w = worker_url("http://[::1]:30000").unwrap();
        assert_eq!((w.host.as_str(), w.port), ("[::1]", 30000));
        for bad in [
            "10.0.0.1:30000",
            "https://h:1",
            "http://h:0",
            "http://h:x",
            "http://:1",
            "http://h:1/v1",
            "http://::1:2",
        ] {
            assert!(worker_url(bad).is_err(), "{bad}");
        }
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let p = prefills(&v(&[
            "http://a:1",
            "8998",
            "http://b:2",
            "http://c:3",
            "none",
        ]))
        .unwrap();
        let ports: Vec<_> = p.iter().map(|(_, b)| *b).collect();
        assert_eq!(ports, [Some(8998), None, None]);
        assert_eq!(p[1].0.host, "b");
        let e = prefills(&v(&["http://a:1", "x"])).unwrap_err();
        assert!(e.to_string().contains("not a port number"), "{e}");
        let e = prefills(&v(&["http://a:1", "1", "2"])).unwrap_err();
        assert!(e.to_string().contains("takes a URL"), "{e}");
        assert!(prefills(&v(&["8998"])).is_err());
        assert!(prefills(&v(&["https://a:1"])).is_err());
    }
}
