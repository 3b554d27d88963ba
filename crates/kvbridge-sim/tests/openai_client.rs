//! The official `openai` Python client streams a chat completion (and a completion) through
//! the proxy and reads it back whole, equal to the colocated engine's answer. Runs when
//! `$KVBRIDGE_PYTHON` (default `python3`) can `import openai` (CI: `pip install openai`);
//! otherwise it says so and passes.

use kvbridge_pd::{Dtype, KvLayout, KvSpec};
use kvbridge_sim::client::Client;
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::demo::Cluster;
use kvbridge_sim::model::{self, Model};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_through_the_proxy() {
    let python = std::env::var("KVBRIDGE_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has {
        // CI installs it (scripts/setup.sh); there a missing module is a failure, not a skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "{python} cannot import openai; scripts/setup.sh installs it"
        );
        eprintln!("SKIPPED: {python} cannot import openai (scripts/setup.sh)");
        return;
    }
    let m = Model {
        name: "sim-openai".into(),
        spec: KvSpec {
            chunk_tokens: 16,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 2,
                    kv_heads: 2,
                    head_dim: 32,
                },
                Dtype::Bf16,
            )
        },
        world_size: 1,
    };
    let c = Cluster::start(1, 1, &m, CostModel::FREE, 16 << 20)
        .await
        .expect("cluster");
    let prompt = model::random_prompt(42, 50);
    let client = Client::new();
    let d = Duration::from_secs(20);
    let chat = client
        .generate(
            &format!("{}/v1/chat/completions", c.colocated_url()),
            &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 6}),
            d,
        )
        .await
        .expect("colocated chat");
    let cmpl = client
        .generate(
            &format!("{}/v1/completions", c.colocated_url()),
            &json!({"prompt": prompt, "max_tokens": 6}),
            d,
        )
        .await
        .expect("colocated completion");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&python)
            .args([
                script,
                &c.proxy_url(),
                "sim-openai",
                &prompt,
                &chat.text,
                &cmpl.text,
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the client finishes in time")
    .expect("python runs");
    assert!(
        out.status.success(),
        "openai client failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    c.quiesce(d).await.expect("settles");
    let st = c.stats();
    assert_eq!(st.kv_mismatches, 0, "{st:?}");
    assert_eq!(st.local_prefills, 0, "{st:?}");
    c.shutdown().await;
}
