//! The vLLM (NIXL) flow: prefill, then the decode request carrying the prefill answer's
//! `kv_transfer_params`, from which the decoder pulls the KV.

use bytes::Bytes;

use crate::pool::Slot;
use crate::reply::{ApiError, Reply};
use crate::request::{PrefillAnswer, ReqDoc};
use crate::rewrite::{prefill_body, vllm_decode_body, VLLM_PREFILL_KV};
use crate::server::app::App;
use crate::server::ctx::Ctx;

impl App {
    /// vLLM NIXL flow: the prefill answer's `kv_transfer_params` go into the decode request.
    pub(crate) async fn vllm(
        &self,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        dslot: Slot,
    ) -> Result<Reply, ApiError> {
        let pbody = Bytes::from(prefill_body(doc, VLLM_PREFILL_KV));
        let answer = self.prefill(ctx, pbody, None).await?;
        let kv = serde_json::from_slice::<PrefillAnswer>(&answer)
            .map_err(ApiError::prefill_invalid_json)?;
        let kv = kv.kv_transfer_params.map(|r| r.get().as_bytes());
        let dbody = Bytes::from(vllm_decode_body(doc, kv));
        // The KV waits on the prefiller until a decoder reads it: any decoder will do, so a
        // refused connection is retried on another one.
        self.decode(ctx, dbody, dslot, true).await
    }
}
