//! Entry points for fuzz targets (`fuzz/`): the proxy's request parsing, reachable without a
//! server. Not a stable API.

use crate::request::{Api, ReqDoc};
use crate::rewrite;
use crate::sglang_body;

/// What [`parse_request`] made of a body: the facts the proxy acts on and every body it
/// would send on, so a fuzz target can check that each is a JSON object.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// `"stream": true`.
    pub stream: bool,
    /// The tightest of `max_tokens` and `max_completion_tokens`.
    pub max_tokens: Option<u64>,
    /// vLLM flow: the prefill request, and the decode request with a sample of
    /// `kv_transfer_params` from the prefill's answer.
    pub vllm: [Vec<u8>; 2],
    /// LMCache flow: the prefill request (with a `disagg_spec`), and the decode request
    /// (continued from a first token for a completion with a text prompt).
    pub lmcache: [Vec<u8>; 2],
    /// sglang flow: the body both servers get (bootstrap fields for prefiller
    /// `127.0.0.1:8998`, room 7, or rooms 7, 8, … for a batch), or the 400's message its
    /// prompt count gives.
    pub sglang: Result<Vec<u8>, String>,
}

/// Parses and checks `body` as a POST to `path` (`/v1/completions` or
/// `/v1/chat/completions`) exactly as the server does, then builds the bodies both flows
/// would send on. Returns the 400's message for a body the server refuses, or an error for
/// another path. Never panics.
pub fn parse_request(path: &str, body: &[u8]) -> Result<Parsed, String> {
    let api = Api::from_path(path).ok_or_else(|| format!("no route for POST {path}"))?;
    let doc = ReqDoc::parse(api, body)?;
    let spec = br#"{"ret_first_tok":true,"disagg_spec":{"req_id":"kvb-fuzz-0","receiver_host":"127.0.0.1","receiver_init_port":[8300],"receiver_alloc_port":[8400]}}"#;
    let first = match api {
        Api::Completions => doc.prompt_text().is_some(),
        Api::Chat => rewrite::chat_continues(&doc),
        Api::Generate => false,
    }
    .then_some(" tok");
    Ok(Parsed {
        stream: doc.stream,
        max_tokens: doc.max_tokens,
        vllm: [
            rewrite::prefill_body(&doc, rewrite::VLLM_PREFILL_KV),
            rewrite::vllm_decode_body(
                &doc,
                Some(br#"{"remote_engine_id":"e","remote_block_ids":[1]}"#),
            ),
        ],
        lmcache: [
            rewrite::prefill_body(&doc, spec),
            rewrite::lmcache_decode_body(&doc, api, first, "kvb-fuzz-0"),
        ],
        sglang: sglang_body::batch_size(api, &doc).map(|batch| {
            let rooms: Vec<u64> = (7..7 + batch.unwrap_or(1) as u64).collect();
            sglang_body::with_bootstrap(&doc, batch.is_some(), "127.0.0.1", Some(8998), &rooms)
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn object(b: &[u8]) -> serde_json::Map<String, Value> {
        match serde_json::from_slice(b) {
            Ok(Value::Object(m)) => m,
            other => panic!("not an object ({other:?}): {}", String::from_utf8_lossy(b)),
        }
    }

    /// A bounded mutation loop over seed bodies: every input is answered, never a panic, and
    /// every body built from an accepted input is a JSON object with the overrides in place.
    #[test]
    fn mutated_bodies_never_panic_and_accepted_ones_rewrite_to_objects() {
        let seeds: [&[u8]; 6] = [
            br#"{"text":["a","b"],"return_logprob":true,"sampling_params":{"max_new_tokens":4},"n":2}"#,
            br#"{"model":"m","prompt":"hello","max_tokens":8,"stream":true}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"hi \u00e9"}],"max_completion_tokens":3}"#,
            br#"{"prompt":[1,2,3],"stream":false,"stream_options":{"include_usage":true},"kv_transfer_params":{"x":1}}"#,
            br#"{"prompt":"a\"b\\c","max_tokens":null,"pro\u006dpt":"dup","n":1e3}"#,
            b"{}",
        ];
        let alphabet = b"{}[]\":,\\0123456789.eE+-truefalsnul \t\n\xc3\xa9\xff";
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n.max(1) as u64) as usize
        };
        let (mut accepted, mut refused) = (0, 0);
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].to_vec();
            for _ in 0..1 + rnd(4) {
                let at = rnd(b.len() + 1);
                match rnd(3) {
                    0 if !b.is_empty() => {
                        b.remove(at.min(b.len() - 1));
                    }
                    1 => b.insert(at, alphabet[rnd(alphabet.len())]),
                    _ if !b.is_empty() => {
                        let at = at.min(b.len() - 1);
                        b[at] = alphabet[rnd(alphabet.len())];
                    }
                    _ => {}
                }
            }
            let path =
                ["/v1/completions", "/v1/chat/completions", "/generate"][(i / seeds.len()) % 3];
            match parse_request(path, &b) {
                Err(e) => {
                    assert!(!e.is_empty());
                    refused += 1;
                }
                Ok(p) => {
                    accepted += 1;
                    let pre = object(&p.vllm[0]);
                    assert_eq!(pre["max_tokens"], 1);
                    assert_eq!(pre["stream"], false);
                    assert!(!pre.contains_key("stream_options"));
                    assert_eq!(
                        object(&p.vllm[1])["kv_transfer_params"]["remote_engine_id"],
                        "e"
                    );
                    let lpre = object(&p.lmcache[0]);
                    assert_eq!(
                        lpre["kv_transfer_params"]["disagg_spec"]["req_id"],
                        "kvb-fuzz-0"
                    );
                    let ldec = object(&p.lmcache[1]);
                    assert_eq!(
                        ldec["kv_transfer_params"]["lmcache.pd_handoff_id"],
                        "kvb-fuzz-0"
                    );
                    match &p.sglang {
                        Ok(b) => {
                            let s = object(b);
                            let room = &s["bootstrap_room"];
                            assert!(room == 7 || room[0] == 7, "{room}");
                            assert!(
                                s.contains_key("bootstrap_host")
                                    && s.contains_key("bootstrap_port")
                            );
                        }
                        Err(e) => assert!(!e.is_empty()),
                    }
                    // Every field the client sent survives the splice, last value winning.
                    let orig = object(&b);
                    for (k, v) in &orig {
                        if k != "kv_transfer_params" {
                            assert_eq!(object(&p.vllm[1]).get(k), Some(v), "{k}");
                        }
                    }
                }
            }
        }
        assert!(
            accepted > 1000 && refused > 1000,
            "{accepted} accepted, {refused} refused"
        );
        assert!(parse_request("/v1/models", b"{}").is_err());
    }

    #[test]
    fn lmcache_decode_continues_a_text_prompt() {
        let p = parse_request(
            "/v1/completions",
            br#"{"prompt":"hi","max_tokens":4,"max_completion_tokens":9,"stream":true}"#,
        )
        .unwrap();
        assert!(p.stream);
        assert_eq!(p.max_tokens, Some(4));
        let d = object(&p.lmcache[1]);
        assert_eq!(d["prompt"], "hi tok");
        assert_eq!(d["max_tokens"], 3);
        assert_eq!(d["max_completion_tokens"], 8);
        assert_eq!(d["stream"], true);
        let pre = object(&p.lmcache[0]);
        assert_eq!(pre["max_completion_tokens"], 1);
        assert_eq!(pre["kv_transfer_params"]["ret_first_tok"], true);
    }
}
