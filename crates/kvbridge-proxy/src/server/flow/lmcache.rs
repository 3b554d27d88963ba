//! The LMCache flow: the prefill carries a `disagg_spec` naming the decoder the prefiller
//! pushes the KV to; every rank's outcome is awaited here (`KvReady`, `KvFailed`, the
//! prefiller lost) while the decode may already run, and the answer is passed on only once
//! the KV is confirmed.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::config::DecoderConfig;
use crate::kvwait::{KvOutcome, KvWait, Loss};
use crate::metrics::Outcome;
use crate::pool::Slot;
use crate::reply::{ApiError, Reply};
use crate::request::{Api, ReqDoc};
use crate::rewrite::{
    answer_from_prefill, chat_continues, first_chat_chunk, first_chunk, lmcache_decode_body,
    prefill_body, prepend_first,
};
use crate::server::app::{App, TL};
use crate::server::ctx::Ctx;
use crate::server::prefill::KV_RECEIVER_UNREACHABLE;

/// lmcache flow, decode before `KvReady`: how long a decoder's error waits for the KV's
/// outcome, so that a decoder failing because its transfer did is reported as the transfer's
/// failure (`kv_transfer_failed`). Both learn of it within a millisecond or so of each other.
const KV_OUTCOME_GRACE: Duration = Duration::from_millis(100);

/// How one attempt of the LMCache flow failed.
enum LmcacheFail {
    /// The prefiller could not reach this decoder at all (no KV moved): the request may go
    /// to another decoder. Its admission slot was given back.
    ReceiverUnreachable(String),
    /// Any other failure: the answer to give.
    Api(ApiError),
}

impl From<ApiError> for LmcacheFail {
    fn from(e: ApiError) -> Self {
        LmcacheFail::Api(e)
    }
}

/// A task that is aborted when this handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl App {
    /// LMCache flow: prefill with a `disagg_spec`, wait for every rank's outcome, then decode.
    /// A prefiller that answers `kv_receiver_unreachable` (it could not reach the chosen
    /// decoder at all, so no KV moved) has that decoder ejected, and the request starts over
    /// on the least loaded other healthy decoder that admits it, each decoder at most once.
    pub(crate) async fn lmcache(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        mut dslot: Slot,
    ) -> Result<Reply, ApiError> {
        let mut tried = Vec::new();
        loop {
            let (index, label) = (dslot.index(), dslot.worker().label.clone());
            let detail = match self.lmcache_once(ctx, doc, dslot).await {
                Ok(r) => return Ok(r),
                Err(LmcacheFail::Api(e)) => return Err(e),
                Err(LmcacheFail::ReceiverUnreachable(detail)) => detail,
            };
            tracing::warn!(request_id = ctx.rid(), worker = %label, "the prefiller cannot reach this decoder: {detail}");
            let err = self.decoder_down(index, &label, format!("from the prefiller: {detail}"));
            tried.push(index);
            dslot = match self.decode.try_pick(ctx.tokens, &tried) {
                Ok(mut s) => {
                    s.kv_from_prefiller();
                    s
                }
                Err(_) => return Err(err),
            };
            self.metrics.decoder_retries.fetch_add(1, Relaxed);
        }
    }

    /// One attempt of [`App::lmcache`] with `dslot`'s decoder: the prefill (and the KV
    /// outcomes that come meanwhile), what the decode continues from, then the decode and
    /// the outcomes still awaited; the answer goes out only once the KV is confirmed.
    async fn lmcache_once(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        dslot: Slot,
    ) -> Result<Reply, LmcacheFail> {
        let Some(waiters) = &self.waiters else {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                Outcome::PrefillError,
                "no notification socket",
            )
            .into());
        };
        let dc = &self.cfg.decoders[dslot.index()];
        let id = self.next_id();
        // Registered before the prefill is sent, so no outcome can arrive before its waiter.
        let wait = waiters.register(&id, dc.ranks());
        tracing::debug!(request_id = ctx.rid(), kv_req_id = %id, decoder = %dslot.worker().label, "lmcache prefill");
        let (answer, mut kv) = self.lmcache_prefill(ctx, doc, dc, &id, wait).await?;
        let prefix = decode_prefix(self, ctx, doc, &answer)?;
        if let Some((first, pv)) = &prefix {
            // With `max_tokens: 1` the prefill's answer is the whole answer (still given only
            // once the KV is confirmed).
            if ctx.api == Api::Completions && doc.max_tokens == Some(1) {
                kv.confirm().await?;
                return Ok(answer_from_prefill(pv.clone(), first, ctx.stream));
            }
        }
        if self.cfg.decode_after_kv_ready {
            kv.confirm().await?;
        }
        let first = prefix.as_ref().map(|(f, _)| f.as_str());
        let dbody = Bytes::from(lmcache_decode_body(doc, ctx.api, first, &id));
        // The streamed first token: sent ahead of the decoder's stream.
        let first_sse = prefix
            .as_ref()
            .filter(|_| ctx.stream)
            .map(|(f, pv)| match ctx.api {
                Api::Completions => first_chunk(pv, f, None),
                Api::Chat => first_chat_chunk(pv, f),
                // Not routed to this flow (`/generate` is the sglang flow's).
                Api::Generate => first_chunk(pv, f, None),
            });
        tracing::debug!(target: TL, stage = "proxy.decode_sent", id = %id);
        let reply = match self
            .lmcache_decode(ctx, dslot, dbody, first_sse.clone(), kv)
            .await?
        {
            Decoded::FirstTokenSent(pending) => return Ok(pending),
            Decoded::Answered(reply) => reply,
        };
        tracing::debug!(target: TL, stage = "proxy.decode_answered", id = %id);
        Ok(with_first_token(reply, prefix, first_sse))
    }

    /// The prefill of attempt `id` with a `disagg_spec` naming decoder `dc`, while the KV's
    /// outcomes that come before its answer are taken in: its answer, and the KV's outcomes
    /// still to come from there. A prefiller that could not reach the decoder at all is
    /// [`LmcacheFail::ReceiverUnreachable`].
    async fn lmcache_prefill<'a>(
        &'a self,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        dc: &DecoderConfig,
        id: &'a str,
        mut wait: KvWait,
    ) -> Result<(Bytes, KvOutcomes<'a>), LmcacheFail> {
        let spec = json!({"ret_first_tok": true, "disagg_spec": {"req_id": id, "receiver_host": dc.host,
            "receiver_init_port": dc.init_ports, "receiver_alloc_port": dc.alloc_ports}});
        let spec = serde_json::to_vec(&spec).unwrap_or_default();
        let pbody = Bytes::from(prefill_body(doc, &spec));
        tracing::debug!(target: TL, stage = "proxy.prefill_sent", id = %id);
        let prefill = self.prefill(ctx, pbody, Some(wait.binding()));
        tokio::pin!(prefill);
        let mut ready = false;
        let unreachable = |r: Result<Bytes, ApiError>| match r {
            Err(e) if e.code == KV_RECEIVER_UNREACHABLE => {
                Err(LmcacheFail::ReceiverUnreachable(e.message))
            }
            r => r.map_err(LmcacheFail::Api),
        };
        let answer = loop {
            tokio::select! {
                r = &mut prefill => break unreachable(r)?,
                o = wait.outcome(), if !ready => match o {
                    Some(KvOutcome::Ready) => {
                        tracing::debug!(target: TL, stage = "proxy.kv_ready", id = %id);
                        ready = true
                    }
                    Some(KvOutcome::PrefillerLost { prefiller, how }) => {
                        return Err(self.prefiller_lost(id, prefiller, how).into())
                    }
                    Some(KvOutcome::Failed { rank, reason }) => {
                        // A prefiller that cannot reach the decoder reports KvFailed and
                        // answers `kv_receiver_unreachable` at about the same time, in
                        // either order: give its answer a moment to say which it is.
                        // Any other answer leaves the outcome as it was: `KvFailed`.
                        if let Ok(Err(e)) =
                            tokio::time::timeout(KV_OUTCOME_GRACE, prefill.as_mut()).await
                        {
                            if e.code == KV_RECEIVER_UNREACHABLE {
                                return Err(LmcacheFail::ReceiverUnreachable(e.message));
                            }
                        }
                        return Err(kv_failed(id, rank, reason).into());
                    }
                    None => return Err(shutting_down().into()),
                },
            }
        };
        tracing::debug!(target: TL, stage = "proxy.prefill_answered", id = %id);
        let kv = KvOutcomes {
            app: self,
            id,
            ranks: dc.ranks(),
            wait,
            ready,
            since: Instant::now(),
            // Counted from the end of the prefill, in both orders.
            deadline: tokio::time::Instant::now() + self.cfg.kv_ready_timeout,
        };
        if ready {
            // Every rank reported before the prefill answered.
            self.metrics.kv_wait.observe(kv.since.elapsed());
        }
        Ok((answer, kv))
    }

    /// The decode on `dslot`'s decoder, sent now, while the KV's tail may still be landing;
    /// its answer is passed on only once every rank reported `KvReady`, or, streamed with a
    /// first token in hand, that token goes out as soon as they did.
    async fn lmcache_decode(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        dslot: Slot,
        dbody: Bytes,
        first_sse: Option<Bytes>,
        mut kv: KvOutcomes<'_>,
    ) -> Result<Decoded, ApiError> {
        // The KV sits on this decoder: no other one can take the request over. A task of its
        // own, so that the answer can start before the decoder's does (below); dropped, it
        // is aborted, which closes the decoder connection as dropping the call did.
        let mut decode = {
            let (app, owned) = (self.clone(), ctx.to_owned());
            AbortOnDrop(tokio::spawn(async move {
                app.decode(&owned.ctx(), dbody, dslot, false).await
            }))
        };
        // Decode before `KvReady`: the request goes out now, while the KV's tail is still
        // landing (the decoder waits for its KV with its own deadline, and fails at once
        // when the transfer ends early). Its answer is passed on only once every rank
        // reported `KvReady`, so the client sees exactly what it saw before: a `KvFailed`
        // still becomes `kv_transfer_failed` (the decode is dropped, which closes its
        // connection), a missing outcome `kv_ready_timeout`.
        let mut reply = None;
        while reply.is_none() || !kv.ready {
            if kv.ready && self.cfg.first_token_on_kv_ready {
                if let Some(first) = first_sse.clone() {
                    // Every rank confirmed the KV and the first token is in hand: the
                    // client gets it now, not after the decoder's first step over that KV
                    // (its digest of the last chunk in the reference engine, a forward
                    // pass on a real one). The decoder's stream follows; its failure from
                    // here on is an SSE `error` event, as any failure mid-stream.
                    tracing::debug!(target: TL, stage = "proxy.first_token_sent", id = %kv.id);
                    return Ok(Decoded::FirstTokenSent(Reply::Pending {
                        first,
                        decode: Box::pin(async move { decode_result((&mut decode.0).await) }),
                    }));
                }
            }
            tokio::select! {
                r = &mut decode.0, if reply.is_none() => match decode_result(r) {
                    Ok(r) => reply = Some(r),
                    Err(e) if kv.ready => return Err(e),
                    Err(e) => {
                        // The decoder failing because its KV did (it learns of it from the
                        // PD layer at about the time the proxy does) is the KV's failure:
                        // give the outcome a moment to say so.
                        let grace = (tokio::time::Instant::now() + KV_OUTCOME_GRACE).min(kv.deadline);
                        return match tokio::time::timeout_at(grace, kv.wait.outcome()).await {
                            Ok(Some(KvOutcome::Failed { rank, reason })) => Err(kv_failed(kv.id, rank, reason)),
                            _ => Err(e),
                        };
                    }
                },
                r = kv.outcome(), if !kv.ready => {
                    r?;
                    kv.ready = true;
                }
            }
        }
        drop(kv);
        reply.map(Decoded::Answered).ok_or_else(shutting_down)
    }

    /// The error of a request whose prefiller was lost while its KV waited there.
    fn prefiller_lost(&self, id: &str, prefiller: usize, how: Loss) -> ApiError {
        let label = self
            .prefill
            .workers
            .get(prefiller)
            .map_or("?", |w| w.label.as_str());
        let how = match how {
            Loss::Ejected => "it was ejected",
            Loss::OutcomeConnClosed => "its outcome connection closed",
        };
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "prefiller_lost",
            Outcome::PrefillerLost,
            format!(
                "KV of request {id}: prefiller {label} was lost ({how}) before every rank reported"
            ),
        )
    }
}

/// What the decode of one attempt came to.
enum Decoded {
    /// The streamed first token went out ahead of the decoder's stream, which follows.
    FirstTokenSent(Reply),
    /// The decoder's answer, the KV confirmed.
    Answered(Reply),
}

/// The KV outcomes of one attempt still awaited once its prefill answered.
struct KvOutcomes<'a> {
    app: &'a App,
    /// The attempt's KV request id.
    id: &'a str,
    /// The decoder's ranks, each of which reports an outcome.
    ranks: u32,
    wait: KvWait,
    /// Every rank reported `KvReady`.
    ready: bool,
    /// When the prefill answered: the KV's wait is measured from there.
    since: Instant,
    /// When a rank's outcome missing is `kv_ready_timeout`.
    deadline: tokio::time::Instant,
}

impl KvOutcomes<'_> {
    /// Waits for the rest of the ranks' outcomes, up to the deadline.
    async fn outcome(&mut self) -> Result<(), ApiError> {
        let id = self.id;
        match tokio::time::timeout_at(self.deadline, self.wait.outcome()).await {
            Ok(Some(KvOutcome::Ready)) => {
                tracing::debug!(target: TL, stage = "proxy.kv_ready", id = %id);
                self.app.metrics.kv_wait.observe(self.since.elapsed());
                Ok(())
            }
            Ok(Some(KvOutcome::Failed { rank, reason })) => Err(kv_failed(id, rank, reason)),
            Ok(Some(KvOutcome::PrefillerLost { prefiller, how })) => {
                Err(self.app.prefiller_lost(id, prefiller, how))
            }
            Ok(None) => Err(shutting_down()),
            Err(_) => Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "kv_ready_timeout",
                Outcome::KvTimeout,
                format!(
                    "KV of request {id} was not ready on all {} ranks within {:?}",
                    self.ranks, self.app.cfg.kv_ready_timeout
                ),
            )),
        }
    }

    /// Waits for every rank's `KvReady`, unless they all reported already.
    async fn confirm(&mut self) -> Result<(), ApiError> {
        if !self.ready {
            self.outcome().await?;
            self.ready = true;
        }
        Ok(())
    }
}

/// What the decode continues from: the prefill's first token and its whole answer.
/// Completions with a text prompt continue from it, so their decode needs the prefill's
/// answer; a chat does only to send that token early, so with `first_token_on_kv_ready` off
/// it goes to the decoder as it came. An answer without a text first token: the decoder
/// makes the whole answer.
fn decode_prefix(
    app: &App,
    ctx: &Ctx<'_>,
    doc: &ReqDoc<'_>,
    answer: &[u8],
) -> Result<Option<(String, Value)>, ApiError> {
    if ctx.api == Api::Chat && app.cfg.first_token_on_kv_ready && chat_continues(doc) {
        let first = serde_json::from_slice::<Value>(answer).ok().and_then(|pv| {
            let f = pv
                .pointer("/choices/0/message/content")?
                .as_str()?
                .to_string();
            Some((f, pv))
        });
        return Ok(first.filter(|(f, _)| !f.is_empty()));
    }
    if ctx.api == Api::Completions && doc.prompt_text().is_some() {
        let pv: Value = serde_json::from_slice(answer).map_err(ApiError::prefill_invalid_json)?;
        let first = pv.pointer("/choices/0/text").and_then(Value::as_str);
        return Ok(first.map(str::to_string).zip(Some(pv)));
    }
    Ok(None)
}

/// The decoder's answer with the prefill's first token ahead of it: prepended to a full
/// answer, or sent before a stream (`first_sse`).
fn with_first_token(
    reply: Reply,
    prefix: Option<(String, Value)>,
    first_sse: Option<Bytes>,
) -> Reply {
    match (reply, prefix) {
        (Reply::Full { content_type, body }, Some((first, _))) => Reply::Full {
            content_type,
            body: prepend_first(body, &first),
        },
        (
            Reply::Stream {
                content_type,
                body,
                slot,
                decode_start,
                ..
            },
            _,
        ) => Reply::Stream {
            content_type,
            body,
            prefix: first_sse,
            slot,
            decode_start,
            merge: None,
        },
        (r, _) => r,
    }
}

/// The decode task's result; a task that ended without one (aborted or panicked) is an
/// internal error.
fn decode_result(
    r: Result<Result<Reply, ApiError>, tokio::task::JoinError>,
) -> Result<Reply, ApiError> {
    r.unwrap_or_else(|e| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            Outcome::DecodeError,
            format!("the decode task ended: {e}"),
        ))
    })
}

/// The error of a KV transfer that failed on `rank`.
fn kv_failed(id: &str, rank: u32, reason: String) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "kv_transfer_failed",
        Outcome::KvFailed,
        format!("KV transfer of request {id} failed on rank {rank}: {reason}"),
    )
}

/// The error of a request whose KV waiter went away: the proxy is stopping.
fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutting_down",
        Outcome::KvTimeout,
        "the proxy is shutting down",
    )
}
