//! The streamed answer: the decoder's body passed through frame by frame, with an idle
//! deadline, an SSE `error` event when the decoder fails mid-stream, and the request's guards
//! released exactly once when the stream ends (or the client goes away).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;

use crate::metrics::Outcome;
use crate::pool::Slot;
use crate::server::Track;

/// What a finished stream releases and records.
pub(crate) struct Finish {
    pub track: Track,
    pub slot: Slot,
    pub decode_start: Instant,
}

/// A streamed answer (see the module docs).
pub(crate) struct ProxyBody {
    prefix: Option<Bytes>,
    inner: Option<Incoming>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    first: bool,
    fin: Option<Finish>,
}

/// Formats an SSE `error` event with an OpenAI-shaped error object.
pub(crate) fn sse_error(message: &str, code: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}});
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

impl ProxyBody {
    pub(crate) fn new(inner: Incoming, prefix: Option<Bytes>, idle: Duration, fin: Finish) -> Self {
        ProxyBody {
            prefix,
            inner: Some(inner),
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            first: true,
            fin: Some(fin),
        }
    }

    fn on_data(&mut self) {
        if self.first {
            self.first = false;
            if let Some(f) = &self.fin {
                f.track.metrics.ttft.observe(f.track.t0.elapsed());
            }
        }
    }

    fn fail(&mut self, message: String) -> Frame<Bytes> {
        self.inner = None;
        if let Some(mut f) = self.fin.take() {
            tracing::warn!(request_id = f.track.rid(), worker = %f.slot.worker().label, "{message}");
            f.track.outcome = Outcome::DecodeError;
        }
        Frame::data(sse_error(&message, "decoder_stream_failed"))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if let Some(p) = this.prefix.take() {
            this.on_data();
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data() {
                    this.on_data();
                    let at = tokio::time::Instant::now() + this.idle;
                    this.timer.as_mut().reset(at);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                Poll::Ready(Some(Ok(this.fail(format!("decoder stream broke: {e}")))))
            }
            Poll::Ready(None) => {
                this.inner = None;
                if let Some(mut f) = this.fin.take() {
                    f.track.metrics.decode.observe(f.decode_start.elapsed());
                    f.track.outcome = Outcome::Ok;
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.timer.as_mut().poll(cx).is_ready() {
                    let msg = format!("decoder sent nothing for {:?}", this.idle);
                    Poll::Ready(Some(Ok(this.fail(msg))))
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.inner.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
