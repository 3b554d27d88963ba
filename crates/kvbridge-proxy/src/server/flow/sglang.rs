//! The sglang flow: SGLang's PD servers, driven as SGLang's router drives them. The client's
//! body, with `bootstrap_host` and `bootstrap_port` of the chosen prefiller and a fresh
//! `bootstrap_room` (one per prompt of a batch), goes to the prefiller and the decoder at
//! once; the decoder's answer is the answer (`/generate` with `return_logprob`: with the
//! prefill's input logprobs in front of its own).
//!
//! The prefill runs as a task of its own beside the decode. When it fails before the
//! decoder has answered (a stream: before its first event), the decode is cancelled (its
//! connection closed, which aborts it on the server) and the client gets the prefill's error
//! at once, instead of waiting for a decode server that waits for KV that will never come.
//! Once the decoder answered, the prefill runs to its end on its own, within
//! `--prefill-timeout`.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{StatusCode, Uri};
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::oneshot;

use crate::logprob_merge::{self, InputLogprobs, SseMerge};
use crate::metrics::Outcome;
use crate::pool::{Role, Slot};
use crate::reply::{pick_error, ApiError, Reply};
use crate::request::{Api, ReqDoc};
use crate::server::app::{App, TL};
use crate::server::ctx::Ctx;
use crate::server::task::Detachable;
use crate::server::upstream::{upstream_status, CallError, MAX_UPSTREAM_BODY};
use crate::sglang_body;

/// How long a decoder's error waits for the prefill's outcome, so that a decode failing
/// because its prefill did is reported as the prefill's failure.
const PREFILL_OUTCOME_GRACE: Duration = Duration::from_millis(100);

/// How a prefill ended, short of an answer.
enum PrefillFail {
    /// The prefiller refused the connection: nothing reached it.
    Refused(String),
    /// Any other failure: the answer to give.
    Api(ApiError),
}

/// The prefill running beside the decode.
struct Prefill {
    index: usize,
    label: String,
    /// Its outcome, until taken.
    rx: Option<oneshot::Receiver<Result<Bytes, PrefillFail>>>,
    /// Aborts it (closing its connection) if the request ends before it is let go.
    guard: Detachable,
}

impl Prefill {
    /// The prefill's outcome (only once: callers check [`Prefill::pending`]).
    async fn outcome(&mut self) -> Result<Bytes, PrefillFail> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(PrefillFail::Api(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                Outcome::PrefillError,
                "internal: the prefill's outcome was asked for twice",
            )));
        };
        let r = rx.await;
        self.rx = None;
        r.unwrap_or_else(|_| {
            Err(PrefillFail::Api(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                Outcome::PrefillError,
                "internal: the prefill task ended without an outcome",
            )))
        })
    }

    fn pending(&self) -> bool {
        self.rx.is_some()
    }
}

/// How one attempt failed.
enum Fail {
    /// The prefiller refused the connection (no KV can come from it): the request may start
    /// over with another prefiller and a new room.
    PrefillRefused {
        index: usize,
        label: String,
        why: String,
    },
    /// Any other failure: the answer to give.
    Api(ApiError),
}

impl From<ApiError> for Fail {
    fn from(e: ApiError) -> Self {
        Fail::Api(e)
    }
}

impl App {
    /// sglang flow: a prefiller by the routing policy, the admitted decoder, both sent the
    /// same body at once. A prefiller that refuses the connection is ejected and the request
    /// starts over with the next (each at most once); a decoder that refuses it is ejected
    /// and the same body goes to the next decoder (the room is not yet taken).
    pub(crate) async fn sglang(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        dslot: Slot,
    ) -> Result<Reply, ApiError> {
        let batch = sglang_body::batch_size(ctx.api, doc).map_err(ApiError::bad_request)?;
        let merge = ctx.api == Api::Generate && logprob_merge::asks(doc.raw("return_logprob"));
        let mut dslot = Some(dslot);
        let mut tried = Vec::new();
        loop {
            let pslot = self
                .prefill
                .try_pick_for(ctx.tokens, &tried, ctx.prompt.as_ref())
                .map_err(|e| pick_error(Role::Prefill, e))?;
            let d = match dslot.take() {
                Some(d) => d,
                None => {
                    let mut d = self
                        .decode
                        .try_pick(ctx.tokens, &[])
                        .map_err(|e| pick_error(Role::Decode, e))?;
                    d.kv_from_prefiller();
                    self.metrics.prefiller_retries.fetch_add(1, Relaxed);
                    d
                }
            };
            match self.sglang_once(ctx, doc, batch, merge, pslot, d).await {
                Ok(r) => return Ok(r),
                Err(Fail::Api(e)) => return Err(e),
                Err(Fail::PrefillRefused { index, label, why }) => {
                    tracing::warn!(request_id = ctx.rid(), worker = %label, "prefiller unreachable: {why}");
                    self.prefill.report(index, false, true);
                    tried.push(index);
                }
            }
        }
    }

    /// One attempt of [`App::sglang`] with this pair: both requests out, then whichever
    /// answers first decides (see the module docs).
    async fn sglang_once(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        batch: Option<usize>,
        merge: bool,
        pslot: Slot,
        dslot: Slot,
    ) -> Result<Reply, Fail> {
        let index = pslot.index();
        let rooms = sglang_body::rooms(batch.unwrap_or(1));
        let body = Bytes::from(sglang_body::with_bootstrap(
            doc,
            batch.is_some(),
            &self.cfg.prefillers[index].host,
            self.cfg.bootstrap_port(index),
            &rooms,
        ));
        tracing::debug!(request_id = ctx.rid(), prefiller = %pslot.worker().label,
            decoder = %dslot.worker().label, room = rooms[0], prompts = rooms.len(), "sglang pair");
        tracing::debug!(target: TL, stage = "proxy.prefill_sent", id = ctx.rid());
        let mut prefill = self.spawn_prefill(ctx, pslot, body.clone());
        let decode = self.decode(ctx, body, dslot, true);
        tokio::pin!(decode);
        let mut answer = None;
        let reply = loop {
            tokio::select! {
                r = prefill.outcome(), if prefill.pending() => match r {
                    Ok(b) => answer = Some(b),
                    Err(f) => return Err(self.prefill_failed(ctx, &prefill, f, true)),
                },
                r = &mut decode => match r {
                    Ok(reply) => break reply,
                    Err(e) => {
                        if prefill.pending() {
                            if let Ok(Err(f)) =
                                tokio::time::timeout(PREFILL_OUTCOME_GRACE, prefill.outcome()).await
                            {
                                return Err(self.prefill_failed(ctx, &prefill, f, false));
                            }
                        }
                        return Err(e.into());
                    }
                },
            }
        };
        tracing::debug!(target: TL, stage = "proxy.decode_answered", id = ctx.rid());
        self.sglang_answer(ctx, prefill, answer, reply, merge).await
    }

    /// The decoder answered: a stream is held until its first event (or the prefill's
    /// failure, whichever comes first); with logprobs to merge the prefill's answer is
    /// awaited and merged in; the prefill is then let go.
    async fn sglang_answer(
        &self,
        ctx: &Ctx<'_>,
        mut prefill: Prefill,
        mut answer: Option<Bytes>,
        reply: Reply,
        merge: bool,
    ) -> Result<Reply, Fail> {
        let reply = self
            .first_event(ctx, &mut prefill, &mut answer, reply)
            .await?;
        if !merge {
            prefill.guard.detach();
            return Ok(reply);
        }
        let answer = match answer {
            Some(a) => a,
            None => match prefill.outcome().await {
                Ok(a) => a,
                Err(f) => return Err(self.prefill_failed(ctx, &prefill, f, true)),
            },
        };
        let logprobs = InputLogprobs::from_prefill(&answer);
        if logprobs.is_empty() {
            return Ok(reply);
        }
        Ok(match reply {
            Reply::Full { content_type, body } => Reply::Full {
                content_type,
                body: logprobs.merge_json(&body).unwrap_or(body),
            },
            Reply::Stream {
                content_type,
                body,
                prefix,
                slot,
                decode_start,
                ..
            } => {
                let label = slot.worker().label.clone();
                let mut m = SseMerge::new(logprobs, MAX_UPSTREAM_BODY);
                let prefix = match prefix.map(|p| m.push(&p)) {
                    Some(Err(e)) => return Err(stream_broke(&label, e)),
                    Some(Ok(p)) => Some(p).filter(|p| !p.is_empty()),
                    None => None,
                };
                Reply::Stream {
                    content_type,
                    body,
                    prefix,
                    slot,
                    decode_start,
                    merge: Some(m),
                }
            }
            r => r,
        })
    }

    /// A stream's first event, read ahead within `--decode-timeout` while the prefill may
    /// still fail: the stream with that event in front, or the prefill's failure (the
    /// decode cancelled), or the decoder's (nothing in time, a broken stream), each as an
    /// HTTP error rather than an SSE event after a 200. A prefill answer that comes
    /// meanwhile goes into `answer`.
    async fn first_event(
        &self,
        ctx: &Ctx<'_>,
        prefill: &mut Prefill,
        answer: &mut Option<Bytes>,
        reply: Reply,
    ) -> Result<Reply, Fail> {
        let Reply::Stream {
            content_type,
            mut body,
            prefix,
            slot,
            decode_start,
            merge,
        } = reply
        else {
            return Ok(reply);
        };
        let timeout = self.cfg.decode_timeout;
        let label = slot.worker().label.clone();
        let first = tokio::time::timeout(timeout, body.frame());
        tokio::pin!(first);
        let first = loop {
            tokio::select! {
                r = prefill.outcome(), if prefill.pending() => match r {
                    Ok(b) => *answer = Some(b),
                    Err(f) => return Err(self.prefill_failed(ctx, prefill, f, true)),
                },
                f = &mut first => break f,
            }
        };
        let prefix = match first {
            Err(_) => {
                return Err(Fail::Api(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "decode_timeout",
                    Outcome::DecodeError,
                    format!("decoder {label} sent nothing within {timeout:?}"),
                )))
            }
            Ok(Some(Err(e))) => return Err(stream_broke(&label, e.to_string())),
            Ok(None) => {
                return Ok(Reply::Full {
                    content_type,
                    body: Bytes::new(),
                })
            }
            Ok(Some(Ok(frame))) => frame.into_data().ok().or(prefix),
        };
        Ok(Reply::Stream {
            content_type,
            body,
            prefix,
            slot,
            decode_start,
            merge,
        })
    }

    /// Sends the prefill from a task of its own, so that it runs on (holding its prefill
    /// slot) after the decoder answered.
    fn spawn_prefill(self: &Arc<Self>, ctx: &Ctx<'_>, pslot: Slot, body: Bytes) -> Prefill {
        let (tx, rx) = oneshot::channel();
        let (index, label) = (pslot.index(), pslot.worker().label.clone());
        let uri = self.uri(Role::Prefill, index, ctx.api);
        let (app, owned) = (self.clone(), ctx.to_owned());
        let task = tokio::spawn(async move {
            let r = app.sglang_prefill(&owned.ctx(), uri, &pslot, body).await;
            drop(pslot);
            let _ = tx.send(r);
        });
        Prefill {
            index,
            label,
            rx: Some(rx),
            guard: Detachable::new(&task),
        }
    }

    /// The prefill request, within `--prefill-timeout`: its whole answer, or why not.
    async fn sglang_prefill(
        &self,
        ctx: &Ctx<'_>,
        uri: Uri,
        slot: &Slot,
        body: Bytes,
    ) -> Result<Bytes, PrefillFail> {
        let label = &slot.worker().label;
        let t = Instant::now();
        let timeout = self.cfg.prefill_timeout;
        let fail = |status, code, message: String| {
            PrefillFail::Api(ApiError::new(status, code, Outcome::PrefillError, message))
        };
        match tokio::time::timeout(timeout, self.call(uri, ctx, body)).await {
            Err(_) => Err(fail(
                StatusCode::GATEWAY_TIMEOUT,
                "prefill_timeout",
                format!("prefiller {label} did not answer within {timeout:?}"),
            )),
            Ok(Err(CallError::Connect(e))) => Err(PrefillFail::Refused(e)),
            Ok(Err(CallError::Other(e))) => Err(fail(
                StatusCode::BAD_GATEWAY,
                "prefill_failed",
                format!("prefiller {label}: {e}"),
            )),
            Ok(Ok((status, ct, b))) => {
                self.metrics.prefill.observe(t.elapsed());
                if status.is_success() {
                    Ok(b)
                } else {
                    Err(PrefillFail::Api(upstream_status(
                        status,
                        ct,
                        b,
                        label,
                        Role::Prefill,
                    )))
                }
            }
        }
    }

    /// The prefill failed; `cancelled`: the decode still out is being dropped for it.
    fn prefill_failed(&self, ctx: &Ctx<'_>, p: &Prefill, f: PrefillFail, cancelled: bool) -> Fail {
        if cancelled {
            self.metrics.decodes_cancelled.fetch_add(1, Relaxed);
            tracing::debug!(request_id = ctx.rid(), worker = %p.label, "the prefill failed: decode cancelled");
        }
        match f {
            PrefillFail::Refused(why) => Fail::PrefillRefused {
                index: p.index,
                label: p.label.clone(),
                why,
            },
            PrefillFail::Api(e) => Fail::Api(e),
        }
    }
}

/// A decoder's stream that broke before its first event went out.
fn stream_broke(label: &str, e: String) -> Fail {
    Fail::Api(ApiError::new(
        StatusCode::BAD_GATEWAY,
        "decode_failed",
        Outcome::DecodeError,
        format!("decoder {label}: its stream broke: {e}"),
    ))
}
