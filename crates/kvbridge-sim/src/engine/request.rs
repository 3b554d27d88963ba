//! A generation request as the OpenAI API carries it, parsed and checked.

use super::error::SimError;
use crate::model;
use axum::body::Bytes;
use kvbridge_pd::DisaggSpec;
use serde_json::Value;

/// The `kv_transfer_params` key under which the proxy names the PD request holding a decode
/// request's KV (LMCache's own proxy uses the same key).
pub const HANDOFF_KEY: &str = "lmcache.pd_handoff_id";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Completions,
    Chat,
}

/// A parsed generation request.
pub(super) struct GenRequest {
    pub(super) api: Api,
    pub(super) tokens: Vec<u32>,
    pub(super) max_tokens: u32,
    pub(super) stream: bool,
    pub(super) disagg: Option<DisaggSpec>,
    /// Decode: the PD request id the proxy named (`kv_transfer_params` key
    /// `lmcache.pd_handoff_id`), if any.
    pub(super) handoff: Option<String>,
}

pub(super) fn parse_json(body: &Bytes) -> Result<serde_json::Map<String, Value>, SimError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(SimError::BadRequest(
            "the body must be a JSON object".into(),
        )),
        Err(e) => Err(SimError::BadRequest(format!("the body is not JSON: {e}"))),
    }
}

pub(super) fn prompt_tokens(v: Option<&Value>) -> Result<Vec<u32>, SimError> {
    match v {
        Some(Value::String(s)) => Ok(model::tokenize(s)),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(model::tokenize(a[0].as_str().unwrap_or("")))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| SimError::BadRequest("token ids must fit in u32".into()))
            })
            .collect(),
        _ => Err(SimError::BadRequest(
            "`prompt` must be a string, a list of one string, or a list of token ids".into(),
        )),
    }
}

/// A chat's prompt tokens: the template over `messages` (see [`model::chat_prompt`]). With
/// `continue_final` (vLLM's `continue_final_message`), the last message must be the
/// assistant's, and the prompt ends with its content instead of a turn of its own, so the
/// answer continues it: the proxy's way to hand a decoder the prefill's first token.
pub fn chat_tokens(v: Option<&Value>, continue_final: bool) -> Result<Vec<u32>, SimError> {
    let Some(Value::Array(msgs)) = v else {
        return Err(SimError::BadRequest("`messages` must be an array".into()));
    };
    let mut parts = Vec::with_capacity(msgs.len());
    for m in msgs {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| SimError::BadRequest("every message needs a string `role`".into()))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(ps)) => ps
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(" "),
            Some(Value::Null) | None => String::new(),
            Some(_) => {
                return Err(SimError::BadRequest(
                    "message `content` must be a string or a list of text parts".into(),
                ))
            }
        };
        parts.push((role.to_string(), content));
    }
    if !continue_final {
        return Ok(model::tokenize(&model::chat_prompt(&parts)));
    }
    match parts.pop() {
        Some((role, content)) if role == "assistant" => {
            let mut text = model::chat_prompt(&parts);
            text.push_str(&content);
            Ok(model::tokenize(&text))
        }
        _ => Err(SimError::BadRequest(
            "`continue_final_message` needs a last message from the assistant".into(),
        )),
    }
}

pub(super) fn parse(
    api: Api,
    m: &serde_json::Map<String, Value>,
    limit: u32,
) -> Result<GenRequest, SimError> {
    let tokens = match api {
        Api::Completions => prompt_tokens(m.get("prompt"))?,
        Api::Chat => {
            let cont = match m.get("continue_final_message") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(SimError::BadRequest(
                        "`continue_final_message` must be a boolean".into(),
                    ))
                }
            };
            chat_tokens(m.get("messages"), cont)?
        }
    };
    if tokens.is_empty() {
        return Err(SimError::BadRequest("the prompt is empty".into()));
    }
    let mut max_tokens = 16u64;
    let mut seen = false;
    for key in ["max_tokens", "max_completion_tokens"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let n = v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
                    SimError::BadRequest(format!("`{key}` must be a positive integer"))
                })?;
                max_tokens = if seen { max_tokens.min(n) } else { n };
                seen = true;
            }
        }
    }
    if max_tokens > limit as u64 {
        return Err(SimError::BadRequest(format!(
            "`max_tokens` is {max_tokens}, more than this engine's limit of {limit}"
        )));
    }
    let stream = match m.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(SimError::BadRequest("`stream` must be a boolean".into())),
    };
    let disagg = match m
        .get("kv_transfer_params")
        .and_then(|k| k.get("disagg_spec"))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value::<DisaggSpec>(v.clone())
                .map_err(|e| SimError::BadRequest(format!("invalid `disagg_spec`: {e}")))?,
        ),
    };
    let handoff = match m.get("kv_transfer_params").and_then(|k| k.get(HANDOFF_KEY)) {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 256 => Some(id.clone()),
        Some(_) => {
            return Err(SimError::BadRequest(format!(
                "`kv_transfer_params.{HANDOFF_KEY}` must be a non-empty string of at most 256 bytes"
            )))
        }
    };
    Ok(GenRequest {
        api,
        tokens,
        max_tokens: max_tokens as u32,
        stream,
        disagg,
        handoff,
    })
}
