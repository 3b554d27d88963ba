//! Target `proxy_request`: arbitrary bodies for the disaggregation proxy's OpenAI routes,
//! through `kvbridge_proxy::fuzzing::parse_request` — the server's own parsing and field
//! checks, and the bodies both flows (vLLM, LMCache) would send on — without HTTP, so it
//! runs at in-process speed. `proxy_http` covers the same inputs end to end.
//!
//! Input: byte 0 picks the route (bits 0-1: completions, chat, two paths without a route)
//! and whether an `x-request-id` follows (bit 2, then byte 1 is its length: skipped here, so
//! `proxy_http`'s seeds mean the same body); the rest is the body. Checked: nothing panics; a
//! route refuses exactly the bodies the documented rules (`docs/proxy.md`) refuse, with a
//! message; another path is refused; an accepted body gives the `stream` and `max_tokens`
//! the client asked for, and four JSON objects to send on.

use serde_json::{Map, Value};

/// The documented field rules for a body on a route (`chat`: `/v1/chat/completions`):
/// `Err` with the first rule broken. The body limit is the HTTP layer's and not here.
pub fn model(chat: bool, body: &[u8]) -> Result<Map<String, Value>, &'static str> {
    let Ok(req) = serde_json::from_slice::<Map<String, Value>>(body) else {
        return Err("not a JSON object");
    };
    if !matches!(req.get("stream"), None | Some(Value::Null | Value::Bool(_))) {
        return Err("stream is not a boolean");
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        match req.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {}
            Some(_) => return Err("max_tokens is not a positive integer"),
        }
    }
    if chat {
        if !matches!(req.get("messages"), Some(Value::Array(m)) if !m.is_empty()) {
            return Err("no messages");
        }
    } else if !req.contains_key("prompt") {
        return Err("no prompt");
    }
    Ok(req)
}

/// Splits an input into (path, route, body); `route` is `Some(chat)` for the two routes.
pub fn split(data: &[u8]) -> Option<(&'static str, Option<bool>, &[u8])> {
    let (&sel, rest) = data.split_first()?;
    let body = if sel & 4 != 0 {
        let (&n, rest) = rest.split_first()?;
        &rest[usize::from(n).min(rest.len())..]
    } else {
        rest
    };
    let (path, route) = match sel & 3 {
        0 => ("/v1/completions", Some(false)),
        1 => ("/v1/chat/completions", Some(true)),
        2 => ("/v1/embeddings", None),
        _ => ("/v1/completions/extra", None),
    };
    Some((path, route, body))
}

fn object(what: &str, b: &[u8]) -> Map<String, Value> {
    match serde_json::from_slice(b) {
        Ok(Value::Object(m)) => m,
        other => panic!(
            "{what} is not a JSON object ({other:?}): {}",
            String::from_utf8_lossy(b)
        ),
    }
}

/// Whether `body` is valid JSON that the model's `Value` cannot hold (a number beyond f64,
/// such as `1e999999`; found by this target). The proxy forwards such fields verbatim, as
/// JSON allows; for these bodies the targets check only that nothing panics.
pub fn beyond_the_model(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_err()
        && serde_json::from_slice::<Box<serde_json::value::RawValue>>(body).is_ok()
}

/// The target's body.
pub fn run(data: &[u8]) {
    let Some((path, route, body)) = split(data) else {
        return;
    };
    let got = kvbridge_proxy::fuzzing::parse_request(path, body);
    let Some(chat) = route else {
        assert!(got.is_err(), "{path} has no route but a body was accepted");
        return;
    };
    if beyond_the_model(body) {
        return;
    }
    let shown = || String::from_utf8_lossy(body).into_owned();
    match (model(chat, body), got) {
        (Err(rule), Ok(_)) => panic!(
            "{path} accepted a body that breaks a rule ({rule}): {:?}",
            shown()
        ),
        (Ok(_), Err(e)) => panic!("{path} refused a valid body ({e}): {:?}", shown()),
        (Err(_), Err(e)) => assert!(!e.is_empty(), "a refusal without a message"),
        (Ok(req), Ok(p)) => {
            assert_eq!(p.stream, req.get("stream") == Some(&Value::Bool(true)));
            let asked = ["max_tokens", "max_completion_tokens"]
                .iter()
                .filter_map(|k| req.get(*k).and_then(Value::as_u64))
                .min();
            assert_eq!(p.max_tokens, asked, "max_tokens of {:?}", shown());
            object("the vLLM prefill body", &p.vllm[0]);
            object("the vLLM decode body", &p.vllm[1]);
            object("the LMCache prefill body", &p.lmcache[0]);
            object("the LMCache decode body", &p.lmcache[1]);
        }
    }
}
