//! The path UCX takes for a put over its tcp transport on kvbridge's endpoints (which ask for
//! peer-failure handling). From UCX 1.20 the endpoint gets tcp lanes for high-bandwidth
//! remote memory access (`rma_bw`), on which puts run as tcp's own zero-copy put, only while
//! rendezvous is off in the context (`UCX_RNDV_THRESH=inf`, one of `Context::new`'s
//! defaults); UCX 1.13 has no such lane for tcp and emulates every put with active messages.
//! The test is run against UCX 1.13 (Debian 12's) and, with `LD_LIBRARY_PATH` to the
//! libraries of NIXL's wheel, UCX 1.23; other releases print their lanes without a check.
#![cfg(feature = "ucx")]

mod common;

use std::ffi::c_uint;

use common::{deadline, fnv, pattern, Initiator, Target};

extern "C" {
    // ucp/api/ucp.h: `void ucp_get_version(unsigned *, unsigned *, unsigned *)`, in every
    // release; the test binary links libucp through `kvbridge-ucx-sys`.
    fn ucp_get_version(major: *mut c_uint, minor: *mut c_uint, release: *mut c_uint);
}

/// The release of the UCX library loaded (not the headers built against).
fn loaded_ucx() -> (u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers; the function only writes them.
    unsafe { ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor)
}

/// The lanes of `ucp_ep_print_info`'s text that serve puts as high-bandwidth RMA over tcp.
fn tcp_rma_bw_lanes(info: &str) -> Vec<&str> {
    info.lines()
        .filter(|l| l.contains("lane[") && l.contains("tcp/") && l.contains("rma_bw#"))
        .collect()
}

#[test]
fn a_failure_detecting_tcp_endpoint_puts_over_tcp_lanes_where_ucx_has_them() {
    if std::env::var_os("UCX_RNDV_THRESH").is_some() {
        eprintln!("UCX_RNDV_THRESH is set in the environment and wins: nothing to check");
        return;
    }
    let version = loaded_ucx();
    let mut target = Target::thread("tcp");
    let mut me = Initiator::to("tcp", &target);
    assert_eq!(me.worker.detects_peer_failure(me.ep), Some(true));
    let size = 1 << 20;
    me.local.write(0, &pattern(5, size)).unwrap();
    me.worker
        .put(me.rkey, 4096, &me.local, 0, size, deadline(20))
        .unwrap();
    me.worker.flush(me.ep, deadline(20)).unwrap();
    assert_eq!(
        target.ask(&format!("SUM 4096 {size}")),
        format!("SUM {}", fnv(&pattern(5, size)))
    );
    let info = me.worker.endpoint_info(me.ep).unwrap();
    let lanes = tcp_rma_bw_lanes(&info);
    eprintln!("UCX {version:?}: tcp rma_bw lanes {lanes:?}");
    if version >= (1, 20) {
        assert!(
            !lanes.is_empty(),
            "UCX {version:?}: no tcp lane for puts, so they are emulated with active \
             messages (UCX_RNDV_THRESH not applied?):\n{info}"
        );
    } else if version == (1, 13) {
        assert!(
            lanes.is_empty()
                && !info
                    .lines()
                    .any(|l| l.contains("lane[") && l.contains("rma")),
            "UCX 1.13 gave tcp an RMA lane; docs/ucx.md says it emulates puts:\n{info}"
        );
    }
}
