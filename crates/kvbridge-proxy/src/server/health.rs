//! The health checks: one task per worker, ejecting and re-admitting it.

use std::sync::Arc;

use axum::http::Request;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use super::app::App;
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
