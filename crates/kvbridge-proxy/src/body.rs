//! The streamed answer: the decoder's body passed through frame by frame, with an idle
//! deadline, an SSE `error` event when the decoder fails mid-stream, and the request's guards
//! released exactly once when the stream ends (or the client goes away). The answer may start
//! before the decoder's does ([`ProxyBody::pending`]): with the prefill's first token, while
//! the decode request is still out; the decoder's stream then follows, or its failure as an
//! SSE `error` event.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;

use crate::logprob_merge::SseMerge;
use crate::metrics::Outcome;
use crate::pool::Slot;
use crate::reply::{public_message, PendingDecode, Reply, Track};

/// What a finished stream releases and records.
pub(crate) struct Finish {
    pub track: Track,
    /// The decoder's admission slot (`None` while the decode is pending: it holds it).
    pub slot: Option<Slot>,
    pub decode_start: Instant,
}

/// A streamed answer (see the module docs).
pub(crate) struct ProxyBody {
    prefix: Option<Bytes>,
    pending: Option<PendingDecode>,
    inner: Option<Incoming>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    first: bool,
    fin: Option<Finish>,
    /// The prefill's input logprobs merged into each event (sglang flow, `/generate`).
    merge: Option<SseMerge>,
}

/// Formats an SSE `error` event with an OpenAI-shaped error object.
pub(crate) fn sse_error(message: &str, code: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}});
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

impl ProxyBody {
    pub(crate) fn new(
        inner: Incoming,
        prefix: Option<Bytes>,
        idle: Duration,
        fin: Finish,
        merge: Option<SseMerge>,
    ) -> Self {
        ProxyBody {
            prefix,
            pending: None,
            inner: Some(inner),
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            first: true,
            fin: Some(fin),
            merge,
        }
    }

    /// An answer that starts with `first` while `decode` is still out; the decoder's stream
    /// follows once it answers (`idle` applies to that wait as to any other).
    pub(crate) fn pending(
        first: Bytes,
        decode: PendingDecode,
        idle: Duration,
        track: Track,
    ) -> Self {
        ProxyBody {
            prefix: Some(first),
            pending: Some(decode),
            inner: None,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            first: true,
            fin: Some(Finish {
                track,
                slot: None,
                decode_start: Instant::now(),
            }),
            merge: None,
        }
    }

    fn on_data(&mut self) {
        if self.first {
            self.first = false;
            if let Some(f) = &mut self.fin {
                f.track.metrics.ttft.observe(f.track.t0.elapsed());
                // Its first token out, the decoder has prefilled the prompt: counted as
                // load until the stream ended, it made a decoder that prefills requests
                // alone look busy for as long as they decode.
                if let Some(s) = f.slot.as_mut() {
                    s.no_prefill_left();
                }
                // The timeline's end of the TTFT (`kvbridge demo --timeline`, `RUST_LOG`).
                tracing::debug!(target: "kvbridge::timeline", stage = "proxy.first_byte", id = f.track.rid());
            }
        }
    }

    fn fail(&mut self, message: String, code: &str, outcome: Outcome) -> Frame<Bytes> {
        self.inner = None;
        self.pending = None;
        if let Some(mut f) = self.fin.take() {
            let worker = f
                .slot
                .as_ref()
                .map(|s| s.worker().label.clone())
                .unwrap_or_default();
            tracing::warn!(request_id = f.track.rid(), worker = %worker, code, "{message}");
            f.track.outcome = outcome;
        }
        Frame::data(sse_error(public_message(code), code))
    }

    /// Polls the pending decode: `Ready(None)` once its stream is in `inner` (or nothing
    /// was pending), `Ready(Some(frame))` for what to send instead, `Pending` meanwhile.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<Option<Frame<Bytes>>> {
        let Some(p) = self.pending.as_mut() else {
            return Poll::Ready(None);
        };
        let r = match p.as_mut().poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => {
                if self.timer.as_mut().poll(cx).is_ready() {
                    let msg = format!("decoder did not answer for {:?}", self.idle);
                    return Poll::Ready(Some(self.fail(
                        msg,
                        "decoder_stream_failed",
                        Outcome::DecodeError,
                    )));
                }
                return Poll::Pending;
            }
        };
        self.pending = None;
        match r {
            Ok(Reply::Stream {
                body,
                slot,
                decode_start,
                ..
            }) => {
                if let Some(f) = &mut self.fin {
                    f.slot = Some(slot);
                    f.decode_start = decode_start;
                }
                self.inner = Some(body);
                Poll::Ready(None)
            }
            Ok(Reply::Full { body, .. }) => {
                // Not a stream (a decoder that ignored `stream`): passed on whole.
                if let Some(mut f) = self.fin.take() {
                    f.track.outcome = Outcome::Ok;
                }
                Poll::Ready(Some(Frame::data(body)))
            }
            Ok(Reply::Pending { .. }) => Poll::Ready(Some(self.fail(
                "internal: a decode answered with another pending decode".into(),
                "internal",
                Outcome::DecodeError,
            ))),
            Err(e) => {
                let (message, code, outcome) = e.parts();
                Poll::Ready(Some(self.fail(message, code, outcome)))
            }
        }
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
        match this.poll_pending(cx) {
            Poll::Ready(Some(frame)) => return Poll::Ready(Some(Ok(frame))),
            Poll::Ready(None) => {}
            Poll::Pending => return Poll::Pending,
        }
        loop {
            let Some(inner) = this.inner.as_mut() else {
                return Poll::Ready(None);
            };
            let polled = Pin::new(inner).poll_frame(cx);
            if let Some(r) = this.on_frame(polled, cx) {
                return r;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.pending.is_none() && self.inner.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A poll of the decoder's stream.
type Polled = Poll<Option<Result<Frame<Bytes>, hyper::Error>>>;

/// A poll of the client's body.
type Served = Poll<Option<Result<Frame<Bytes>, Infallible>>>;

impl ProxyBody {
    /// What the decoder's stream gave becomes what the client reads; `None` when a merged
    /// chunk completed no event yet and the stream is to be polled again.
    fn on_frame(&mut self, polled: Polled, cx: &mut Context<'_>) -> Option<Served> {
        let this = self;
        Some(match polled {
            Poll::Ready(Some(Ok(frame))) => {
                let mut frame = frame;
                if frame.is_data() {
                    let at = tokio::time::Instant::now() + this.idle;
                    this.timer.as_mut().reset(at);
                    if let Some(m) = this.merge.as_mut() {
                        let data = frame.into_data().unwrap_or_default();
                        match m.push(&data) {
                            Ok(out) if out.is_empty() => return None,
                            Ok(out) => frame = Frame::data(out),
                            Err(msg) => {
                                return Some(Poll::Ready(Some(Ok(this.fail(
                                    msg,
                                    "decoder_stream_failed",
                                    Outcome::DecodeError,
                                )))))
                            }
                        }
                    }
                    this.on_data();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let msg = format!("decoder stream broke: {e}");
                Poll::Ready(Some(Ok(this.fail(
                    msg,
                    "decoder_stream_failed",
                    Outcome::DecodeError,
                ))))
            }
            Poll::Ready(None) => {
                this.inner = None;
                if let Some(mut f) = this.fin.take() {
                    f.track.metrics.decode.observe(f.decode_start.elapsed());
                    f.track.outcome = Outcome::Ok;
                }
                match this.merge.as_mut().map(SseMerge::finish) {
                    Some(rest) if !rest.is_empty() => Poll::Ready(Some(Ok(Frame::data(rest)))),
                    _ => Poll::Ready(None),
                }
            }
            Poll::Pending => {
                if this.timer.as_mut().poll(cx).is_ready() {
                    let msg = format!("decoder sent nothing for {:?}", this.idle);
                    Poll::Ready(Some(Ok(this.fail(
                        msg,
                        "decoder_stream_failed",
                        Outcome::DecodeError,
                    ))))
                } else {
                    Poll::Pending
                }
            }
        })
    }
}
