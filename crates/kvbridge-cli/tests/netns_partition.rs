//! A real network partition: the listener runs as a process in its own network namespace,
//! reached over a veth pair, and the link is cut while writes
//! are in flight (both ends taken down: packets vanish, nothing is reset). The writer must get a typed error within its op deadline, never hang, and
//! after the link heals a new session must work.
//!
//! Needs root and `ip` (iproute2); `#[ignore]`d so that `cargo test` does not need
//! them. Run: `scripts/faults.sh` (runs it when the machine allows network namespaces), or
//! `cargo test -p kvbridge-cli --test netns_partition -- --ignored`.

use kvbridge::{Channel, ChannelConfig, Grant, Op, Region};
mod common;
use common::{spawn_peer, Peer};
use std::process::Command;
use std::time::{Duration, Instant};

const OP_DEADLINE: Duration = Duration::from_secs(2);

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A namespace with one end of a veth pair; the other end stays in ours. Removed on drop.
struct Net {
    ns: String,
    host_if: String,
    ns_if: String,
    ns_addr: String,
}

impl Net {
    fn create() -> Result<Net, String> {
        let tag = std::process::id() % 100_000;
        let n = Net {
            ns: format!("kvb-part-{tag}"),
            host_if: format!("kvbh{tag}"),
            ns_if: format!("kvbn{tag}"),
            ns_addr: "10.201.77.2".into(),
        };
        sh(&["ip", "netns", "add", &n.ns])?;
        sh(&[
            "ip", "link", "add", &n.host_if, "type", "veth", "peer", "name", &n.ns_if,
        ])?;
        sh(&["ip", "link", "set", &n.ns_if, "netns", &n.ns])?;
        sh(&["ip", "addr", "add", "10.201.77.1/30", "dev", &n.host_if])?;
        sh(&["ip", "link", "set", &n.host_if, "up"])?;
        let inside = |a: &[&str]| {
            let mut v = vec!["ip", "netns", "exec", &n.ns];
            v.extend_from_slice(a);
            sh(&v)
        };
        inside(&["ip", "addr", "add", "10.201.77.2/30", "dev", &n.ns_if])?;
        inside(&["ip", "link", "set", &n.ns_if, "up"])?;
        inside(&["ip", "link", "set", "lo", "up"])?;
        Ok(n)
    }

    /// Takes both ends of the link down: every packet is dropped, silently (no reset
    /// reaches either side), as in a real partition.
    fn partition(&self) -> Result<(), String> {
        self.link("down")
    }

    fn heal(&self) -> Result<(), String> {
        self.link("up")
    }

    fn link(&self, state: &str) -> Result<(), String> {
        sh(&["ip", "link", "set", &self.host_if, state])?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns,
            "ip",
            "link",
            "set",
            &self.ns_if,
            state,
        ])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = sh(&["ip", "link", "del", &self.host_if]);
        let _ = sh(&["ip", "netns", "del", &self.ns]);
    }
}

/// `kvbridge bench peer` inside the namespace.
fn start_peer(net: &Net) -> Peer {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &net.ns, env!("CARGO_BIN_EXE_kvbridge")])
        .args(["bench", "peer", "--region-bytes", "67108864", "--listen"])
        .arg(format!("{}:0", net.ns_addr));
    spawn_peer(cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and network namespaces: scripts/faults.sh runs it"]
async fn partition_mid_write_fails_within_the_deadline_and_heals() {
    let net = Net::create().expect("network namespaces (needs root and iproute2)");
    let peer = start_peer(&net);
    let mut cfg = ChannelConfig::new("prefill-part", None);
    cfg.deadlines.op = OP_DEADLINE;
    cfg.deadlines.connect = OP_DEADLINE;
    cfg.deadlines.peer_silence = OP_DEADLINE;
    cfg.deadlines.keepalive = OP_DEADLINE / 4;
    let ch = Channel::new(cfg).await.expect("channel");
    let src = Region::alloc(4 << 20, 1 << 20).expect("region");
    src.write_at(0, &[0xA5; 4096]).expect("fill");
    ch.register(&src, Grant::AllPeers).expect("register");
    let pid = ch
        .connect(&peer.addr)
        .await
        .expect("connect across the veth");
    let batch: Vec<Op> = (0..4)
        .map(|i| Op {
            local: src.clone(),
            local_offset: i << 20,
            remote: peer.region,
            remote_offset: (i << 20) as u64,
            len: 1 << 20,
        })
        .collect();
    ch.write(&pid, &batch)
        .await
        .expect("a write before the partition");

    // Writes in a loop; cut the link while they run.
    let (c2, p2, b2) = (ch.clone(), pid.clone(), batch.clone());
    let writer = tokio::spawn(async move {
        let t0 = Instant::now();
        for _ in 0..100_000 {
            if let Err(e) = c2.write(&p2, &b2).await {
                return (e, t0.elapsed());
            }
            if t0.elapsed() > Duration::from_secs(60) {
                break;
            }
        }
        panic!("writes kept succeeding through a total partition");
    });
    tokio::time::sleep(Duration::from_millis(200)).await; // let writes be in flight
    let cut = Instant::now();
    net.partition().expect("link down");
    let (err, _) = tokio::time::timeout(OP_DEADLINE * 4, writer)
        .await
        .expect("the write must fail within its deadline, not hang")
        .expect("writer task");
    let after = cut.elapsed();
    println!("partition -> {err} after {after:?}");
    assert!(
        after < OP_DEADLINE * 3,
        "failed only {after:?} after the cut"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("prefill-part")
            || msg.contains(&pid.to_string())
            || msg.contains("bench-listener"),
        "the error names the peer: {msg}"
    );

    // Heal: a new session (the old one is gone) works again.
    net.heal().expect("heal");
    let t = Instant::now();
    let mut last = String::new();
    let mut ok = false;
    while t.elapsed() < Duration::from_secs(20) {
        match ch.connect(&peer.addr).await {
            Ok(p) => match ch.write(&p, &batch).await {
                Ok(()) => {
                    ok = true;
                    break;
                }
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
    }
    assert!(ok, "no working session after the link healed: {last}");
    ch.close().await;
}
