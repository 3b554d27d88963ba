//! [`Config::from_args`]: the configuration built from the command line, an optional TOML
//! file (`--config`) and the defaults, in that order of precedence. Above both the flags
//! (`crate::cli`) and the configuration's types (`crate::config`), so neither imports the
//! other's module.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::cli::ProxyArgs;
use crate::config::*;
use crate::routing::policy::{CacheAwareParams, RoutingPolicy};

/// The TOML file: every key optional, same names as the flags with `_` for `-`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    host: Option<String>,
    port: Option<u16>,
    proxy_host: Option<String>,
    proxy_port: Option<u16>,
    flow: Option<Flow>,
    kv_ready_timeout: Option<f64>,
    prefill_timeout: Option<f64>,
    decode_timeout: Option<f64>,
    connect_timeout: Option<f64>,
    health_interval: Option<f64>,
    health_timeout: Option<f64>,
    health_kv_ports: Option<bool>,
    max_connections: Option<usize>,
    header_timeout: Option<f64>,
    body_timeout: Option<f64>,
    unhealthy_after: Option<u32>,
    healthy_after: Option<u32>,
    max_queue: Option<usize>,
    queue_timeout: Option<f64>,
    max_body_bytes: Option<usize>,
    busy_poll_us: Option<u64>,
    decode_after_kv_ready: Option<bool>,
    first_token_on_kv_ready: Option<bool>,
    routing: Option<RoutingPolicy>,
    kv_events: Option<KvEventsConfig>,
    cache_aware: Option<CacheAwareParams>,
    disaggregation: Option<DisaggregationConfig>,
    #[serde(default, rename = "prefiller")]
    prefillers: Vec<FilePrefiller>,
    #[serde(default, rename = "decoder")]
    decoders: Vec<DecoderConfig>,
}

/// A `[[prefiller]]` table: its address and, for the sglang flow, its bootstrap port.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePrefiller {
    host: String,
    port: u16,
    bootstrap_port: Option<u16>,
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    if !v.is_finite() || !(0.0..=1e9).contains(&v) {
        anyhow::bail!("{name} must be a number of seconds between 0 and 1e9, not {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// Expands LMCache-style host and port lists: one host for all ports, one port for all hosts,
/// or equally long lists; `count` (from `--num-*`) expands a single port into consecutive ones.
fn expand(
    what: &str,
    hosts: &[String],
    ports: &[u16],
    count: Option<usize>,
) -> anyhow::Result<Vec<WorkerAddr>> {
    let mut ports = ports.to_vec();
    if let Some(n) = count {
        if n == 0 {
            anyhow::bail!("--num-{what}s must be at least 1");
        }
        if ports.len() == 1 && hosts.len() <= 1 && n > 1 {
            let p = ports[0];
            ports = (0..n).map(|i| p.saturating_add(i as u16)).collect();
        }
    }
    let n = hosts.len().max(ports.len());
    if (hosts.len() != 1 && hosts.len() != n) || (ports.len() != 1 && ports.len() != n) || n == 0 {
        anyhow::bail!(
            "--{what}-host has {} entries and --{what}-port has {}: give one of each, one host for many ports, or lists of equal length",
            hosts.len(),
            ports.len()
        );
    }
    if let Some(c) = count {
        if c != n {
            anyhow::bail!("--num-{what}s is {c} but {n} {what}s were given");
        }
    }
    Ok((0..n)
        .map(|i| WorkerAddr {
            host: hosts[if hosts.len() == 1 { 0 } else { i }]
                .trim()
                .to_string(),
            port: ports[if ports.len() == 1 { 0 } else { i }],
        })
        .collect())
}

impl Config {
    /// Builds the configuration: flags win over the `--config` file, which wins over defaults.
    pub fn from_args(a: &ProxyArgs) -> anyhow::Result<Config> {
        let file = match &a.config {
            Some(p) => load_file(p)?,
            None => FileConfig::default(),
        };
        let d = Config::default();
        let flow = a.flow.or(file.flow).unwrap_or(d.flow);
        let (prefillers, prefiller_bootstrap_ports) = prefillers_of(a, file.prefillers)?;
        let decoders = decoders_of(a, file.decoders)?;
        let cfg = Config {
            host: a.host.clone().or(file.host).unwrap_or(d.host),
            port: a.port.or(file.port).unwrap_or(d.port),
            prefillers,
            decoders,
            prefiller_bootstrap_ports,
            proxy_host: a
                .proxy_host
                .clone()
                .or(file.proxy_host)
                .unwrap_or(d.proxy_host),
            proxy_port: a.proxy_port.or(file.proxy_port).unwrap_or(d.proxy_port),
            flow,
            kv_ready_timeout: pick(
                "kv-ready-timeout",
                a.kv_ready_timeout,
                file.kv_ready_timeout,
                d.kv_ready_timeout,
            )?,
            prefill_timeout: pick(
                "prefill-timeout",
                a.prefill_timeout,
                file.prefill_timeout,
                d.prefill_timeout,
            )?,
            decode_timeout: pick(
                "decode-timeout",
                a.decode_timeout,
                file.decode_timeout,
                d.decode_timeout,
            )?,
            connect_timeout: pick(
                "connect-timeout",
                a.connect_timeout,
                file.connect_timeout,
                d.connect_timeout,
            )?,
            health_interval: pick(
                "health-interval",
                a.health_interval,
                file.health_interval,
                d.health_interval,
            )?,
            health_timeout: pick(
                "health-timeout",
                a.health_timeout,
                file.health_timeout,
                d.health_timeout,
            )?,
            health_kv_ports: a.health_kv_ports.or(file.health_kv_ports),
            secret: a.secret.clone(),
            outcome_port: Default::default(),
            http_limits: HttpLimits {
                max_conns: a
                    .max_connections
                    .or(file.max_connections)
                    .unwrap_or(d.http_limits.max_conns),
                header_timeout: pick(
                    "header-timeout",
                    a.header_timeout,
                    file.header_timeout,
                    d.http_limits.header_timeout,
                )?,
                body_timeout: pick(
                    "body-timeout",
                    a.body_timeout,
                    file.body_timeout,
                    d.http_limits.body_timeout,
                )?,
            },
            unhealthy_after: a
                .unhealthy_after
                .or(file.unhealthy_after)
                .unwrap_or(d.unhealthy_after),
            healthy_after: a
                .healthy_after
                .or(file.healthy_after)
                .unwrap_or(d.healthy_after),
            max_queue: a.max_queue.or(file.max_queue).unwrap_or(d.max_queue),
            queue_timeout: pick(
                "queue-timeout",
                a.queue_timeout,
                file.queue_timeout,
                d.queue_timeout,
            )?,
            max_body_bytes: a
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(d.max_body_bytes),
            busy_poll: a
                .busy_poll_us
                .or(file.busy_poll_us)
                .map(Duration::from_micros)
                .unwrap_or(d.busy_poll),
            decode_after_kv_ready: a
                .decode_after_kv_ready
                .or(file.decode_after_kv_ready)
                .unwrap_or(d.decode_after_kv_ready),
            first_token_on_kv_ready: a
                .first_token_on_kv_ready
                .or(file.first_token_on_kv_ready)
                .unwrap_or(d.first_token_on_kv_ready),
            routing: a.routing.or(file.routing).unwrap_or(d.routing),
            kv_events: kv_events_of(a, file.kv_events),
            cache_aware: cache_aware_of(a, file.cache_aware),
            disaggregation: disaggregation_of(a, file.disaggregation),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A duration in seconds: the flag's `cli`, else the file's `f`, else `dflt`; `n` names it
/// in the error of a value out of range.
fn pick(n: &str, cli: Option<f64>, f: Option<f64>, dflt: Duration) -> anyhow::Result<Duration> {
    match cli.or(f) {
        Some(v) => secs(n, v),
        None => Ok(dflt),
    }
}

/// The prefillers and their bootstrap ports: from SGLang router's `--prefill URL [PORT]`, else
/// from the flags when any is given or the file names none, else the file's;
/// `--prefiller-bootstrap-port` (one for all, or one per prefiller) over the file's ports.
fn prefillers_of(
    a: &ProxyArgs,
    from_file: Vec<FilePrefiller>,
) -> anyhow::Result<(Vec<WorkerAddr>, Vec<Option<u16>>)> {
    let flags = a.prefiller_host.is_some() || a.prefiller_port.is_some();
    let (addrs, mut ports) = if let Some(groups) = &a.prefill {
        if flags {
            anyhow::bail!("give prefillers as --prefill URL or as --prefiller-host/--prefiller-port, not both");
        }
        crate::router_form::prefills(groups)?.into_iter().unzip()
    } else if flags || from_file.is_empty() {
        let hosts = a
            .prefiller_host
            .clone()
            .unwrap_or_else(|| vec!["localhost".into()]);
        let ports = a.prefiller_port.clone().unwrap_or_else(|| vec![8100]);
        let addrs = expand("prefiller", &hosts, &ports, a.num_prefillers)?;
        (addrs, Vec::new())
    } else {
        from_file
            .into_iter()
            .map(|p| {
                (
                    WorkerAddr {
                        host: p.host,
                        port: p.port,
                    },
                    p.bootstrap_port,
                )
            })
            .unzip()
    };
    if let Some(bp) = &a.prefiller_bootstrap_port {
        if a.prefill.is_some() {
            anyhow::bail!("--prefill URL BOOTSTRAP_PORT gives each bootstrap port: drop --prefiller-bootstrap-port");
        }
        ports = match bp.as_slice() {
            [one] => vec![one.0; addrs.len()],
            many => many.iter().map(|p| p.0).collect(),
        };
    }
    if ports.iter().all(Option::is_none) {
        ports.clear();
    }
    Ok((addrs, ports))
}

/// The decoders: from the flags when any address is given or the file names none, else the
/// file's with the flags' KV ports; the flags' admission limits apply to either.
fn decoders_of(a: &ProxyArgs, from_file: Vec<DecoderConfig>) -> anyhow::Result<Vec<DecoderConfig>> {
    let flags = a.decoder_host.is_some() || a.decoder_port.is_some();
    if a.decode.is_some() && flags {
        anyhow::bail!(
            "give decoders as --decode URL or as --decoder-host/--decoder-port, not both"
        );
    }
    let decoders = if a.decode.is_some() || flags || from_file.is_empty() {
        let hosts = a
            .decoder_host
            .clone()
            .unwrap_or_else(|| vec!["localhost".into()]);
        let ports = a.decoder_port.clone().unwrap_or_else(|| vec![8200]);
        let init = a.decoder_init_port.clone().unwrap_or_else(|| vec![8300]);
        let alloc = a.decoder_alloc_port.clone().unwrap_or_else(|| vec![8400]);
        let addrs = match &a.decode {
            Some(urls) => urls
                .iter()
                .map(|u| crate::router_form::worker_url(u))
                .collect::<anyhow::Result<Vec<_>>>()?,
            None => expand("decoder", &hosts, &ports, a.num_decoders)?,
        };
        addrs
            .into_iter()
            .map(|w| DecoderConfig {
                host: w.host,
                port: w.port,
                init_ports: init.clone(),
                alloc_ports: alloc.clone(),
                max_requests: 0,
                kv_capacity_tokens: 0,
            })
            .collect()
    } else {
        let mut ds = from_file;
        for dc in &mut ds {
            if let Some(i) = &a.decoder_init_port {
                dc.init_ports = i.clone();
            }
            if let Some(i) = &a.decoder_alloc_port {
                dc.alloc_ports = i.clone();
            }
        }
        ds
    };
    let mut decoders = decoders;
    for dc in &mut decoders {
        if let Some(m) = a.decoder_max_requests {
            dc.max_requests = m;
        }
        if let Some(c) = a.decoder_kv_capacity {
            dc.kv_capacity_tokens = c;
        }
    }
    Ok(decoders)
}

/// `[kv_events]` of the file, each flag given overriding its field.
fn kv_events_of(a: &ProxyArgs, from_file: Option<KvEventsConfig>) -> KvEventsConfig {
    let mut k = from_file.unwrap_or_default();
    if let Some(e) = &a.prefiller_kv_events_endpoint {
        k.prefiller_endpoints = e.clone();
    }
    if let Some(e) = &a.decoder_kv_events_endpoint {
        k.decoder_endpoints = e.clone();
    }
    if let Some(t) = &a.kv_events_topic {
        k.topic = t.clone();
    }
    k.prefill_weight = a.kv_events_prefill_weight.unwrap_or(k.prefill_weight);
    k.load_weight = a.kv_events_load_weight.unwrap_or(k.load_weight);
    k.tokenize = a.kv_events_tokenize.unwrap_or(k.tokenize);
    k.tokenize_timeout = a.kv_events_tokenize_timeout.unwrap_or(k.tokenize_timeout);
    k.tokenize_max_reply_bytes = a
        .kv_events_tokenize_max_reply_bytes
        .unwrap_or(k.tokenize_max_reply_bytes);
    k
}

/// `[cache_aware]` of the file, each flag given overriding its field.
fn cache_aware_of(a: &ProxyArgs, from_file: Option<CacheAwareParams>) -> CacheAwareParams {
    let mut c = from_file.unwrap_or_default();
    c.cache_threshold = a.cache_threshold.unwrap_or(c.cache_threshold);
    c.balance_abs_threshold = a.balance_abs_threshold.unwrap_or(c.balance_abs_threshold);
    c.balance_rel_threshold = a.balance_rel_threshold.unwrap_or(c.balance_rel_threshold);
    c
}

/// `[disaggregation]` of the file, each flag given overriding its field.
fn disaggregation_of(
    a: &ProxyArgs,
    from_file: Option<DisaggregationConfig>,
) -> DisaggregationConfig {
    let mut g = from_file.unwrap_or_default();
    if a.disaggregate_min_uncached_tokens.is_some() {
        g.min_uncached_tokens = a.disaggregate_min_uncached_tokens;
    }
    if a.disaggregate_decoder_cached_fraction.is_some() {
        g.decoder_cached_fraction = a.disaggregate_decoder_cached_fraction;
    }
    if a.disaggregate_compare_queues.is_some() {
        g.compare_queues = a.disaggregate_compare_queues;
    }
    g
}

fn load_file(p: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(p)
        .map_err(|e| anyhow::anyhow!("cannot read config file {}: {e}", p.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("bad config file {}: {e}", p.display()))
}
