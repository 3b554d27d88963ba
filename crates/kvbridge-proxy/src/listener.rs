//! The HTTP listener: accepts clients under a connection cap and serves each with deadlines
//! for its request headers and body, so that a client that opens connections and sends
//! nothing, or dribbles its request a byte at a time (slowloris), holds neither a connection
//! nor a task for longer than the deadline.
//!
//! * At most [`HttpLimits::max_conns`] connections are served; one beyond is closed as soon
//!   as it is accepted (and counted: `http_conns_refused_total`).
//! * A request's headers must arrive within [`HttpLimits::header_timeout`]; hyper's timer
//!   runs from the moment the connection waits for a request head (so an idle kept-alive
//!   connection is closed after the same time).
//! * A request's body must arrive within [`HttpLimits::body_timeout`] of its headers; a late
//!   one is answered 408 `request_timeout` ([`body_timed_out`] tells the handler).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::config::HttpLimits;
use crate::metrics::Metrics;

/// A request body that fails with [`BodyTimedOut`] once its deadline passes.
struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

/// The error of a request body not received within `--body-timeout`.
#[derive(Debug)]
pub(crate) struct BodyTimedOut(Duration);

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body did not arrive within {:?}", self.0)
    }
}

impl std::error::Error for BodyTimedOut {}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(r) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(r.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimedOut(self.timeout))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `e` (a body extractor's rejection) is a body that missed its deadline.
pub(crate) fn body_timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(x) = cur {
        if x.is::<BodyTimedOut>() {
            return true;
        }
        cur = x.source();
    }
    false
}

/// Serves `router` on `listener` under `limits` until `stop` fires; then lets requests in
/// flight finish (kept-alive connections close after their current request) and returns
/// once every connection is closed. Dropping the future (aborting its task) closes every
/// connection at once.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    mut stop: oneshot::Receiver<()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_conns));
    let (closing_tx, closing) = watch::channel(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            Some(_) = conns.join_next() => continue,
            r = listener.accept() => r,
        };
        let (tcp, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: pause so that a persistent error cannot spin.
                tracing::warn!(error = %e, "HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            let n = metrics.http_conns_refused.fetch_add(1, Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(%peer, cap = limits.max_conns, refused = n, "HTTP connection cap reached; connection closed");
            }
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let router = router.clone();
        let body_timeout = limits.body_timeout;
        let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let req = req.map(|inner| {
                Body::new(TimedBody {
                    inner,
                    deadline: Box::pin(tokio::time::sleep(body_timeout)),
                    timeout: body_timeout,
                })
            });
            let router = router.clone();
            async move {
                let Ok(resp) = router.oneshot(req).await;
                Ok::<_, Infallible>(resp)
            }
        });
        let conn = builder.serve_connection(TokioIo::new(tcp), svc);
        let mut closing = closing.clone();
        conns.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(slot);
        });
    }
    let _ = closing_tx.send(true);
    while conns.join_next().await.is_some() {}
}
