//! The health checks: one task per worker, ejecting and re-admitting it; and one more per
//! decoder under `--flow vllm`, reading its KV load counters off its `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use super::app::App;
use crate::decoder_loads::{self, Unknown};
use crate::pool::{Pool, Role};

/// Checks worker `idx` every `health_interval`: `GET /health` must answer 2xx, then each of
/// `kv` (`host:port`, a decoder's KV init ports) must accept a TCP connection, all within
/// `health_timeout`. The probe connection is closed before it sends a byte, which a kvbridge
/// listener drops without a word.
pub(crate) async fn health_loop(app: Arc<App>, pool: Arc<Pool>, idx: usize, kv: Vec<String>) {
    let mut tick = tokio::time::interval(app.cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let uri = format!("{}/health", pool.workers[idx].base);
    loop {
        tick.tick().await;
        let started = pool.check_started(idx);
        let req = Request::get(&uri).body(Full::new(Bytes::new()));
        let Ok(req) = req else { return };
        let check = async {
            let resp = match app.client.request(req).await {
                Ok(r) => r,
                Err(e) => return Err(format!("GET /health: {e}")),
            };
            let status = resp.status();
            let _ = Limited::new(resp.into_body(), 1 << 16).collect().await;
            if !status.is_success() {
                return Err(format!("GET /health answered {status}"));
            }
            for a in &kv {
                if let Err(e) = tokio::net::TcpStream::connect(a).await {
                    return Err(format!("KV port {a}: {e}"));
                }
            }
            Ok(())
        };
        let r = match tokio::time::timeout(app.cfg.health_timeout, check).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {:?}", app.cfg.health_timeout)),
        };
        let changed = pool.report_check(idx, r.is_ok(), started);
        if changed && r.is_err() && pool.role == Role::Prefill {
            app.prefiller_ejected(idx);
        }
        let worker = &pool.workers[idx].label;
        match r {
            Err(why) if changed => {
                tracing::warn!(%worker, "health check failed, worker ejected: {why}")
            }
            Err(why) => tracing::debug!(%worker, "health check failed: {why}"),
            Ok(()) if changed => {
                tracing::info!(%worker, "health checks pass again, worker re-admitted")
            }
            Ok(()) => {}
        }
    }
}

/// The deadline of one scrape of a decoder's `/metrics`: until the next is due, at most 5 s
/// (vLLM answers it from its API server's event loop, slow under load), at least the health
/// checks' deadline.
fn scrape_deadline(interval: Duration, health_timeout: Duration) -> Duration {
    interval.min(Duration::from_secs(5)).max(health_timeout)
}

/// Scrapes decoder `idx`'s `/metrics` every `health_interval` for its KvbridgeConnector's
/// load counters ([`crate::decoder_loads`]) into the app's board; a scrape that fails or
/// reads no counters marks them unknown. Apart from the health checks and requests: a slow
/// or hostile `/metrics` delays neither, and holds at most one connection.
pub(crate) async fn loads_loop(app: Arc<App>, idx: usize) {
    let mut tick = tokio::time::interval(app.cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = scrape_deadline(app.cfg.health_interval, app.cfg.health_timeout);
    let worker = &app.decode.workers[idx].label;
    let Ok(uri) = format!("{}/metrics", app.decode.workers[idx].base).parse::<Uri>() else {
        return;
    };
    loop {
        tick.tick().await;
        let r = decoder_loads::scrape(&app.client, uri.clone(), deadline).await;
        let why = r.as_ref().err().map(ToString::to_string);
        let prev = app.decoder_loads.set(idx, r);
        let was_known = matches!(prev, Some(Ok(_)));
        match why {
            Some(why) if was_known || matches!(prev, Some(Err(Unknown::NotYet))) => {
                tracing::warn!(%worker, "decoder's KV load counters unknown: {why}")
            }
            Some(why) => tracing::debug!(%worker, "decoder's KV load counters unknown: {why}"),
            None if !was_known => tracing::info!(%worker, "decoder's KV load counters read"),
            None => {}
        }
    }
}
