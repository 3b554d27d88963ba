//! The sglang flow's request body: the client's, with the three fields by which SGLang's PD
//! servers pair a prefill with its decode (`bootstrap_host` and `bootstrap_port`: where the
//! decode finds the prefill's bootstrap server; `bootstrap_room`: a random 63-bit id the two
//! meet under), one of each per prompt of a batch, as SGLang's router adds them. Pure
//! functions of the request, fuzzed through [`crate::fuzzing`].

use serde_json::value::RawValue;

use crate::request::{Api, BadRequest, ReqDoc};

/// Most prompts in one request: each gets its own room, and the body's size alone does not
/// bound a chat's `n`.
pub(crate) const MAX_BATCH: usize = 4096;

/// How many prompts the request carries, by SGLang's router's rules: `None` for one (the
/// bootstrap fields are scalars), `Some(n)` for a batch (arrays of `n`). A chat asks for
/// `n > 1` choices; a completion's `prompt` is an array of strings or of token-id arrays
/// (an array of token ids is one prompt); `/generate`'s `text` is an array, or its
/// `input_ids` an array of arrays.
pub(crate) fn batch_size(api: Api, doc: &ReqDoc<'_>) -> Result<Option<usize>, BadRequest> {
    let n = match api {
        Api::Chat => match doc.raw("n") {
            None | Some("null") => None,
            Some(raw) => match raw.parse::<u64>() {
                Ok(0) | Err(_) => return Err("`n` must be a positive integer".into()),
                Ok(1) => None,
                Ok(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            },
        },
        Api::Completions => items(doc, "prompt", |first| {
            first.starts_with('"') || first.starts_with('[')
        })?,
        Api::Generate => match items(doc, "text", |_| true)? {
            Some(n) => Some(n),
            None => items(doc, "input_ids", |first| first.starts_with('['))?,
        },
    };
    match n {
        Some(n) if n > MAX_BATCH => Err(format!(
            "the request carries {n} prompts or choices; this proxy takes at most {MAX_BATCH} in one request"
        )),
        n => Ok(n),
    }
}

/// The length of field `key` when it is an array whose first item `batched` calls a prompt
/// of its own; an empty array is refused.
fn items(
    doc: &ReqDoc<'_>,
    key: &str,
    batched: impl Fn(&str) -> bool,
) -> Result<Option<usize>, BadRequest> {
    let Some(raw) = doc.raw(key).filter(|r| r.starts_with('[')) else {
        return Ok(None);
    };
    let v = serde_json::from_str::<Vec<&RawValue>>(raw)
        .map_err(|e| format!("`{key}` is not a valid array: {e}"))?;
    match v.first() {
        None => Err(format!("`{key}` is an empty array")),
        Some(first) if batched(first.get().trim_start()) => Ok(Some(v.len())),
        Some(_) => Ok(None),
    }
}

/// A fresh room: 63 random bits (SGLang's router draws from 0 to 2^63 - 1, as the servers
/// keep it in a signed 64-bit integer).
pub(crate) fn room() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // Not seen on Linux past early boot; `RandomState` is keyed from the same source.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x5e_61_a9);
        b = h.finish().to_le_bytes();
    }
    u64::from_le_bytes(b) & (i64::MAX as u64)
}

/// `count` rooms, no two alike.
pub(crate) fn rooms(count: usize) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::with_capacity(count);
    while out.len() < count {
        let r = room();
        if !out.contains(&r) {
            out.push(r);
        }
    }
    out
}

/// The body sent to both servers: the client's with `bootstrap_host`, `bootstrap_port`
/// (`null` when the prefiller has none configured) and `bootstrap_room` set, scalars for one
/// prompt (`rooms` of one), arrays of `rooms.len()` for a batch (`batch`). Any such field
/// the client sent is replaced.
pub(crate) fn with_bootstrap(
    doc: &ReqDoc<'_>,
    batch: bool,
    host: &str,
    port: Option<u16>,
    rooms: &[u64],
) -> Vec<u8> {
    let host = serde_json::to_string(host).unwrap_or_else(|_| "null".into());
    let port = port.map_or_else(|| "null".to_string(), |p| p.to_string());
    let (h, p, r) = if batch {
        let list = |one: &str| {
            let mut s = String::with_capacity(2 + rooms.len() * (one.len() + 1));
            s.push('[');
            for i in 0..rooms.len() {
                if i > 0 {
                    s.push(',');
                }
                s.push_str(one);
            }
            s.push(']');
            s
        };
        let r: Vec<String> = rooms.iter().map(u64::to_string).collect();
        (list(&host), list(&port), format!("[{}]", r.join(",")))
    } else {
        let r = rooms.first().copied().unwrap_or_default().to_string();
        (host, port, r)
    };
    doc.with(&[
        ("bootstrap_host", Some(h.as_bytes())),
        ("bootstrap_port", Some(p.as_bytes())),
        ("bootstrap_room", Some(r.as_bytes())),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn size(api: Api, body: &str) -> Result<Option<usize>, BadRequest> {
        batch_size(api, &ReqDoc::parse(api, body.as_bytes()).unwrap())
    }

    #[test]
    fn batch_sizes_as_sglang_router_counts_them() {
        use Api::*;
        assert_eq!(size(Completions, r#"{"prompt":"a"}"#), Ok(None));
        assert_eq!(size(Completions, r#"{"prompt":[1,2,3]}"#), Ok(None));
        assert_eq!(size(Completions, r#"{"prompt":["a","b"]}"#), Ok(Some(2)));
        assert_eq!(
            size(Completions, r#"{"prompt":[[1],[2],[3]]}"#),
            Ok(Some(3))
        );
        assert_eq!(size(Chat, r#"{"messages":[{}],"n":1}"#), Ok(None));
        assert_eq!(size(Chat, r#"{"messages":[{}],"n":3}"#), Ok(Some(3)));
        assert_eq!(size(Generate, r#"{"text":"a"}"#), Ok(None));
        assert_eq!(size(Generate, r#"{"text":["a","b"]}"#), Ok(Some(2)));
        assert_eq!(size(Generate, r#"{"input_ids":[1,2]}"#), Ok(None));
        assert_eq!(size(Generate, r#"{"input_ids":[[1],[2]]}"#), Ok(Some(2)));
        for (api, body, want) in [
            (Completions, r#"{"prompt":[]}"#, "empty array"),
            (Generate, r#"{"text":[ ]}"#, "empty array"),
            (Chat, r#"{"messages":[{}],"n":0}"#, "positive integer"),
            (Chat, r#"{"messages":[{}],"n":"2"}"#, "positive integer"),
            (Chat, r#"{"messages":[{}],"n":99999999999}"#, "at most 4096"),
        ] {
            let e = size(api, body).unwrap_err();
            assert!(e.contains(want), "{body}: {e}");
        }
    }

    #[test]
    fn bootstrap_fields_replace_the_clients_and_keep_the_rest() {
        let body = br#"{"prompt":"a","bootstrap_room":7,"x":{"y":[1]}}"#;
        let d = ReqDoc::parse(Api::Completions, body).unwrap();
        let v: Value =
            serde_json::from_slice(&with_bootstrap(&d, false, "10.0.0.1", Some(8998), &[42]))
                .unwrap();
        assert_eq!(
            v,
            json!({"prompt": "a", "x": {"y": [1]}, "bootstrap_host": "10.0.0.1",
                "bootstrap_port": 8998, "bootstrap_room": 42})
        );
        let v: Value =
            serde_json::from_slice(&with_bootstrap(&d, true, "h\"", None, &[1, 2])).unwrap();
        assert_eq!(v["bootstrap_host"], json!(["h\"", "h\""]));
        assert_eq!(v["bootstrap_port"], json!([null, null]));
        assert_eq!(v["bootstrap_room"], json!([1, 2]));
    }

    #[test]
    fn rooms_are_63_bit_and_distinct() {
        let r = rooms(1000);
        assert!(r.iter().all(|x| *x <= i64::MAX as u64));
        let mut s = r.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 1000);
        assert!(r.iter().any(|x| *x > 1 << 56), "drawn from the whole range");
    }
}
