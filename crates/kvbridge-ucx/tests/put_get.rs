//! Byte-exact puts and gets between two workers, in one process and across two, over UCX's
//! tcp transport and its shared-memory transports; and a flushed write observed before the
//! notification-like small write that follows it.
#![cfg(feature = "ucx")]

mod common;

use common::*;

#[test]
fn ucx_child() {
    child_entry();
}

const SIZES: [usize; 5] = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20];
const OFFSET: usize = 4096;

fn put_then_get_byte_exact(tls: &str, mut target: Target) {
    let mut me = Initiator::to(tls, &target);
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(size as u64, size);
        me.local.write(OFFSET, &data).unwrap();
        me.worker
            .put(
                me.rkey,
                OFFSET as u64,
                &me.local,
                OFFSET,
                size,
                deadline(20),
            )
            .unwrap();
        me.worker.flush(me.ep, deadline(20)).unwrap();
        assert_eq!(
            target.ask(&format!("SUM {OFFSET} {size}")),
            format!("SUM {}", fnv(&data)),
            "{tls}: put of {size} bytes not byte-exact at the target"
        );
        // The target writes other bytes; a get brings them back exactly.
        let seed = 1000 + i;
        assert_eq!(target.ask(&format!("FILL {OFFSET} {size} {seed}")), "OK");
        me.worker
            .get(me.rkey, OFFSET as u64, &me.local, 0, size, deadline(20))
            .unwrap();
        let mut back = vec![0u8; size];
        me.local.read(0, &mut back).unwrap();
        assert!(
            back == pattern(seed as u64, size),
            "{tls}: get of {size} bytes not byte-exact"
        );
    }
    assert_eq!(me.worker.in_flight(), 0);
}

#[test]
fn put_get_two_workers_one_process() {
    for tls in TLS_VARIANTS {
        put_then_get_byte_exact(tls, Target::thread(tls));
    }
}

#[test]
fn put_get_two_processes() {
    for tls in TLS_VARIANTS {
        put_then_get_byte_exact(tls, Target::process(tls, "ucx_child"));
    }
}

/// A 16 MiB write, flushed, then an 8-byte "notification" write over a second endpoint (no
/// order between endpoints, as between UCX and kvbridge's control connection): when the
/// target sees the notification, the 16 MiB are already all there.
fn flushed_write_lands_before_the_notification(tls: &str, mut target: Target) {
    let mut me = Initiator::to(tls, &target);
    let notify_ep = me.worker.connect("target-notify", &target.address).unwrap();
    let notify_key = me.worker.unpack_rkey(notify_ep, &target.region).unwrap();
    let size = 16 << 20;
    let flag = REGION_LEN - 8;
    for round in 0..3u64 {
        assert_eq!(target.ask(&format!("ZERO {flag} 8")), "OK");
        assert_eq!(target.ask(&format!("WATCH {flag} 0 {size}")), "OK");
        let data = pattern(77 + round, size);
        me.local.write(0, &data).unwrap();
        me.local.write(flag, &(round + 1).to_le_bytes()).unwrap();
        let big = me.worker.post_put(me.rkey, 0, &me.local, 0, size).unwrap();
        me.worker.flush(me.ep, deadline(20)).unwrap();
        me.worker
            .put(notify_key, flag as u64, &me.local, flag, 8, deadline(20))
            .unwrap();
        me.worker.wait(big, deadline(20)).unwrap();
        assert_eq!(
            target.answer(),
            format!("WATCHED {}", fnv(&data)),
            "{tls}: round {round}: the notification was seen before the flushed write had landed"
        );
    }
}

#[test]
fn flush_orders_the_notification_one_process() {
    for tls in TLS_VARIANTS {
        flushed_write_lands_before_the_notification(tls, Target::thread(tls));
    }
}

#[test]
fn flush_orders_the_notification_two_processes() {
    for tls in TLS_VARIANTS {
        flushed_write_lands_before_the_notification(tls, Target::process(tls, "ucx_child"));
    }
}

/// Memory the caller owns (as the engine's regions are), registered with `map_existing`,
/// written from and read into byte-exact.
#[test]
fn put_get_with_existing_memory() {
    for tls in TLS_VARIANTS {
        let mut target = Target::thread(tls);
        let mut me = Initiator::to(tls, &target);
        let size = 1 << 20;
        let mut buf = pattern(123, size);
        // SAFETY: `buf` is neither moved nor dropped until after `region` and every
        // operation on it: the operations are waited for and the region dropped below.
        let region =
            unsafe { kvbridge_ucx::MemRegion::map_existing(&me.ctx, buf.as_mut_ptr(), size) }
                .unwrap();
        me.worker
            .put(me.rkey, 0, &region, 0, size, deadline(20))
            .unwrap();
        me.worker.flush(me.ep, deadline(20)).unwrap();
        assert_eq!(
            target.ask(&format!("SUM 0 {size}")),
            format!("SUM {}", fnv(&pattern(123, size))),
            "{tls}"
        );
        assert_eq!(target.ask(&format!("FILL 0 {size} 321")), "OK");
        me.worker
            .get(me.rkey, 0, &region, 0, size, deadline(20))
            .unwrap();
        assert_eq!(me.worker.in_flight(), 0);
        drop(region);
        assert!(
            buf == pattern(321, size),
            "{tls}: get into existing memory not byte-exact"
        );
    }
}
