//! SGLang's `/generate` with `return_logprob`: the prefill server computed the prompt's
//! tokens, so its answer holds their `meta_info.input_token_logprobs` and the decode
//! server's holds only its own; the answer carries the prefill's list in front of the
//! decode's, as SGLang's router does, per prompt of a batch. For a streamed answer
//! ([`SseMerge`]) each `data:` event is merged as it passes.

use bytes::Bytes;
use serde_json::Value;

/// Whether the request asks for logprobs (`return_logprob` true, or true for any prompt of
/// a batch).
pub(crate) fn asks(return_logprob: Option<&str>) -> bool {
    match return_logprob.map(str::trim) {
        Some("true") => true,
        Some(raw) if raw.starts_with('[') => serde_json::from_str::<Vec<Value>>(raw)
            .is_ok_and(|v| v.iter().any(|x| x.as_bool() == Some(true))),
        _ => false,
    }
}

/// The prefill's `input_token_logprobs` of each prompt, by the prompt's index.
#[derive(Debug, Default)]
pub(crate) struct InputLogprobs(Vec<Option<Value>>);

/// Most prompts whose logprobs are kept (the proxy's batch limit).
const MAX_ITEMS: usize = crate::sglang_body::MAX_BATCH;

impl InputLogprobs {
    /// Reads them off the prefill's answer: a JSON object (one prompt), an array (a batch),
    /// or, for a streamed prefill, its SSE events (the first of each `index`). Whatever is
    /// not there is left out: the decode's list is then passed on as it is.
    pub(crate) fn from_prefill(body: &[u8]) -> InputLogprobs {
        let mut out = InputLogprobs::default();
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Array(items)) => {
                for (i, v) in items.iter().enumerate().take(MAX_ITEMS) {
                    out.put(i, v, false);
                }
            }
            Ok(v) => out.put(0, &v, false),
            Err(_) => {
                for data in sse_data(body) {
                    if let Ok(v) = serde_json::from_slice::<Value>(data) {
                        out.put(index_of(&v), &v, true);
                    }
                }
            }
        }
        out
    }

    fn put(&mut self, i: usize, v: &Value, keep_first: bool) {
        let Some(l) = list(v) else { return };
        if i >= MAX_ITEMS {
            return;
        }
        if self.0.len() <= i {
            self.0.resize(i + 1, None);
        }
        if !(keep_first && self.0[i].is_some()) {
            self.0[i] = Some(l.clone());
        }
    }

    /// Whether any prompt's list was found.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// Puts prompt `i`'s list in front of the one in `v`, if both are there.
    fn merge_into(&self, i: usize, v: &mut Value) -> bool {
        let Some(Some(Value::Array(pre))) = self.0.get(i) else {
            return false;
        };
        let Some(Value::Array(own)) = v.pointer_mut("/meta_info/input_token_logprobs") else {
            return false;
        };
        let mut merged = pre.clone();
        merged.append(own);
        *own = merged;
        true
    }

    /// The decode's whole answer with the lists merged (one object, or an array of one per
    /// prompt); `None` when there was nothing to merge, and the answer goes on as it came.
    pub(crate) fn merge_json(&self, body: &[u8]) -> Option<Bytes> {
        let mut v = serde_json::from_slice::<Value>(body).ok()?;
        let merged = match &mut v {
            Value::Array(items) => items
                .iter_mut()
                .enumerate()
                .fold(false, |m, (i, x)| self.merge_into(i, x) | m),
            x => self.merge_into(0, x),
        };
        merged.then(|| Bytes::from(v.to_string()))
    }

    /// One SSE `data:` payload merged, or `None` to pass it on as it came (`[DONE]`, not
    /// JSON, nothing to merge).
    fn merge_event(&self, data: &[u8]) -> Option<Vec<u8>> {
        let mut v = serde_json::from_slice::<Value>(data).ok()?;
        let i = index_of(&v);
        self.merge_into(i, &mut v)
            .then(|| v.to_string().into_bytes())
    }
}

/// `meta_info.input_token_logprobs` of an answer, when it is an array.
fn list(v: &Value) -> Option<&Value> {
    v.pointer("/meta_info/input_token_logprobs")
        .filter(|l| l.is_array())
}

/// The prompt a streamed event belongs to (`index`, 0 when absent).
fn index_of(v: &Value) -> usize {
    v.get("index")
        .and_then(Value::as_u64)
        .map_or(0, |i| usize::try_from(i).unwrap_or(usize::MAX))
}

/// The payloads of the `data:` lines of complete SSE events in `body`.
fn sse_data(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    body.split(|b| *b == b'\n').filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let d = line.strip_prefix(b"data:")?;
        Some(d.strip_prefix(b" ").unwrap_or(d))
    })
}

/// Merges a streamed answer's events as they pass: bytes are held until their event is
/// whole (a blank line ends it), at most `max_event` bytes of one event.
pub(crate) struct SseMerge {
    logprobs: InputLogprobs,
    buf: Vec<u8>,
    max_event: usize,
}

impl SseMerge {
    pub(crate) fn new(logprobs: InputLogprobs, max_event: usize) -> SseMerge {
        SseMerge {
            logprobs,
            buf: Vec::new(),
            max_event,
        }
    }

    /// Takes in `chunk`; returns the events it completed, merged (possibly none). An event
    /// that grows past the limit is an error: the stream cannot go on.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Result<Bytes, String> {
        self.buf.extend_from_slice(chunk);
        let Some(end) = last_event_end(&self.buf) else {
            if self.buf.len() > self.max_event {
                return Err(format!(
                    "the decoder sent an SSE event of more than {} bytes",
                    self.max_event
                ));
            }
            return Ok(Bytes::new());
        };
        let rest = self.buf.split_off(end);
        let whole = std::mem::replace(&mut self.buf, rest);
        let mut out = Vec::with_capacity(whole.len() + 64);
        for event in whole.split_inclusive(|b| *b == b'\n') {
            // `event` is one line here; only a lone `data:` line is rewritten.
            match event
                .strip_prefix(b"data: ")
                .or_else(|| event.strip_prefix(b"data:"))
                .map(|d| d.strip_suffix(b"\n").unwrap_or(d))
                .and_then(|d| self.logprobs.merge_event(d))
            {
                Some(merged) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&merged);
                    out.push(b'\n');
                }
                None => out.extend_from_slice(event),
            }
        }
        if self.buf.len() > self.max_event {
            return Err(format!(
                "the decoder sent an SSE event of more than {} bytes",
                self.max_event
            ));
        }
        Ok(Bytes::from(out))
    }

    /// What is left when the stream ends: an unfinished event, as it came.
    pub(crate) fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.buf))
    }
}

/// Where the last complete event in `b` ends (just past its blank line).
fn last_event_end(b: &[u8]) -> Option<usize> {
    b.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lp(v: &[i64]) -> Value {
        json!(v.iter().map(|x| json!([-0.5, x, null])).collect::<Vec<_>>())
    }

    #[test]
    fn asks_for_logprobs() {
        assert!(asks(Some("true")));
        assert!(asks(Some("[false, true]")));
        for no in [
            None,
            Some("false"),
            Some("null"),
            Some("[false]"),
            Some("["),
        ] {
            assert!(!asks(no), "{no:?}");
        }
    }

    #[test]
    fn merges_one_answer_and_a_batch_item_by_item() {
        let p = json!({"text": "x", "meta_info": {"input_token_logprobs": lp(&[1, 2, 3])}});
        let l = InputLogprobs::from_prefill(p.to_string().as_bytes());
        let d = json!({"text": "yz", "meta_info": {"input_token_logprobs": lp(&[4])}});
        let out: Value =
            serde_json::from_slice(&l.merge_json(d.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(out["meta_info"]["input_token_logprobs"], lp(&[1, 2, 3, 4]));
        assert_eq!(out["text"], "yz");

        let p = json!([{"meta_info": {"input_token_logprobs": lp(&[1])}},
            {"meta_info": {"input_token_logprobs": lp(&[2])}}]);
        let l = InputLogprobs::from_prefill(p.to_string().as_bytes());
        let d = json!([{"meta_info": {"input_token_logprobs": lp(&[10])}},
            {"meta_info": {"input_token_logprobs": lp(&[20])}}]);
        let out: Value =
            serde_json::from_slice(&l.merge_json(d.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(out[0]["meta_info"]["input_token_logprobs"], lp(&[1, 10]));
        assert_eq!(out[1]["meta_info"]["input_token_logprobs"], lp(&[2, 20]));
    }

    #[test]
    fn hostile_or_missing_lists_leave_the_answer_as_it_came() {
        let l = InputLogprobs::from_prefill(b"\xff not json");
        assert!(l.is_empty());
        let p = json!({"meta_info": {"input_token_logprobs": "nope"}});
        assert!(InputLogprobs::from_prefill(p.to_string().as_bytes()).is_empty());
        let p = json!({"meta_info": {"input_token_logprobs": lp(&[1])}});
        let l = InputLogprobs::from_prefill(p.to_string().as_bytes());
        assert!(l.merge_json(b"{\"meta_info\":{}}").is_none());
        assert!(l.merge_json(b"[1,2").is_none());
        assert!(l
            .merge_json(b"{\"meta_info\":{\"input_token_logprobs\":7}}")
            .is_none());
    }

    #[test]
    fn a_stream_is_merged_event_by_event_across_any_split() {
        let p = format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"meta_info": {"input_token_logprobs": lp(&[1, 2])}})
        );
        let l = InputLogprobs::from_prefill(p.as_bytes());
        assert!(!l.is_empty(), "read off a streamed prefill");
        let e1 = json!({"text": "a", "meta_info": {"input_token_logprobs": lp(&[3])}});
        let e2 = json!({"text": "ab", "meta_info": {"input_token_logprobs": []}});
        let stream = format!("data: {e1}\n\ndata: {e2}\n\ndata: [DONE]\n\n");
        let want = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"text": "a", "meta_info": {"input_token_logprobs": lp(&[1, 2, 3])}}),
            json!({"text": "ab", "meta_info": {"input_token_logprobs": lp(&[1, 2])}})
        );
        for cut in [1, 7, 40, stream.len() - 3] {
            let mut m = SseMerge::new(InputLogprobs::from_prefill(p.as_bytes()), 1 << 16);
            let mut out = Vec::new();
            out.extend_from_slice(&m.push(&stream.as_bytes()[..cut]).unwrap());
            out.extend_from_slice(&m.push(&stream.as_bytes()[cut..]).unwrap());
            out.extend_from_slice(&m.finish());
            let got: Vec<Value> = sse_data(&out)
                .filter(|d| *d != b"[DONE]")
                .map(|d| serde_json::from_slice(d).unwrap())
                .collect();
            let want: Vec<Value> = sse_data(want.as_bytes())
                .filter(|d| *d != b"[DONE]")
                .map(|d| serde_json::from_slice(d).unwrap())
                .collect();
            assert_eq!(got, want, "split at {cut}");
            assert!(out.ends_with(b"data: [DONE]\n\n"));
        }
        let mut m = SseMerge::new(InputLogprobs::default(), 16);
        assert_eq!(m.push(b"data: 12345").unwrap().len(), 0);
        let e = m.push(b"67890123456789").unwrap_err();
        assert!(e.contains("more than 16 bytes"), "{e}");
    }
}
