//! Request bodies: parsed once into their top-level fields, whose values stay the client's
//! raw bytes, then checked and rewritten by splicing. Only the fields the proxy must change
//! (`max_tokens`, `stream`, `kv_transfer_params`, …) are written anew; everything else is
//! copied through byte for byte, with no tree of `Value`s built or serialised per request.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Completions,
    Chat,
    /// SGLang's native `/generate` (sglang flow only).
    Generate,
}

impl Api {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Generate => "/generate",
        }
    }

    pub(crate) fn from_path(path: &str) -> Option<Api> {
        match path {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::Chat),
            "/generate" => Some(Api::Generate),
            _ => None,
        }
    }
}

/// A top-level key: borrowed from the body unless it had escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The top-level fields of a JSON object, in order, values raw.
struct Fields<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Fields<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Fields<'de>, A::Error> {
                let mut v = Vec::with_capacity(m.size_hint().unwrap_or(8).min(64));
                while let Some(Key(k)) = m.next_key::<Key<'de>>()? {
                    let val: &'de RawValue = m.next_value()?;
                    v.push((k, val));
                }
                Ok(Fields(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Why a request body was refused (the message of a 400).
pub(crate) type BadRequest = String;

/// A checked request body.
pub(crate) struct ReqDoc<'a> {
    fields: Vec<(Cow<'a, str>, &'a RawValue)>,
    /// `"stream": true`.
    pub stream: bool,
    /// The tightest of `max_tokens` and `max_completion_tokens`, when the client gave any.
    pub max_tokens: Option<u64>,
}

impl<'a> ReqDoc<'a> {
    /// Parses and checks `body` as a request to `api`, the way the server does.
    pub(crate) fn parse(api: Api, body: &'a [u8]) -> Result<ReqDoc<'a>, BadRequest> {
        let Fields(mut fields) = serde_json::from_slice::<Fields<'a>>(body)
            .map_err(|e| format!("the request body is not a JSON object: {e}"))?;
        dedup_last_wins(&mut fields);
        let mut doc = ReqDoc {
            fields,
            stream: false,
            max_tokens: None,
        };
        doc.stream = match doc.raw("stream") {
            None | Some("null") => false,
            Some("true") => true,
            Some("false") => false,
            Some(_) => return Err("`stream` must be a boolean".into()),
        };
        doc.max_tokens = match (
            doc.positive("max_tokens")?,
            doc.positive("max_completion_tokens")?,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match api {
            Api::Completions if doc.get("prompt").is_none() => {
                return Err("`prompt` is required".into())
            }
            Api::Chat if !doc.raw("messages").is_some_and(nonempty_array) => {
                return Err("`messages` must be a non-empty array".into())
            }
            Api::Generate
                if ["text", "input_ids", "input_embeds"]
                    .iter()
                    .all(|k| matches!(doc.raw(k), None | Some("null"))) =>
            {
                return Err("one of `text`, `input_ids` or `input_embeds` is required".into())
            }
            _ => {}
        }
        Ok(doc)
    }

    /// The raw value of a top-level field.
    pub(crate) fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The prompt as sent: a chat's `messages`, else a completion's `prompt`, else
    /// `/generate`'s `text` or `input_ids` (raw JSON).
    pub(crate) fn prompt_raw(&self) -> Option<&'a str> {
        self.raw("messages")
            .or_else(|| self.raw("prompt"))
            .or_else(|| self.raw("text"))
            .or_else(|| self.raw("input_ids"))
    }

    /// The raw text of a top-level field.
    pub(crate) fn raw(&self, key: &str) -> Option<&'a str> {
        self.get(key).map(RawValue::get)
    }

    /// Whether a top-level field is present (even as `null`).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The `prompt`, when it is a single string.
    pub(crate) fn prompt_text(&self) -> Option<String> {
        let raw = self.raw("prompt")?;
        if !raw.starts_with('"') {
            return None;
        }
        serde_json::from_str::<String>(raw).ok()
    }

    /// A positive integer field, when present and valid (checked by [`ReqDoc::parse`]).
    pub(crate) fn int(&self, key: &str) -> Option<u64> {
        self.positive(key).ok().flatten()
    }

    /// Reads an optional positive integer field (`null` counts as absent).
    fn positive(&self, key: &str) -> Result<Option<u64>, BadRequest> {
        match self.raw(key) {
            None | Some("null") => Ok(None),
            Some(s) => match s.parse::<u64>() {
                Ok(0) => Err(format!("`{key}` must be at least 1")),
                Ok(n) => Ok(Some(n)),
                Err(_) => Err(format!("`{key}` must be a positive integer")),
            },
        }
    }

    /// The body with the top-level fields in `set` replaced (`Some(raw JSON)`) or removed
    /// (`None`); fields not yet present are appended. Keys in `set` must need no escaping.
    pub(crate) fn with(&self, set: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        let extra: usize = set
            .iter()
            .map(|(k, v)| k.len() + v.map_or(0, <[u8]>::len) + 4)
            .sum();
        let size: usize = self
            .fields
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum();
        let mut out = Vec::with_capacity(size + extra + 2);
        out.push(b'{');
        for (k, v) in &self.fields {
            if set.iter().any(|(s, _)| *s == k) {
                continue;
            }
            if out.len() > 1 {
                out.push(b',');
            }
            match k {
                // Borrowed: the key had no escapes, so its text is valid inside quotes.
                Cow::Borrowed(k) => {
                    out.push(b'"');
                    out.extend_from_slice(k.as_bytes());
                    out.push(b'"');
                }
                Cow::Owned(k) => {
                    let _ = serde_json::to_writer(&mut out, k);
                }
            }
            out.push(b':');
            out.extend_from_slice(v.get().as_bytes());
        }
        for (k, v) in set {
            let Some(v) = v else { continue };
            if out.len() > 1 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(v);
        }
        out.push(b'}');
        out
    }
}

/// Keeps the last of repeated keys (as a JSON map would), in first-seen order otherwise.
fn dedup_last_wins(fields: &mut Vec<(Cow<'_, str>, &RawValue)>) {
    let n = fields.len();
    if n < 2 {
        return;
    }
    let mut keep = vec![true; n];
    let mut any = false;
    if n <= 16 {
        for i in 0..n {
            if fields[i + 1..].iter().any(|(k, _)| *k == fields[i].0) {
                keep[i] = false;
                any = true;
            }
        }
    } else {
        let mut seen = std::collections::HashSet::with_capacity(n);
        for i in (0..n).rev() {
            if !seen.insert(fields[i].0.clone()) {
                keep[i] = false;
                any = true;
            }
        }
    }
    if any {
        let mut it = keep.into_iter();
        fields.retain(|_| it.next().unwrap_or(true));
    }
}

fn nonempty_array(raw: &str) -> bool {
    raw.strip_prefix('[')
        .is_some_and(|r| !r.trim_start().starts_with(']'))
}

/// The few fields of a prefiller's answer the proxy reads.
#[derive(Deserialize)]
pub(crate) struct PrefillAnswer<'a> {
    #[serde(borrow)]
    pub kv_transfer_params: Option<&'a RawValue>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn v(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn splices_only_the_fields_it_sets() {
        let body = br#"{"model":"m","prompt":"a \"q\"","max_tokens":7,"stream":true,"x\u0041":{"k":[1,2]}}"#;
        let d = ReqDoc::parse(Api::Completions, body).unwrap();
        assert!(d.stream);
        assert_eq!(d.max_tokens, Some(7));
        assert_eq!(d.prompt_text().as_deref(), Some("a \"q\""));
        let out = d.with(&[
            ("max_tokens", Some(b"1")),
            ("stream", Some(b"false")),
            ("stream_options", None),
            ("kv_transfer_params", Some(br#"{"a":null}"#)),
        ]);
        assert_eq!(
            v(&out),
            json!({"model": "m", "prompt": "a \"q\"", "max_tokens": 1, "stream": false,
                "xA": {"k": [1, 2]}, "kv_transfer_params": {"a": null}})
        );
        assert_eq!(v(&d.with(&[])), v(body));
    }

    #[test]
    fn repeated_keys_keep_the_last() {
        let d = ReqDoc::parse(
            Api::Completions,
            br#"{"prompt":"a","stream":"x","stream":false}"#,
        )
        .unwrap();
        assert!(!d.stream);
        assert_eq!(v(&d.with(&[])), json!({"prompt": "a", "stream": false}));
        let many: String = (0..40).map(|i| format!("\"k{}\":{i},", i % 20)).collect();
        let body = format!("{{{many}\"prompt\":1}}");
        let d = ReqDoc::parse(Api::Completions, body.as_bytes()).unwrap();
        let out = v(&d.with(&[]));
        assert_eq!(out.as_object().unwrap().len(), 21);
        assert_eq!(out["k3"], 23);
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        for (api, body, want) in [
            (Api::Completions, &b"nope"[..], "not a JSON object"),
            (Api::Completions, b"[1]", "not a JSON object"),
            (Api::Completions, b"{\"prompt\":1} x", "not a JSON object"),
            (Api::Completions, b"{}", "`prompt` is required"),
            (Api::Completions, br#"{"prompt":"a","stream":1}"#, "boolean"),
            (
                Api::Completions,
                br#"{"prompt":"a","max_tokens":0}"#,
                "at least 1",
            ),
            (
                Api::Completions,
                br#"{"prompt":"a","max_tokens":1.5}"#,
                "positive integer",
            ),
            (
                Api::Completions,
                br#"{"prompt":"a","max_completion_tokens":-1}"#,
                "positive integer",
            ),
            (Api::Chat, br#"{"messages":[ ]}"#, "non-empty array"),
            (Api::Chat, br#"{"messages":{}}"#, "non-empty array"),
            (
                Api::Generate,
                br#"{"sampling_params":{}}"#,
                "`text`, `input_ids`",
            ),
            (Api::Generate, br#"{"text":null}"#, "`text`, `input_ids`"),
        ] {
            let e = ReqDoc::parse(api, body).err().unwrap_or_default();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(body));
        }
        let d = ReqDoc::parse(
            Api::Completions,
            br#"{"prompt":[1,2],"max_tokens":9,"max_completion_tokens":4}"#,
        )
        .unwrap();
        assert_eq!(d.max_tokens, Some(4));
        assert_eq!(d.prompt_text(), None);
        assert!(ReqDoc::parse(Api::Chat, br#"{"messages":[{}]}"#).is_ok());
    }
}
