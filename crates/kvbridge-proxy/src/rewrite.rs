//! The bodies the proxy sends on: the client's request rewritten for the prefiller and the
//! decoder of each flow, and the prefill's first token put in front of the decoder's answer.
//! Pure functions of the request, fuzzed through [`crate::fuzzing`].

use axum::http::HeaderValue;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::reply::Reply;
use crate::request::{Api, ReqDoc};

/// The prefill request: the client's body with `max_tokens` (and `max_completion_tokens`)
/// 1, `stream` false, no `stream_options`, and the flow's `kv_transfer_params`.
pub(crate) fn prefill_body(doc: &ReqDoc<'_>, kv: &[u8]) -> Vec<u8> {
    let mct: Option<&[u8]> = doc.has("max_completion_tokens").then_some(b"1");
    doc.with(&[
        ("max_tokens", Some(b"1")),
        ("max_completion_tokens", mct),
        ("stream", Some(b"false")),
        ("stream_options", None),
        ("kv_transfer_params", Some(kv)),
    ])
}

/// `kv_transfer_params` of the vLLM flow's prefill request.
pub(crate) const VLLM_PREFILL_KV: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The vLLM flow's decode request: the client's body with the prefill answer's
/// `kv_transfer_params` (removed when the answer had none).
pub(crate) fn vllm_decode_body(doc: &ReqDoc<'_>, kv: Option<&[u8]>) -> Vec<u8> {
    doc.with(&[("kv_transfer_params", kv)])
}

/// The LMCache flow's decode request. `first`: the prefill's first token, which the decode
/// then continues from with one token less to make: a completion with a text prompt gets it
/// appended to its prompt; a chat ([`chat_continues`]) gets it as a last assistant message
/// with `continue_final_message: true` and `add_generation_prompt: false` (vLLM's and
/// SGLang's way to continue a reply). The PD request id goes along as
/// `kv_transfer_params: {"lmcache.pd_handoff_id": id}` (the key LMCache's own proxy uses),
/// so a decoder can find the KV by id.
pub(crate) fn lmcache_decode_body(
    doc: &ReqDoc<'_>,
    api: Api,
    first: Option<&str>,
    pd_id: &str,
) -> Vec<u8> {
    let kv = serde_json::to_vec(&json!({ "lmcache.pd_handoff_id": pd_id })).unwrap_or_default();
    let Some(first) = first else {
        return doc.with(&[("kv_transfer_params", Some(&kv))]);
    };
    let prompt = match api {
        Api::Completions => doc.prompt_text().map(|mut p| {
            p.push_str(first);
            serde_json::to_vec(&p).unwrap_or_default()
        }),
        Api::Chat | Api::Generate => None,
    };
    let messages = match api {
        Api::Chat => chat_messages(doc).map(|mut m| {
            m.push(json!({"role": "assistant", "content": first}));
            serde_json::to_vec(&m).unwrap_or_default()
        }),
        Api::Completions | Api::Generate => None,
    };
    // Both limits are at least 2 here: one token is already made.
    let less = |key: &str| {
        doc.int(key)
            .map(|m| m.saturating_sub(1).max(1).to_string().into_bytes())
    };
    let (mt, mct) = (less("max_tokens"), less("max_completion_tokens"));
    let mut set: Vec<(&str, Option<&[u8]>)> = vec![("kv_transfer_params", Some(&kv))];
    if let Some(p) = &prompt {
        set.push(("prompt", Some(p)));
    }
    if let Some(m) = &messages {
        set.push(("messages", Some(m)));
        set.push(("continue_final_message", Some(b"true")));
        set.push(("add_generation_prompt", Some(b"false")));
    }
    if let Some(m) = &mt {
        set.push(("max_tokens", Some(m)));
    }
    if let Some(m) = &mct {
        set.push(("max_completion_tokens", Some(m)));
    }
    doc.with(&set)
}

/// A chat's `messages`, when they are an array.
fn chat_messages(doc: &ReqDoc<'_>) -> Option<Vec<Value>> {
    serde_json::from_str(doc.get("messages")?.get()).ok()
}

/// Whether a chat's decode can continue from the prefill's first token: its messages parse,
/// it asks for more than one token, and it does not continue a reply of its own already
/// (`continue_final_message`, or no `add_generation_prompt`).
pub(crate) fn chat_continues(doc: &ReqDoc<'_>) -> bool {
    let flag = |key: &str| doc.get(key).map(|v| v.get().trim());
    chat_messages(doc).is_some()
        && doc.max_tokens != Some(1)
        && matches!(
            flag("continue_final_message"),
            None | Some("false") | Some("null")
        )
        && matches!(
            flag("add_generation_prompt"),
            None | Some("true") | Some("null")
        )
}

/// The SSE chunk that carries the prefill's first token.
pub(crate) fn first_chunk(pv: &Value, first: &str, finish: Option<&str>) -> Bytes {
    let v = json!({"id": pv.get("id"), "object": "text_completion", "created": pv.get("created"),
        "model": pv.get("model"), "choices": [{"index": 0, "text": first, "logprobs": null, "finish_reason": finish}]});
    Bytes::from(format!("data: {v}\n\n"))
}

/// The chat SSE chunk that carries the prefill's first token (with the reply's role).
pub(crate) fn first_chat_chunk(pv: &Value, first: &str) -> Bytes {
    let v = json!({"id": pv.get("id"), "object": "chat.completion.chunk", "created": pv.get("created"),
        "model": pv.get("model"), "choices": [{"index": 0, "delta": {"role": "assistant", "content": first},
        "logprobs": null, "finish_reason": null}]});
    Bytes::from(format!("data: {v}\n\n"))
}

/// `max_tokens == 1`: the prefill's answer is the whole answer.
pub(crate) fn answer_from_prefill(mut pv: Value, first: &str, stream: bool) -> Reply {
    if stream {
        let mut b = first_chunk(&pv, first, Some("length")).to_vec();
        b.extend_from_slice(b"data: [DONE]\n\n");
        return Reply::Full {
            content_type: HeaderValue::from_static("text/event-stream"),
            body: Bytes::from(b),
        };
    }
    if let Some(m) = pv.as_object_mut() {
        m.remove("kv_transfer_params");
    }
    Reply::Full {
        content_type: HeaderValue::from_static("application/json"),
        body: Bytes::from(pv.to_string()),
    }
}

/// Puts the prefill's first token in front of a non-streamed completion or chat reply.
pub(crate) fn prepend_first(body: Bytes, first: &str) -> Bytes {
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    for at in ["/choices/0/text", "/choices/0/message/content"] {
        if let Some(t) = v.pointer_mut(at) {
            if let Some(s) = t.as_str() {
                *t = Value::String(format!("{first}{s}"));
            }
        }
    }
    if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
        if let Some(c) = u.get("completion_tokens").and_then(Value::as_u64) {
            u.insert("completion_tokens".into(), json!(c + 1));
        }
        if let Some(p) = u.get("prompt_tokens").and_then(Value::as_u64) {
            u.insert("prompt_tokens".into(), json!(p.saturating_sub(1)));
        }
    }
    Bytes::from(v.to_string())
}
