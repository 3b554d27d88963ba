//! The premise of `kvbridge_ucx::reach`: a worker on the transports it counts as this user's
//! alone (`posix`, `cma`, `self`) opens no port another host could reach, while one with
//! `tcp` listens; and two processes' workers on those transports still move bytes.
#![cfg(feature = "ucx")]

mod common;

use common::{deadline, fnv, listening_ports, pattern, Initiator, Target};
use kvbridge_ucx::reach::{beyond_this_user, SAME_USER};
use kvbridge_ucx::{Context, ContextConfig, Worker};

#[test]
fn ucx_child() {
    common::child_entry();
}

#[test]
fn a_worker_on_this_user_s_transports_listens_on_no_port_and_one_on_tcp_does() {
    let same_user = SAME_USER.join(",");
    assert!(beyond_this_user(Some(&same_user)).is_empty());
    let before = listening_ports();
    let ctx = Context::new(&ContextConfig::with_tls(&same_user)).expect("context");
    let _w = Worker::new(&ctx).expect("worker");
    assert_eq!(
        listening_ports(),
        before,
        "UCX_TLS={same_user} opened a port"
    );

    let ctx = Context::new(&ContextConfig {
        tls: Some("tcp".into()),
        net_devices: Some("lo".into()),
    })
    .expect("context");
    let _w = Worker::new(&ctx).expect("worker");
    assert!(
        listening_ports().len() > before.len(),
        "a tcp worker opened no port on 127.0.0.1: the check above proves nothing"
    );
}

#[test]
fn two_processes_move_bytes_over_this_user_s_transports() {
    let tls = SAME_USER.join(",");
    let mut target = Target::process(&tls, "ucx_child");
    let mut me = Initiator::to(&tls, &target);
    let body = pattern(3, 1 << 20);
    me.local.write(0, &body).unwrap();
    me.worker
        .put(me.rkey, 4096, &me.local, 0, body.len(), deadline(20))
        .expect("put");
    me.worker.flush(me.ep, deadline(20)).expect("flush");
    assert_eq!(
        target.ask(&format!("SUM 4096 {}", body.len())),
        format!("SUM {}", fnv(&body))
    );
}
