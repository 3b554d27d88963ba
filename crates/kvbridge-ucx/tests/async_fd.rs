//! The worker driven from tokio: its event fd registered with `AsyncFd`, completions checked
//! with `test`, progress when the fd is readable, no thread blocked in the worker.
#![cfg(feature = "ucx")]

mod common;

use std::time::Duration;

use common::*;
use kvbridge_ucx::{OpId, Worker};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Waits for `op` the way an async owner of the worker would.
async fn completion(worker: &mut Worker, fd: &AsyncFd<i32>, op: OpId) -> kvbridge_ucx::Result<()> {
    loop {
        if worker.test(op)? {
            return Ok(());
        }
        if worker.progress() > 0 || !worker.arm()? {
            continue;
        }
        let mut ready = fd.readable().await.expect("the worker's event fd");
        ready.clear_ready();
    }
}

#[tokio::test(flavor = "current_thread")]
async fn puts_complete_on_tokio_async_fd_wakeups() {
    for tls in TLS_VARIANTS {
        let mut target = Target::thread(tls);
        let mut me = Initiator::to(tls, &target);
        // SAFETY: the worker owns the fd and outlives `fd`, which is dropped below, before
        // `me` (and with it the worker) goes.
        let fd =
            unsafe { AsyncFd::register_with_interest(me.worker.event_fd(), Interest::READABLE) }
                .unwrap();
        for (round, size) in [4096usize, 1 << 20, 16 << 20].into_iter().enumerate() {
            let data = pattern(round as u64 + 40, size);
            me.local.write(0, &data).unwrap();
            let op = me.worker.post_put(me.rkey, 0, &me.local, 0, size).unwrap();
            tokio::time::timeout(Duration::from_secs(20), completion(&mut me.worker, &fd, op))
                .await
                .unwrap_or_else(|_| panic!("{tls}: put of {size} bytes: no completion in 20 s"))
                .unwrap();
            me.worker.flush(me.ep, deadline(20)).unwrap();
            assert_eq!(
                target.ask(&format!("SUM 0 {size}")),
                format!("SUM {}", fnv(&data)),
                "{tls}"
            );
        }
        drop(fd);
    }
}
