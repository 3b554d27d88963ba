//! The `/tokenize` client: the token ids of a text prompt or of chat messages, as a vLLM
//! worker of the pool computes them (`POST /tokenize`), for `--routing kv-events` to match
//! against the blocks the workers report (their events carry token ids; the proxy has no
//! tokenizer of its own).
//!
//! The body sent mirrors the request's fields that change the tokens the server computes
//! (`request_body`): a completion's `prompt` and `add_special_tokens`; a chat's
//! `messages`, `add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
//! `chat_template`, `chat_template_kwargs`, `tools` and `mm_processor_kwargs`, each copied as
//! the client sent it, so the server applies the same defaults to both requests.
//!
//! A worker's reply is not trusted: it is read under a deadline and a size limit, and parsed
//! into `{"tokens": [u32, ...]}` with every other shape a typed [`TokenizeError`], never a
//! panic. The caller routes by load alone on any error ([`TokenizeStats`] counts why).

use std::fmt;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::http::HeaderValue;
use hyper::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::request::{Api, ReqDoc};

/// Whether the proxy asks a worker for a text prompt's token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TokenizeMode {
    /// Never: text prompts and chats rank by load alone under `kv-events`.
    #[default]
    Off,
    /// `POST /tokenize` to a healthy worker of the pool (vLLM's OpenAI server).
    Http,
}

impl TokenizeMode {
    /// The name used in flags and TOML.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizeMode::Off => "off",
            TokenizeMode::Http => "http",
        }
    }
}

/// The default deadline of one `/tokenize` call, from sending the request to the reply's
/// last byte (docs/proxy.md: about 50 times the median round trip measured on loopback).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// The default largest `/tokenize` reply: about two million token ids.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 16 << 20;

/// Why a prompt has no token ids from `/tokenize`; each is counted under its
/// [`TokenizeError::reason`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The prompt is neither text, one text in an array, nor chat messages (a batch of
    /// prompts, say): nothing to ask.
    Unsupported,
    /// No healthy worker to ask.
    NoWorker,
    /// The worker could not be reached, or the connection broke.
    Unreachable {
        /// The worker.
        worker: String,
        /// What failed.
        detail: String,
    },
    /// No whole reply within the deadline.
    Timeout {
        /// The worker.
        worker: String,
        /// The deadline.
        after: Duration,
    },
    /// The worker answered with a status other than 200.
    Status {
        /// The worker.
        worker: String,
        /// Its status code.
        status: u16,
    },
    /// The reply was larger than the limit.
    TooLarge {
        /// The worker.
        worker: String,
        /// The limit, bytes.
        limit: usize,
    },
    /// The reply is not `{"tokens": [token id, ...], ...}`.
    Malformed {
        /// The worker.
        worker: String,
        /// What is wrong with it.
        detail: String,
    },
}

impl TokenizeError {
    /// Every reason, in the order rendered.
    pub const REASONS: [&'static str; 7] = [
        "unsupported_prompt",
        "no_worker",
        "unreachable",
        "timeout",
        "status",
        "too_large",
        "malformed",
    ];

    /// The reason's label in `/metrics`.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::Unsupported => "unsupported_prompt",
            TokenizeError::NoWorker => "no_worker",
            TokenizeError::Unreachable { .. } => "unreachable",
            TokenizeError::Timeout { .. } => "timeout",
            TokenizeError::Status { .. } => "status",
            TokenizeError::TooLarge { .. } => "too_large",
            TokenizeError::Malformed { .. } => "malformed",
        }
    }
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::Unsupported => {
                f.write_str("tokenize: the prompt is not one text or chat messages")
            }
            TokenizeError::NoWorker => f.write_str("tokenize: no healthy worker to ask"),
            TokenizeError::Unreachable { worker, detail } => {
                write!(f, "tokenize on worker {worker}: request failed: {detail}")
            }
            TokenizeError::Timeout { worker, after } => {
                write!(f, "tokenize on worker {worker}: no reply within {after:?}")
            }
            TokenizeError::Status { worker, status } => {
                write!(f, "tokenize on worker {worker}: answered status {status}")
            }
            TokenizeError::TooLarge { worker, limit } => {
                write!(
                    f,
                    "tokenize on worker {worker}: reply larger than {limit} bytes"
                )
            }
            TokenizeError::Malformed { worker, detail } => {
                write!(f, "tokenize on worker {worker}: malformed reply: {detail}")
            }
        }
    }
}

impl std::error::Error for TokenizeError {}

/// The chat request's fields that `/tokenize` takes as they are and that change the tokens
/// a vLLM server computes for `messages` (vLLM 0.32's `ChatCompletionRequest` and
/// `TokenizeChatRequest` share them, with the same defaults).
const CHAT_FIELDS: [&str; 8] = [
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "tools",
    "media_io_kwargs",
    "mm_processor_kwargs",
];

/// A raw field's value, unless absent or one vLLM's `merge_kwargs` leaves unset (`null`,
/// `"auto"`).
fn set<'a>(doc: &ReqDoc<'a>, key: &str) -> Option<&'a str> {
    doc.get(key)
        .map(RawValue::get)
        .filter(|v| *v != "null" && *v != "\"auto\"")
}

/// The `chat_template_kwargs` the server renders a chat with: the client's, with its
/// `documents` and `reasoning_effort` over them, and `enable_thinking` (`reasoning_effort`
/// other than `"none"`) unless the client's name it (vLLM 0.32
/// `ChatCompletionRequest.build_chat_params`; `/tokenize` takes only the kwargs). `Err` when
/// the client's kwargs are not an object (the server refuses the chat).
fn chat_template_kwargs(doc: &ReqDoc<'_>) -> Result<Option<String>, ()> {
    let (documents, effort) = (set(doc, "documents"), set(doc, "reasoning_effort"));
    let given = doc.get("chat_template_kwargs").map(RawValue::get);
    if documents.is_none() && effort.is_none() {
        return Ok(given.map(str::to_string));
    }
    let mut kw: serde_json::Map<String, serde_json::Value> = match given {
        None | Some("null") => serde_json::Map::new(),
        Some(g) => serde_json::from_str(g).map_err(|_| ())?,
    };
    let value = |raw: &str| serde_json::from_str::<serde_json::Value>(raw).map_err(|_| ());
    if let Some(d) = documents {
        kw.insert("documents".into(), value(d)?);
    }
    if let Some(e) = effort {
        let e = value(e)?;
        if !kw.contains_key("enable_thinking") {
            kw.insert("enable_thinking".into(), (e != "none").into());
        }
        kw.insert("reasoning_effort".into(), e);
    }
    Ok(Some(serde_json::Value::Object(kw).to_string()))
}

/// The `/tokenize` body for a request of `api`: its `model`, then a chat's
/// [`CHAT_FIELDS`] and [`chat_template_kwargs`], or a completion's `prompt` (a string, or an
/// array of exactly one) and `add_special_tokens`, each as the client sent it. `None` when
/// the prompt is none of these (token ids need no tokenizer; a batch is not routed by one
/// prompt), or the server would change the tokens in a way `/tokenize` does not
/// (`truncate_prompt_tokens`, `prompt_embeds`).
pub(crate) fn request_body(api: Api, doc: &ReqDoc<'_>) -> Option<Vec<u8>> {
    if set(doc, "truncate_prompt_tokens").is_some() || set(doc, "prompt_embeds").is_some() {
        return None;
    }
    let mut out = Vec::with_capacity(256);
    out.push(b'{');
    let put = |out: &mut Vec<u8>, k: &str, v: &str| {
        if out.len() > 1 {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(v.as_bytes());
    };
    if let Some(m) = doc.get("model") {
        put(&mut out, "model", m.get());
    }
    match api {
        Api::Chat => {
            for k in CHAT_FIELDS {
                if let Some(v) = doc.get(k) {
                    put(&mut out, k, v.get());
                }
            }
            if let Some(kw) = chat_template_kwargs(doc).ok()? {
                put(&mut out, "chat_template_kwargs", &kw);
            }
        }
        Api::Completions => {
            let p = doc.get("prompt")?.get();
            let text: &str = if p.starts_with('"') {
                p
            } else if p.starts_with('[') {
                // `["text"]`: one prompt; `[1, 2]` (token ids) or a batch: none.
                let one = serde_json::from_str::<[&RawValue; 1]>(p).ok()?;
                let s = one[0].get();
                if !s.starts_with('"') {
                    return None;
                }
                s
            } else {
                return None;
            };
            put(&mut out, "prompt", text);
            if let Some(v) = doc.get("add_special_tokens") {
                put(&mut out, "add_special_tokens", v.get());
            }
        }
        // SGLang's `/generate` has no `/tokenize` counterpart asked here.
        Api::Generate => return None,
    }
    out.push(b'}');
    Some(out)
}

/// What of a `/tokenize` reply is read: `tokens`; vLLM's `count`, `max_model_len` and
/// `token_strs` are ignored.
#[derive(Deserialize)]
struct Reply {
    tokens: Vec<u32>,
}

/// Parses a `/tokenize` reply from `worker`: a JSON object whose `tokens` is an array of
/// token ids (integers from 0 to 2^32 - 1).
pub fn parse_reply(worker: &str, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
    serde_json::from_slice::<Reply>(body)
        .map(|r| r.tokens)
        .map_err(|e| TokenizeError::Malformed {
            worker: worker.to_string(),
            detail: e.to_string(),
        })
}

/// The HTTP client the proxy calls its workers with.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One `/tokenize` call: `body` to `uri` (worker `worker`), with the client's
/// `Authorization` and the request's id (`x-request-id`, which vLLM logs) when given; the
/// token ids of a whole, valid reply within `deadline` and `max_reply` bytes, else why not.
#[allow(clippy::too_many_arguments)]
pub async fn call(
    client: &HttpClient,
    worker: &str,
    uri: Uri,
    auth: Option<&HeaderValue>,
    rid: Option<&HeaderValue>,
    body: Vec<u8>,
    deadline: Duration,
    max_reply: usize,
) -> Result<Vec<u32>, TokenizeError> {
    let w = || worker.to_string();
    let mut req = Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(a) = auth {
        req = req.header(AUTHORIZATION, a.clone());
    }
    if let Some(r) = rid {
        req = req.header("x-request-id", r.clone());
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| TokenizeError::Unreachable {
            worker: w(),
            detail: e.to_string(),
        })?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| TokenizeError::Unreachable {
                worker: w(),
                detail: format!("{e:#}"),
            })?;
        let (parts, body) = resp.into_parts();
        if parts.status != hyper::StatusCode::OK {
            return Err(TokenizeError::Status {
                worker: w(),
                status: parts.status.as_u16(),
            });
        }
        let too_large = || TokenizeError::TooLarge {
            worker: w(),
            limit: max_reply,
        };
        let declared = parts
            .headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_reply as u64) {
            return Err(too_large());
        }
        let bytes = Limited::new(body, max_reply)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    too_large()
                } else {
                    TokenizeError::Unreachable {
                        worker: w(),
                        detail: format!("reading the reply: {e}"),
                    }
                }
            })?
            .to_bytes();
        parse_reply(worker, &bytes)
    };
    match tokio::time::timeout(deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err(TokenizeError::Timeout {
            worker: w(),
            after: deadline,
        }),
    }
}

/// `/tokenize` calls made, by result, and the time the successful ones took.
#[derive(Debug, Default)]
pub struct TokenizeStats {
    ok: AtomicU64,
    ok_ns: AtomicU64,
    failed: [AtomicU64; TokenizeError::REASONS.len()],
}

impl TokenizeStats {
    /// Counts one call's result, `took` from its start; whether it is the first of its
    /// result.
    pub fn record<T>(&self, r: &Result<T, TokenizeError>, took: Duration) -> bool {
        match r {
            Ok(_) => {
                self.ok_ns.fetch_add(took.as_nanos() as u64, Relaxed);
                self.ok.fetch_add(1, Relaxed) == 0
            }
            Err(e) => {
                let i = TokenizeError::REASONS
                    .iter()
                    .position(|r| *r == e.reason())
                    .unwrap_or(0);
                self.failed[i].fetch_add(1, Relaxed) == 0
            }
        }
    }

    /// Calls that ended with `result` (`ok` or a [`TokenizeError::reason`]).
    pub fn count(&self, result: &str) -> u64 {
        if result == "ok" {
            return self.ok.load(Relaxed);
        }
        TokenizeError::REASONS
            .iter()
            .position(|r| *r == result)
            .map_or(0, |i| self.failed[i].load(Relaxed))
    }

    /// Appends `kvbridge_proxy_tokenize_total{result}` and
    /// `kvbridge_proxy_tokenize_ok_seconds_total`.
    pub fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP kvbridge_proxy_tokenize_total Prompts sent to a worker's /tokenize \
             (--kv-events-tokenize http), by result: ok, or why the request was routed by \
             load alone.\n# TYPE kvbridge_proxy_tokenize_total counter\n",
        );
        let _ = writeln!(
            out,
            "kvbridge_proxy_tokenize_total{{result=\"ok\"}} {}",
            self.ok.load(Relaxed)
        );
        for (r, v) in TokenizeError::REASONS.iter().zip(&self.failed) {
            let _ = writeln!(
                out,
                "kvbridge_proxy_tokenize_total{{result=\"{r}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvbridge_proxy_tokenize_ok_seconds_total Time the successful /tokenize \
             calls took, from sending to the reply parsed.\n\
             # TYPE kvbridge_proxy_tokenize_ok_seconds_total counter\n\
             kvbridge_proxy_tokenize_ok_seconds_total {}",
            self.ok_ns.load(Relaxed) as f64 / 1e9
        );
    }
}

/// Times `f` and counts its result in `stats`; with it, whether it is the first of its
/// result.
pub async fn counted<F>(stats: &TokenizeStats, f: F) -> (Result<Vec<u32>, TokenizeError>, bool)
where
    F: std::future::Future<Output = Result<Vec<u32>, TokenizeError>>,
{
    let t0 = Instant::now();
    let r = f.await;
    let first = stats.record(&r, t0.elapsed());
    (r, first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn body(api: Api, req: &[u8]) -> Option<Value> {
        let d = ReqDoc::parse(api, req).unwrap();
        request_body(api, &d).map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[test]
    fn the_body_mirrors_the_fields_that_change_the_tokens() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,
            "add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":true,
            "chat_template":"{{x}}","chat_template_kwargs":{"enable_thinking":false},
            "tools":[{"type":"function","function":{"name":"f"}}],"temperature":0,"stream":true}"#;
        assert_eq!(
            body(Api::Chat, chat),
            Some(
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": false, "continue_final_message": true,
                "add_special_tokens": true, "chat_template": "{{x}}",
                "chat_template_kwargs": {"enable_thinking": false},
                "tools": [{"type": "function", "function": {"name": "f"}}]})
            )
        );
        // Absent fields stay absent: the server's defaults apply to both requests alike.
        assert_eq!(
            body(
                Api::Chat,
                br#"{"messages":[{"role":"user","content":"hi"}]}"#
            ),
            Some(json!({"messages": [{"role": "user", "content": "hi"}]}))
        );
        assert_eq!(
            body(
                Api::Completions,
                br#"{"model":"m","prompt":"a \"b\"","add_special_tokens":false,"echo":true}"#
            ),
            Some(json!({"model": "m", "prompt": "a \"b\"", "add_special_tokens": false}))
        );
        assert_eq!(
            body(Api::Completions, br#"{"prompt":["one"]}"#),
            Some(json!({"prompt": "one"}))
        );
        // What the server puts into the template's kwargs for a chat goes there.
        assert_eq!(
            body(
                Api::Chat,
                br#"{"messages":[{}],"documents":[{"t":"d"}],"reasoning_effort":"low",
                    "chat_template_kwargs":{"x":1,"documents":"theirs"}}"#
            ),
            Some(json!({"messages": [{}], "chat_template_kwargs": {"x": 1,
                "documents": [{"t": "d"}], "reasoning_effort": "low", "enable_thinking": true}}))
        );
        assert_eq!(
            body(
                Api::Chat,
                br#"{"messages":[{}],"reasoning_effort":"none","documents":null,
                    "chat_template_kwargs":{"enable_thinking":true}}"#
            ),
            Some(
                json!({"messages": [{}], "chat_template_kwargs": {"enable_thinking": true,
                "reasoning_effort": "none"}})
            )
        );
        assert_eq!(
            body(Api::Chat, br#"{"messages":[{}],"reasoning_effort":"auto"}"#),
            Some(json!({"messages": [{}]}))
        );
        assert_eq!(
            body(
                Api::Chat,
                br#"{"messages":[{}],"documents":[],"chat_template_kwargs":[1]}"#
            ),
            None
        );
        for p in [
            &br#"{"prompt":[1,2,3]}"#[..],
            br#"{"prompt":["a","b"]}"#,
            br#"{"prompt":[[1,2]]}"#,
            br#"{"prompt":null}"#,
            br#"{"prompt":7}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":"a","truncate_prompt_tokens":5}"#,
            br#"{"prompt":"a","prompt_embeds":"AAAA"}"#,
        ] {
            assert_eq!(
                body(Api::Completions, p),
                None,
                "{}",
                String::from_utf8_lossy(p)
            );
        }
    }

    #[test]
    fn replies_other_than_token_ids_are_typed_errors() {
        assert_eq!(
            parse_reply(
                "w",
                br#"{"count":3,"max_model_len":9,"tokens":[0,7,4294967295],"token_strs":null}"#
            ),
            Ok(vec![0, 7, u32::MAX])
        );
        assert_eq!(parse_reply("w", br#"{"tokens":[]}"#), Ok(vec![]));
        let deep = format!(
            "{{\"tokens\":{}1{}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        for bad in [
            &b""[..],
            b"null",
            b"[1,2]",
            b"{}",
            br#"{"tokens":null}"#,
            br#"{"tokens":"1 2"}"#,
            br#"{"tokens":[1,-2]}"#,
            br#"{"tokens":[1,4294967296]}"#,
            br#"{"tokens":[1.5]}"#,
            br#"{"tokens":[1e3]}"#,
            br#"{"tokens":[1,2],"tokens":[3]}"#,
            br#"{"tokens":[1,2]"#,
            br#"{"tokens":[1,2]} trailing"#,
            b"\xff\xfe{}",
            deep.as_bytes(),
        ] {
            match parse_reply("w", bad) {
                Err(TokenizeError::Malformed { worker, detail }) => {
                    assert_eq!(worker, "w");
                    assert!(!detail.is_empty());
                }
                other => panic!(
                    "{:?}: {other:?}",
                    String::from_utf8_lossy(&bad[..bad.len().min(40)])
                ),
            }
        }
    }

    #[test]
    fn stats_count_each_result_under_its_reason() {
        let s = TokenizeStats::default();
        assert!(s.record(&Ok::<_, TokenizeError>(()), Duration::from_millis(2)));
        assert!(s.record::<()>(&Err(TokenizeError::NoWorker), Duration::ZERO));
        assert!(!s.record::<()>(&Err(TokenizeError::NoWorker), Duration::ZERO));
        s.record::<()>(
            &Err(TokenizeError::Status {
                worker: "w".into(),
                status: 500,
            }),
            Duration::ZERO,
        );
        assert_eq!(
            (s.count("ok"), s.count("no_worker"), s.count("status")),
            (1, 2, 1)
        );
        let mut out = String::new();
        s.render(&mut out);
        assert!(out.contains("kvbridge_proxy_tokenize_total{result=\"status\"} 1"));
        assert!(out.contains("kvbridge_proxy_tokenize_total{result=\"timeout\"} 0"));
        assert!(out.contains("kvbridge_proxy_tokenize_ok_seconds_total 0.002"));
    }
}
