//! A small OpenAI-API client over hyper for the demo and the tests: sends a completion or
//! chat request, reads a whole answer or an SSE stream, and measures time to first token.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::time::{Duration, Instant};

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No complete answer within the deadline.
    #[error("no complete answer from {url} within {after:?}")]
    Timeout {
        /// The URL.
        url: String,
        /// The deadline.
        after: Duration,
    },
    /// Connecting or reading failed.
    #[error("{url}: {detail}")]
    Transport {
        /// The URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// The server answered an error status.
    #[error("{url} answered {status}: {body}")]
    Status {
        /// The URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The answer's body.
        body: String,
    },
    /// The server answered something that is not an OpenAI answer, or an SSE `error` event.
    #[error("{url}: bad answer: {detail}")]
    Answer {
        /// The URL.
        url: String,
        /// What was wrong.
        detail: String,
    },
}

/// One answered request.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The generated text (completion text or chat content).
    pub text: String,
    /// Time from sending to the first generated text (streamed) or to the whole answer.
    pub ttft: Duration,
    /// Time from sending to the end of the answer.
    pub total: Duration,
    /// Text pieces received (streamed: one per token).
    pub pieces: u32,
}

/// An HTTP/1 client with pooled keep-alive connections and TCP_NODELAY.
#[derive(Clone)]
pub struct Client {
    inner: HyperClient<HttpConnector, Full<Bytes>>,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Client")
    }
}

impl Client {
    /// A new client.
    pub fn new() -> Self {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        c.set_connect_timeout(Some(Duration::from_secs(3)));
        Self {
            inner: HyperClient::builder(TokioExecutor::new()).build(c),
        }
    }

    /// GETs `url` and parses the JSON answer, within `deadline`.
    pub async fn get_json(&self, url: &str, deadline: Duration) -> Result<Value, ClientError> {
        let b = self.get_text(url, deadline).await?;
        serde_json::from_str(&b).map_err(|e| answer(url, e))
    }

    /// GETs `url` and returns the answer's text, within `deadline`.
    pub async fn get_text(&self, url: &str, deadline: Duration) -> Result<String, ClientError> {
        let work = async {
            let req = hyper::Request::get(url)
                .body(Full::new(Bytes::new()))
                .map_err(|e| transport(url, e))?;
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| transport(url, e))?;
            let status = resp.status();
            let b = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| transport(url, e))?
                .to_bytes();
            if !status.is_success() {
                return Err(ClientError::Status {
                    url: url.into(),
                    status: status.as_u16(),
                    body: String::from_utf8_lossy(&b).into_owned(),
                });
            }
            Ok(String::from_utf8_lossy(&b).into_owned())
        };
        tokio::time::timeout(deadline, work)
            .await
            .map_err(|_| ClientError::Timeout {
                url: url.into(),
                after: deadline,
            })?
    }

    /// POSTs an OpenAI request (`body["stream"]` decides how the answer is read) to `url`
    /// and returns the generated text with its timings, all within `deadline`.
    pub async fn generate(
        &self,
        url: &str,
        body: &Value,
        deadline: Duration,
    ) -> Result<Answer, ClientError> {
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let t0 = Instant::now();
        let work = async {
            let bytes = serde_json::to_vec(body).map_err(|e| answer(url, e))?;
            let req = hyper::Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(bytes)))
                .map_err(|e| transport(url, e))?;
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| transport(url, e))?;
            let status = resp.status();
            let mut body = resp.into_body();
            if !status.is_success() || !stream {
                let b = body
                    .collect()
                    .await
                    .map_err(|e| transport(url, e))?
                    .to_bytes();
                if !status.is_success() {
                    return Err(ClientError::Status {
                        url: url.into(),
                        status: status.as_u16(),
                        body: String::from_utf8_lossy(&b).into_owned(),
                    });
                }
                let v: Value = serde_json::from_slice(&b).map_err(|e| answer(url, e))?;
                let text = choice_text(&v).ok_or_else(|| {
                    answer(url, format!("no text in {}", String::from_utf8_lossy(&b)))
                })?;
                let total = t0.elapsed();
                return Ok(Answer {
                    text,
                    ttft: total,
                    total,
                    pieces: 1,
                });
            }
            let (mut text, mut ttft, mut pieces, mut done) = (String::new(), None, 0u32, false);
            let mut buf: Vec<u8> = Vec::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| transport(url, e))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buf.extend_from_slice(&data);
                while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                    let event: Vec<u8> = buf.drain(..pos + 2).collect();
                    let event = String::from_utf8_lossy(&event);
                    let mut is_error = false;
                    for line in event.lines() {
                        if line.starts_with("event: error") {
                            is_error = true;
                        }
                        let Some(d) = line.strip_prefix("data:") else {
                            continue;
                        };
                        let d = d.trim();
                        if is_error {
                            return Err(answer(url, format!("SSE error event: {d}")));
                        }
                        if d == "[DONE]" {
                            done = true;
                            continue;
                        }
                        let v: Value = serde_json::from_str(d).map_err(|e| answer(url, e))?;
                        if v.get("error").is_some() {
                            return Err(answer(url, format!("SSE error: {d}")));
                        }
                        if let Some(t) = choice_text(&v) {
                            if !t.is_empty() {
                                ttft.get_or_insert_with(|| t0.elapsed());
                                pieces += 1;
                                text.push_str(&t);
                            }
                        }
                    }
                }
            }
            if !done {
                return Err(answer(url, "the stream ended without [DONE]"));
            }
            let total = t0.elapsed();
            Ok(Answer {
                text,
                ttft: ttft.unwrap_or(total),
                total,
                pieces,
            })
        };
        tokio::time::timeout(deadline, work)
            .await
            .map_err(|_| ClientError::Timeout {
                url: url.into(),
                after: deadline,
            })?
    }
}

/// The text of the first choice of a completion, chat answer, or streamed chunk of either.
pub fn choice_text(v: &Value) -> Option<String> {
    let c = v.pointer("/choices/0")?;
    c.get("text")
        .or_else(|| c.pointer("/message/content"))
        .or_else(|| c.pointer("/delta/content"))
        .map(|t| t.as_str().unwrap_or("").to_string())
        .or_else(|| c.get("delta").map(|_| String::new()))
}

fn transport(url: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Transport {
        url: url.into(),
        detail: e.to_string(),
    }
}

fn answer(url: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Answer {
        url: url.into(),
        detail: e.to_string(),
    }
}
