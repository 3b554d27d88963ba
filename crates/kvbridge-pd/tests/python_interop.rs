//! Issue 3, test 6: real outcomes of a real transfer, received and decoded by pyzmq and
//! msgspec (tests/python/pd_outcomes_interop.py). Skipped, with a note, when
//! `python3 -c "import zmq, msgspec"` fails (CI installs them: `pip install pyzmq msgspec`).

mod common;
use common::*;
use kvbridge_pd::{OutcomeSink, ZmqPusher};
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, BufReader};

fn python_ready() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_msgspec_decode_real_outcomes() {
    if !python_ready() {
        // CI installs them (scripts/setup.sh); there a missing module is a failure, not a skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with pyzmq and msgspec is required in CI (scripts/setup.sh installs them)"
        );
        eprintln!("SKIPPED: python3 with pyzmq and msgspec not found (scripts/setup.sh)");
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/pd_outcomes_interop.py"
    );
    let mut child = tokio::process::Command::new("python3")
        .args([script, "ok-1", "too-big"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = tokio::time::timeout(10 * S, lines.next_line())
        .await
        .expect("the script prints its port")
        .unwrap()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let sink = OutcomeSink::Zmq(ZmqPusher::spawn(format!("tcp://127.0.0.1:{port}"), 5 * S));
    let rx = receiver(4, |_| {}).await;
    let tx = sender("prefill-0", sink).await;
    // A real success (a partial chunk) and a real failure (larger than the buffer).
    let mut t = tx
        .begin(&disagg("ok-1", &rx), &tokens(1, 20))
        .await
        .unwrap();
    for i in 0..t.chunks() {
        t.send_chunk(i, &kv(1, i, t.chunk_bytes(i) as usize))
            .await
            .unwrap();
    }
    t.finish().await.unwrap();
    assert!(tx
        .begin(&disagg("too-big", &rx), &tokens(2, 16 * 9))
        .await
        .is_err());
    let mut out = Vec::new();
    while let Ok(Some(l)) = tokio::time::timeout(30 * S, lines.next_line())
        .await
        .unwrap_or(Ok(None))
    {
        out.push(l);
    }
    let status = tokio::time::timeout(10 * S, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "python: {out:?}");
    assert_eq!(out.last().map(String::as_str), Some("OK"), "{out:?}");
    let ready: serde_json::Value = serde_json::from_str(&out[0]).unwrap();
    assert_eq!(ready["type"], "KvReady");
    assert_eq!(ready["req_id"], "ok-1");
    assert_eq!(ready["chunks"], 2);
    assert_eq!(ready["bytes"], 20 * 256);
    let failed: serde_json::Value = serde_json::from_str(&out[1]).unwrap();
    assert_eq!(failed["type"], "KvFailed");
    assert!(
        failed["reason"].as_str().unwrap().contains("9 pages"),
        "{failed}"
    );
}
