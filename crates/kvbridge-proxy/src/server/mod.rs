//! The HTTP front: [`start`] binds the proxy and runs it; [`RunningProxy`] stops it.
//!
//! Below this module, in layers: `routes` (the HTTP routes, and the reply a flow gives
//! becoming the response), `flow` (one request's way through the workers: the decider, then
//! the vLLM or LMCache flow), `prefill` and `decode` (one step on a worker, with its
//! retries), `upstream` (a call to a worker), `health` (the health checks, and the scrapes of
//! the decoders' load counters), and at the bottom `ctx` and `app` (the request's facts and
//! the state every request shares).

mod app;
mod ctx;
mod decode;
mod flow;
mod health;
mod prefill;
mod prompt_tokens;
mod routes;
mod task;
mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::busy_poll::BusyPoll;
use crate::config::{Config, Flow};
use crate::kvwait::KvWaiters;
use crate::metrics::Metrics;
use crate::pool::{Pool, Role};
use app::{api_uris, App, HttpClient};

/// A running proxy: its bound addresses and the handle to stop it. Dropping it stops every
/// task of the proxy at once; [`RunningProxy::shutdown`] lets requests in flight finish first.
pub struct RunningProxy {
    http_addr: SocketAddr,
    notify_addr: Option<SocketAddr>,
    app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningProxy {
    /// Address of the HTTP server.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Address of the notification PULL socket (lmcache flow only).
    pub fn notify_addr(&self) -> Option<SocketAddr> {
        self.notify_addr
    }

    /// The proxy's live metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.app.metrics
    }

    /// The disaggregation decider and its counts.
    pub fn decider(&self) -> &crate::routing::decider::Decider {
        &self.app.decider
    }

    /// Stops accepting, lets requests in flight finish (at most 30 s), then stops every task.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(mut h) = self.server.take() {
            if tokio::time::timeout(Duration::from_secs(30), &mut h)
                .await
                .is_err()
            {
                h.abort();
            }
        }
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        if let Some(h) = &self.server {
            h.abort();
        }
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds the HTTP listener (and, in the lmcache flow, the notification socket), starts the
/// health checks, and serves in the background. Everything is bound when this returns.
pub async fn start(cfg: Config) -> anyhow::Result<RunningProxy> {
    cfg.validate()?;
    let metrics = Arc::new(Metrics::default());
    let mut tasks = Vec::new();
    let (waiters, notify_addr) = if cfg.flow == Flow::Lmcache {
        let w = KvWaiters::spawn(metrics.clone());
        let (addr, t) = crate::outcome_port::bind(
            &cfg.proxy_host,
            cfg.proxy_port,
            w.clone(),
            metrics.clone(),
            cfg.secret.clone(),
            cfg.outcome_port,
        )
        .await?;
        tasks.push(t);
        (Some(w), Some(addr))
    } else {
        (None, None)
    };
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
    let http_addr = listener.local_addr()?;

    let client = worker_client(&cfg);
    let (ua, ha) = (cfg.unhealthy_after, cfg.healthy_after);
    let prefill = Pool::routed(
        Role::Prefill,
        cfg.prefillers
            .iter()
            .map(|w| (w.host.clone(), w.port, 0, 0)),
        ua,
        ha,
        crate::routing::pool_router::for_pool(&cfg, Role::Prefill),
    );
    let decode = Pool::routed(
        Role::Decode,
        cfg.decoders
            .iter()
            .map(|d| (d.host.clone(), d.port, d.max_requests, d.kv_capacity_tokens)),
        ua,
        ha,
        crate::routing::pool_router::for_pool(&cfg, Role::Decode),
    );
    let (prefill_uris, decode_uris) = (api_uris(&prefill)?, api_uris(&decode)?);
    let one_thread = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::CurrentThread;
    let busy_poll = (one_thread && !cfg.busy_poll.is_zero()).then(|| BusyPoll::new(cfg.busy_poll));
    if let Some(bp) = &busy_poll {
        tasks.push(tokio::spawn(bp.clone().run()));
    }
    let decider = crate::routing::decider::Decider::new(cfg.decider());
    if cfg.kv_events.tokenize == crate::tokenize::TokenizeMode::Http
        && cfg.routing != crate::routing::RoutingPolicy::KvEvents
    {
        tracing::warn!(
            "--kv-events-tokenize http has no effect under --routing {}: only kv-events matches token ids",
            cfg.routing.as_str()
        );
    }
    let decoder_loads = if scrapes_decoder_loads(&cfg) {
        crate::decoder_loads::Board::new(decode.workers.iter().map(|w| w.label.clone()))
    } else {
        crate::decoder_loads::Board::default()
    };
    let app = Arc::new(App {
        decider,
        decoder_loads,
        cfg,
        client,
        prefill,
        decode,
        waiters,
        metrics,
        prefill_uris,
        decode_uris,
        busy_poll,
        tokenize_stats: Default::default(),
        tokenize_turn: Default::default(),
    });
    if !app.cfg.health_interval.is_zero() {
        tasks.extend(spawn_health_checks(&app));
    }
    let router = routes::router(app.clone());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(crate::listener::serve(
        listener,
        router,
        app.cfg.http_limits,
        app.metrics.clone(),
        stop_rx,
    ));
    Ok(RunningProxy {
        http_addr,
        notify_addr,
        app,
        stop: Some(stop_tx),
        server: Some(server),
        tasks,
    })
}

/// The HTTP client the proxy calls its workers with: no Nagle delay, the configured
/// connect timeout, idle connections kept a minute.
fn worker_client(cfg: &Config) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(cfg.connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_timer(TokioTimer::new())
        .build(conn)
}

/// Whether the proxy scrapes its decoders' `/metrics` for their load counters: decoders
/// running KvbridgeConnector (`--flow vllm`), at the health checks' interval (so not when
/// they are off).
fn scrapes_decoder_loads(cfg: &Config) -> bool {
    cfg.flow == Flow::Vllm && !cfg.health_interval.is_zero()
}

/// One health-check task per worker of each pool; a decoder's also probes its KV ports
/// where the configuration asks for it. Under `--flow vllm`, one more task per decoder
/// scrapes its load counters ([`health::loads_loop`]).
fn spawn_health_checks(app: &Arc<App>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (idx, p) in app.cfg.prefillers.iter().enumerate() {
        // sglang flow: the prefill server's bootstrap server, which each decode reaches.
        let kv = match app.cfg.bootstrap_port(idx) {
            Some(port) if app.cfg.probes_bootstrap_ports() => vec![format!("{}:{port}", p.host)],
            _ => Vec::new(),
        };
        let pool = app.prefill.clone();
        tasks.push(tokio::spawn(health::health_loop(
            app.clone(),
            pool,
            idx,
            kv,
        )));
    }
    for (idx, d) in app.cfg.decoders.iter().enumerate() {
        let kv = if app.cfg.probes_kv_ports() {
            d.init_ports
                .iter()
                .map(|p| format!("{}:{p}", d.host))
                .collect()
        } else {
            Vec::new()
        };
        let pool = app.decode.clone();
        tasks.push(tokio::spawn(health::health_loop(
            app.clone(),
            pool,
            idx,
            kv,
        )));
        if scrapes_decoder_loads(&app.cfg) {
            tasks.push(tokio::spawn(health::loads_loop(app.clone(), idx)));
        }
    }
    tasks
}
