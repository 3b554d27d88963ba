//! Deterministic simulation (turmoil) of the handshake and a first transfer under random
//! latency, held messages and partitions, driving the real driver code through `net::Net::Sim`.
//!
//! Every run must end within its deadlines in success (the write landed byte-exact) or a
//! typed error, and a failed run must leave no session, token or dial on either side.
//! 1000 seeds run in the normal suite; `cargo test -p kvbridge --test simulation -- --ignored`
//! runs 20,000.

use kvbridge::net::Net;
use kvbridge::{Channel, ChannelConfig, Deadlines, Grant, Op, PeerId, Region, Stats};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PAGE: usize = 4096;

fn deadlines() -> Deadlines {
    Deadlines {
        connect: Duration::from_secs(2),
        handshake_step: Duration::from_secs(2),
        op: Duration::from_secs(3),
        first_frame: Duration::from_secs(2),
        control_write: Duration::from_secs(2),
        keepalive: Duration::from_secs(1),
        peer_silence: Duration::from_secs(4),
        close: Duration::from_secs(2),
    }
}

/// Upper bound on how long connect + first write may take: every step's deadline, summed.
fn bound() -> Duration {
    let d = deadlines();
    d.connect * 2 + d.handshake_step * 4 + d.op + Duration::from_secs(1)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    ok: bool,
    error: Option<String>,
}

fn run_seed(seed: u64) -> Outcome {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let max_latency = 1 + rng.below(300);
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(120))
        .tick_duration(Duration::from_millis(4))
        .min_message_latency(Duration::from_millis(rng.below(max_latency)))
        .max_message_latency(Duration::from_millis(max_latency))
        .build();

    let target = Region::alloc(16 * PAGE, PAGE).unwrap();
    let listener_stats: Arc<Mutex<Option<Stats>>> = Arc::default();
    {
        let target = target.clone();
        let listener_stats = listener_stats.clone();
        sim.host("listener", move || {
            let target = target.clone();
            let listener_stats = listener_stats.clone();
            async move {
                let mut c = ChannelConfig::new("decode-0", Some("0.0.0.0:7000"));
                c.net = Net::Sim;
                c.deadlines = deadlines();
                let ch = Channel::new(c).await.unwrap();
                ch.register(&target, Grant::AllPeers).unwrap();
                loop {
                    *listener_stats.lock().unwrap() = Some(ch.stats().await.unwrap());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
    }

    // Faults, chosen by the seed: a hold and/or a partition at a random time.
    let hold_at = rng.below(3000);
    let hold_for = rng.below(4000);
    let part_at = rng.below(6000);
    let part_for = if rng.below(3) == 0 {
        rng.below(8000)
    } else {
        0
    };
    let outcome: Arc<Mutex<Outcome>> = Arc::default();
    let out2 = outcome.clone();
    let target2 = target.clone();
    sim.client("initiator", async move {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(hold_at)).await;
            turmoil::hold("initiator", "listener");
            tokio::time::sleep(Duration::from_millis(hold_for)).await;
            turmoil::release("initiator", "listener");
        });
        if part_for > 0 {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(part_at)).await;
                turmoil::partition("initiator", "listener");
                tokio::time::sleep(Duration::from_millis(part_for)).await;
                turmoil::repair("initiator", "listener");
            });
        }
        let mut c = ChannelConfig::new("prefill-0", None);
        c.net = Net::Sim;
        c.deadlines = deadlines();
        let ch = Channel::new(c).await.unwrap();
        let src = Region::alloc(PAGE, PAGE).unwrap();
        src.write_at(0, &[seed as u8 | 1; PAGE]).unwrap();
        ch.register(&src, Grant::AllPeers).unwrap();

        let t0 = tokio::time::Instant::now();
        let result = async {
            let peer: PeerId = ch.connect("listener:7000").await?;
            ch.write(&peer, &[Op::page(&src, 0, target2.id(), 3, PAGE)])
                .await
        }
        .await;
        let took = t0.elapsed();
        assert!(
            took <= bound(),
            "seed {seed}: took {took:?}, bound {:?}",
            bound()
        );
        match &result {
            Ok(()) => {
                let mut got = vec![0u8; PAGE];
                target2.read_at(3 * PAGE, &mut got).unwrap();
                assert!(
                    got.iter().all(|&b| b == seed as u8 | 1),
                    "seed {seed}: write not byte-exact"
                );
                ch.close().await;
            }
            Err(_) => {
                // Rollback on our side: nothing left.
                let s = ch.stats().await.unwrap();
                assert_eq!(
                    (s.sessions, s.dialing, s.tokens),
                    (0, 0, 0),
                    "seed {seed}: {s:?}"
                );
                ch.close().await;
            }
        }
        // Let the faults end and the listener notice, then it must hold nothing either.
        tokio::time::sleep(
            Duration::from_millis(hold_at + hold_for + part_at + part_for)
                + deadlines().peer_silence * 3,
        )
        .await;
        *out2.lock().unwrap() = Outcome {
            ok: result.is_ok(),
            error: result.err().map(|e| e.to_string()),
        };
        Ok(())
    });
    sim.run()
        .unwrap_or_else(|e| panic!("seed {seed}: simulation failed: {e}"));
    let s = listener_stats
        .lock()
        .unwrap()
        .clone()
        .expect("listener ran");
    assert_eq!(
        (s.sessions, s.tokens, s.dialing),
        (0, 0, 0),
        "seed {seed}: listener kept state: {s:?}"
    );
    let o = outcome.lock().unwrap().clone();
    o
}

fn run_range(seeds: std::ops::Range<u64>) {
    let (mut ok, mut failed) = (0, 0);
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for seed in seeds {
        let o = run_seed(seed);
        if o.ok {
            ok += 1;
        } else {
            failed += 1;
            // Typed errors name the peer and the step; bucket by the step.
            let e = o.error.unwrap_or_default();
            let kind = e.split(": ").nth(1).unwrap_or(&e).to_string();
            *kinds.entry(kind).or_default() += 1;
        }
    }
    eprintln!("failure kinds: {kinds:#?}");
    // Both outcomes must occur, or the faults are not biting (or nothing ever works).
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
    eprintln!("simulation: {ok} succeeded, {failed} failed cleanly");
}

#[test]
fn handshake_and_first_write_under_1000_seeds() {
    run_range(0..1000);
}

#[test]
#[ignore = "stress: 20,000 seeds; run with --ignored"]
fn handshake_and_first_write_under_20000_seeds() {
    run_range(1000..21_000);
}
