//! What the proxy's end-to-end suites share: a body fed from a channel (so a stub can pause,
//! drip or die mid-stream) and a client's answer, read whole within a bound.

#![allow(dead_code)] // each suite uses its own part of this module

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use serde_json::Value;
use tokio::sync::mpsc;

/// A body fed from a channel; the stub sees its client go when the channel closes.
pub struct ChanBody<E>(pub mpsc::Receiver<Result<Bytes, E>>);

impl<E> http_body::Body for ChanBody<E> {
    type Data = Bytes;
    type Error = E;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, E>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// One answer of the proxy, read whole.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// From sending the request to the answer's last byte.
    pub took: Duration,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }

    /// The `error.code` of a JSON error answer, or "".
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// Sends `req` and reads the whole answer; panics when it takes longer than `bound`.
pub async fn fetch(
    client: &Client<HttpConnector, Full<Bytes>>,
    req: hyper::Request<Full<Bytes>>,
    bound: Duration,
) -> Answer {
    let t0 = Instant::now();
    let (parts, body) = tokio::time::timeout(bound, async {
        let resp = client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        (parts, body.collect().await.unwrap().to_bytes())
    })
    .await
    .expect("the proxy answered within the test's bound");
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        took: t0.elapsed(),
    }
}
