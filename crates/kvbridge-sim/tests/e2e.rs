//! End to end through the proxy (lmcache flow) with real PD transfers between in-process
//! engines: disaggregated outputs must equal the colocated engine's, token for token.

use kvbridge_pd::{Dtype, KvLayout, KvSpec, TransferMode};
use kvbridge_sim::client::Client;
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::demo::Cluster;
use kvbridge_sim::model::{self, Model};
use serde_json::{json, Value};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

fn small(layout: KvLayout, tp: u32) -> Model {
    Model {
        name: "sim-test".into(),
        spec: KvSpec {
            chunk_tokens: 16,
            ..KvSpec::new(layout, Dtype::Bf16)
        },
        world_size: tp,
    }
}

const STD: KvLayout = KvLayout::Standard {
    layers: 4,
    kv_heads: 2,
    head_dim: 32,
};

/// Requests of every shape: completions and chat, streamed and not, prompts shorter than a
/// chunk, exactly one chunk, and several chunks with a partial last one.
fn requests(n: usize) -> Vec<(&'static str, Value)> {
    let lens = [3usize, 16, 17, 40, 100, 1, 31, 64];
    (0..n)
        .map(|i| {
            let text = model::random_prompt(100 + i as u64, lens[i % lens.len()]);
            let stream = i % 2 == 0;
            let max_tokens = 2 + (i % 5) as u64 * 3;
            if i % 3 == 2 {
                (
                    "/v1/chat/completions",
                    json!({"model": "sim-test", "stream": stream,
                    "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}),
                )
            } else {
                (
                    "/v1/completions",
                    json!({"model": "sim-test", "stream": stream,
                    "max_tokens": max_tokens, "prompt": text}),
                )
            }
        })
        .collect()
}

async fn check(p: u32, d: u32, m: Model, n: usize) {
    check_mode(p, d, m, n, None).await
}

async fn check_mode(p: u32, d: u32, m: Model, n: usize, mode: Option<TransferMode>) {
    let c = match mode {
        None => Cluster::start(p, d, &m, CostModel::FREE, 16 << 20).await,
        Some(mode) => Cluster::start_with(p, d, &m, CostModel::FREE, 16 << 20, mode, false).await,
    }
    .expect("cluster starts");
    let client = Client::new();
    let mut expected_kv = 0;
    for (i, (path, body)) in requests(n).into_iter().enumerate() {
        let dis = client
            .generate(&format!("{}{path}", c.proxy_url()), &body, DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("request {i} through the proxy: {e}"));
        let col = client
            .generate(&format!("{}{path}", c.colocated_url()), &body, DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("request {i} colocated: {e}"));
        assert_eq!(dis.text, col.text, "request {i} ({path}, {body})");
        let want = body["max_tokens"].as_u64().unwrap_or(0) as usize;
        assert_eq!(model::tokenize(&dis.text).len(), want, "request {i}");
        expected_kv += 1;
    }
    // Transfers are counted right after their KvReady left and chunks are verified after
    // the decode started: wait for both to settle.
    let want_ok = expected_kv * m.world_size as u64;
    c.quiesce(DEADLINE)
        .await
        .expect("transfers and verifications settle");
    let st = c.stats();
    assert_eq!(st.in_flight, 0, "{st:?}");
    assert_eq!(st.kv_mismatches, 0, "{st:?}");
    assert_eq!(
        st.local_prefills, 0,
        "every decode used transferred KV: {st:?}"
    );
    assert_eq!(st.kv_requests_received, expected_kv, "{st:?}");
    assert_eq!(st.kv_transfers_ok, want_ok, "{st:?}");
    assert_eq!(st.pages_leaked, 0, "{st:?}");
    assert_eq!(st.pages_free, st.pages_total, "every page returned: {st:?}");
    assert!(
        st.kv_bytes_received > 0 && st.kv_bytes_received == st.kv_bytes_sent,
        "{st:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefiller_one_decoder_outputs_equal_colocated() {
    check(1, 1, small(STD, 1), 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefiller_two_decoders() {
    check(1, 2, small(STD, 1), 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefillers_one_decoder() {
    check(2, 1, small(STD, 1), 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_parallel_two_ranks() {
    check(1, 1, small(STD, 2), 8).await;
}

/// Pull mode (`pd_transfer_mode = "pull"`, what `kvbridge demo --transfer-mode pull` sets):
/// the decoders read every chunk from the prefillers; same outputs, same checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_mode_outputs_equal_colocated() {
    check_mode(1, 1, small(STD, 1), 16, Some(TransferMode::Pull)).await;
    check_mode(1, 1, small(STD, 2), 8, Some(TransferMode::Pull)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_layout() {
    let mla = KvLayout::Mla {
        layers: 4,
        latent_dim: 64,
    };
    check(1, 1, small(mla, 2), 8).await;
}

/// The prefillers run a different model (same layout, other weights): the decoder must see
/// every chunk as a mismatch and its output must differ from the colocated one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_kv_is_detected() {
    let m = small(STD, 1);
    let mut other = m.clone();
    other.name = "other-weights".into();
    let c = Cluster::start_models(1, 1, &other, &m, CostModel::FREE, 16 << 20)
        .await
        .expect("cluster starts");
    let client = Client::new();
    let body = json!({"model": "sim-test", "prompt": model::random_prompt(7, 40), "max_tokens": 8});
    let dis = client
        .generate(
            &format!("{}/v1/completions", c.proxy_url()),
            &body,
            DEADLINE,
        )
        .await
        .expect("answered");
    let col = client
        .generate(
            &format!("{}/v1/completions", c.colocated_url()),
            &body,
            DEADLINE,
        )
        .await
        .expect("answered");
    assert_ne!(dis.text, col.text);
    c.quiesce(DEADLINE).await.expect("settles");
    let st = c.stats();
    assert_eq!(
        st.kv_mismatches, 3,
        "40 tokens in chunks of 16: 3 chunks, all wrong: {st:?}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors() {
    let m = small(STD, 1);
    let c = Cluster::start(1, 1, &m, CostModel::FREE, 16 << 20)
        .await
        .expect("cluster starts");
    let client = Client::new();
    let url = format!("{}/v1/completions", c.colocated_url());
    for body in [
        json!({"prompt": 5}),
        json!({"prompt": ""}),
        json!({"prompt": "baba", "max_tokens": 0}),
        json!({"prompt": "baba", "max_tokens": 1_000_000}),
        json!({"prompt": "baba", "stream": "yes"}),
        json!({"prompt": "baba", "kv_transfer_params": {"disagg_spec": {"req_id": 1}}}),
        json!([1, 2]),
    ] {
        match client.generate(&url, &body, DEADLINE).await {
            Err(kvbridge_sim::client::ClientError::Status {
                status, body: b, ..
            }) => {
                assert_eq!(status, 400, "{body}: {b}");
                assert!(b.contains("invalid_request"), "{b}");
            }
            other => panic!("{body}: expected 400, got {other:?}"),
        }
    }
    c.shutdown().await;
}

/// A chat that continues its last assistant message (`continue_final_message`, how the
/// proxy hands a decoder the prefill's first token) answers exactly the rest of the reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_continues_its_final_assistant_message() {
    let m = small(STD, 1);
    let c = Cluster::start(1, 1, &m, CostModel::FREE, 16 << 20)
        .await
        .expect("cluster starts");
    let client = Client::new();
    let url = format!("{}/v1/chat/completions", c.colocated_url());
    let user = json!({"role": "user", "content": kvbridge_sim::model::random_prompt(7, 20)});
    let whole = client
        .generate(
            &url,
            &json!({"messages": [user], "max_tokens": 4}),
            DEADLINE,
        )
        .await
        .expect("chat");
    let first = format!(
        " {}",
        whole.text.split_whitespace().next().expect("a token")
    );
    let rest = client
        .generate(
            &url,
            &json!({"messages": [user, {"role": "assistant", "content": first}],
                "continue_final_message": true, "add_generation_prompt": false, "max_tokens": 3}),
            DEADLINE,
        )
        .await
        .expect("continued chat");
    assert_eq!(format!("{first}{}", rest.text), whole.text);
    // Only an assistant's message can be continued.
    let r = client
        .generate(
            &url,
            &json!({"messages": [user], "continue_final_message": true}),
            DEADLINE,
        )
        .await;
    assert!(
        matches!(
            r,
            Err(kvbridge_sim::client::ClientError::Status { status: 400, .. })
        ),
        "{r:?}"
    );
    c.shutdown().await;
}
