//! A UCX worker that processes of other users or other hosts can reach is refused unless the
//! operator declared the fabric trusted: UCX authenticates no peer, and its software puts
//! and gets serve any address (`kvbridge-ucx`'s `forged_bounds.rs` and
//! `scan_only_write.rs` show both). Over `posix,cma,self` UCX runs without the declaration:
//! every `per_transport!` suite's `ucx_posix` carrier does.
#![cfg(feature = "ucx")]

use kvbridge::{Channel, ChannelConfig, Error, Transport};

fn ucx_config(name: &str, tls: Option<&str>, trusted: bool) -> ChannelConfig {
    let mut c = ChannelConfig::new(name, Some("127.0.0.1:0"));
    c.transport = Transport::Ucx;
    c.hooks.ucx_tls = tls.map(str::to_string);
    c.ucx_trusted_fabric = trusted;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_others_can_reach_is_refused_by_name_without_the_declaration() {
    for (tls, named) in [
        ("tcp", "tcp"),
        ("sm,self", "sm"),
        ("posix,sysv,self", "sysv"),
        ("rc,ud,posix,self", "rc, ud"),
        ("all", "all"),
    ] {
        match Channel::new(ucx_config("decode-0", Some(tls), false)).await {
            Err(Error::Local(m)) => assert!(
                m.contains(&format!("opens {named} to"))
                    && m.contains("KVBRIDGE_UCX_TRUSTED_FABRIC=1"),
                "UCX_TLS={tls}: {m}"
            ),
            other => panic!(
                "UCX_TLS={tls}: expected a refusal, got {:?}",
                other.map(|_| ())
            ),
        }
        let ch = Channel::new(ucx_config("decode-0", Some(tls), true))
            .await
            .unwrap_or_else(|e| panic!("UCX_TLS={tls} with the declaration: {e}"));
        ch.close().await;
    }
}

/// The default a user gets with `KVBRIDGE_TRANSPORT=ucx` and no `UCX_TLS`: every transport,
/// refused. Run in a child process so that its `UCX_TLS` is unset whatever the parent's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_ucx_tls_is_refused_without_the_declaration() {
    if std::env::var_os("KVB_REACH_CHILD").is_none() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([
                "an_unset_ucx_tls_is_refused_without_the_declaration",
                "--exact",
                "--nocapture",
            ])
            .env("KVB_REACH_CHILD", "1")
            .env_remove("UCX_TLS")
            .env_remove("KVBRIDGE_UCX_TRUSTED_FABRIC")
            .env("KVBRIDGE_TRANSPORT", "ucx")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "the child failed:\n{text}");
        assert!(text.contains("REFUSED"), "{text}");
        return;
    }
    let c = ChannelConfig::new("decode-0", None);
    assert_eq!(c.transport, Transport::Ucx);
    assert!(!c.ucx_trusted_fabric);
    match Channel::new(c).await {
        Err(Error::Local(m)) => {
            assert!(m.contains("UCX_TLS=unset opens all (UCX_TLS unset)"), "{m}");
            println!("REFUSED: {m}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
}
