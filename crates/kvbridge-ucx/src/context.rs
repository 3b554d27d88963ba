//! The UCX context: the library instance that workers and memory registrations belong to.

use std::ffi::CString;
use std::ptr;
use std::sync::Arc;

use kvbridge_ucx_sys as sys;

use crate::error::{Error, Result, Step};
use crate::reach::TlsSetting;
use crate::status::{check, status};

/// UCX settings a [`Context`] starts from where the environment does not set them: a user's
/// variable always wins. Each entry: the environment variable, the names `ucp_config_modify`
/// may know it by, the value, and the transport whose table holds it (`None`: ucp's own).
/// A transport's setting is given only where the context's `TLS` may open that transport:
/// UCX warns "invalid configuration" at every worker's creation for a setting no opened
/// transport took (a `UCX_TLS=sm,self` worker and the tcp segment sizes). A transport's
/// setting goes by its name without the transport's prefix up to UCX 1.16 (1.13 matches
/// the names it hands to the transports against their tables as they are) and with it from
/// 1.17; releases after 1.18 (1.23 here) refuse a name no table has, so the names are tried
/// in turn. A default no name of which
/// UCX takes is left out: it is tuning, and UCX keeps its own value (1.17 and 1.18 take the
/// unprefixed name without using it and warn "invalid configuration" at worker creation).
///
/// - `UCX_TCP_TX_SEG_SIZE=1M`, `UCX_TCP_RX_SEG_SIZE=1M` (UCX 1.13's defaults: 8K and 64K).
///   UCX 1.13's tcp transport has no `put_short`/`put_bcopy`, so UCX does not select it as an
///   RMA lane and emulates every put with active messages (`rma_am(tcp/lo)` in
///   `UCX_LOG_LEVEL=info`): one message per at most `TX_SEG_SIZE` bytes, each a copy and a
///   `send` on the initiator and a copy plus a completion message back on the target. With
///   8K segments that per-fragment work dominates writes of 64 KiB to 4 MiB; with 1M
///   segments a write of up to 1 MiB is one message. The receive segment must hold a whole
///   send segment. Only the tcp transport has these two settings. The cost is memory: each
///   tcp interface a worker uses grows its pools 8 buffers at a time, 1 MiB per send buffer
///   and 2 MiB per receive buffer (24 MiB per step instead of 1.1 MiB); a worker whose
///   endpoints do not run over tcp allocates none of them.
/// - `UCX_RNDV_THRESH=inf` (UCX's default: `auto`). From UCX 1.14 a put runs as tcp's own
///   `put_zcopy` (the target's socket receives straight into place) once the endpoint has a
///   tcp lane for high-bandwidth remote memory access (`rma_bw`). From UCX 1.20 the wire-up
///   refuses that lane on an endpoint with peer-failure handling, which kvbridge's endpoints
///   ask for, whenever rendezvous is enabled in the context, asking then for memory domains
///   that can invalidate remote access, which tcp's cannot (`ucp_wireup_add_rma_bw_lanes`;
///   1.14-1.19 ask for it on every such endpoint); and it counts rendezvous as enabled by
///   the threshold alone, whether or not the context has the tag or active-message API that
///   rendezvous belongs to. kvbridge's contexts ask for
///   RMA and wake-up only, so no rendezvous ever runs: `inf` changes nothing else and lets
///   the puts over tcp take the zero-copy path (`UCX_PROTO_INFO=y`: "zero-copy, tcp/lo"
///   instead of "software emulation, tcp/lo"), as NIXL's context does with the same
///   setting. UCX 1.13 (Debian 12's) accepts the value and still emulates every put: its tcp
///   transport qualifies for no lane its puts run on (see `UCX_TCP_TX_SEG_SIZE` above).
pub(crate) const DEFAULTS: &[Setting] = &[
    (
        "UCX_TCP_TX_SEG_SIZE",
        &["TX_SEG_SIZE", "TCP_TX_SEG_SIZE"],
        "1M",
        Some("tcp"),
    ),
    (
        "UCX_TCP_RX_SEG_SIZE",
        &["RX_SEG_SIZE", "TCP_RX_SEG_SIZE"],
        "1M",
        Some("tcp"),
    ),
    ("UCX_RNDV_THRESH", &["RNDV_THRESH"], "inf", None),
];

/// One of [`DEFAULTS`]: variable, names, value, transport.
pub(crate) type Setting = (
    &'static str,
    &'static [&'static str],
    &'static str,
    Option<&'static str>,
);

/// The [`DEFAULTS`] to apply (the names to try, the value), given whether the environment
/// sets a variable and the context's `TLS` (`None`: UCX's default, every transport).
fn unset_defaults<'a>(
    is_set: impl Fn(&str) -> bool + 'a,
    tls: Option<&'a str>,
) -> impl Iterator<Item = (&'static [&'static str], &'static str)> + 'a {
    DEFAULTS
        .iter()
        .filter(move |(var, _, _, tl)| !is_set(var) && tl.is_none_or(|tl| may_open(tls, tl)))
        .map(|&(_, names, value, _)| (names, value))
}

/// Whether UCX may open transport `tl` under the `TLS` setting `tls` (`None`: unset, every
/// transport). Of the transports kvbridge sets defaults for, tcp is in no alias but `all`.
fn may_open(tls: Option<&str>, tl: &str) -> bool {
    TlsSetting::read(tls).may_open(tl)
}

/// Sets `value` under the first of `names` UCX takes; whether one did.
fn modify_any(config: &Config, names: &[&str], value: &str) -> bool {
    names.iter().any(|name| modify(config, name, value).is_ok())
}

/// Which UCX transports a context may use. Unset fields fall back to UCX's own environment
/// (`UCX_TLS`, `UCX_NET_DEVICES`), then to its defaults.
#[derive(Debug, Clone, Default)]
pub struct ContextConfig {
    /// UCX's `TLS` setting, e.g. `tcp`, `sm`, `posix,cma,self`, `rc,ud,sm,self`.
    pub tls: Option<String>,
    /// UCX's `NET_DEVICES` setting, e.g. `mlx5_0:1` or `eth0`.
    pub net_devices: Option<String>,
}

impl ContextConfig {
    /// The `TLS` setting a context made from this config runs with: the config's, else
    /// `UCX_TLS` from the environment (`None`: unset, every transport).
    pub fn effective_tls(&self) -> Option<String> {
        self.tls.clone().or_else(|| std::env::var("UCX_TLS").ok())
    }

    /// A config that pins `UCX_TLS` to `tls`.
    pub fn with_tls(tls: &str) -> Self {
        Self {
            tls: Some(tls.to_string()),
            net_devices: None,
        }
    }
}

pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes UCX serialise the
// context-level calls we make on it (`ucp_mem_map`, `ucp_mem_unmap`, `ucp_rkey_pack`,
// `ucp_worker_create`) from any thread; the handle itself is an opaque pointer.
unsafe impl Send for ContextInner {}
// SAFETY: as for `Send`: every call through a shared reference is thread-safe in UCX.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from `ucp_init_version`; workers and memory handles hold an
        // `Arc` of this inner, so none is alive any more.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}

/// A UCX context with one-sided memory access (RMA) and event-fd wake-up. Cheap to clone;
/// dropped when the last worker and region using it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

struct Config(*mut sys::ucp_config_t);

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `ucp_config_read` and is released once.
        unsafe { sys::ucp_config_release(self.0) };
    }
}

fn modify(config: &Config, name: &str, value: &str) -> Result<()> {
    let bad = |_| Error::Ucx {
        step: Step::Config,
        status: status(sys::UCS_ERR_INVALID_PARAM),
    };
    let name = CString::new(name).map_err(bad)?;
    let value = CString::new(value).map_err(bad)?;
    // SAFETY: `config` is a live configuration; both strings are NUL-terminated and outlive
    // the call, which copies them.
    let code = unsafe { sys::ucp_config_modify(config.0, name.as_ptr(), value.as_ptr()) };
    check(code).map_err(|status| Error::Ucx {
        step: Step::Config,
        status,
    })
}

impl Context {
    /// Creates a context. UCX reads its environment (`UCX_*`) first; kvbridge's defaults (see
    /// `DEFAULTS` in this file) fill in what the environment leaves unset; `config` overrides
    /// both.
    pub fn new(config: &ContextConfig) -> Result<Self> {
        let mut raw: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file name mean "the default `UCX_` environment"; `raw` is a
        // valid out-pointer.
        let code = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw) };
        check(code).map_err(|status| Error::Ucx {
            step: Step::Config,
            status,
        })?;
        let cfg = Config(raw);
        let tls = config.effective_tls();
        for (names, value) in unset_defaults(|var| std::env::var_os(var).is_some(), tls.as_deref())
        {
            let _taken = modify_any(&cfg, names, value);
        }
        Self::init(&cfg, config)
    }

    /// Creates a context from `cfg` with `config`'s overrides.
    fn init(cfg: &Config, config: &ContextConfig) -> Result<Self> {
        if let Some(tls) = &config.tls {
            modify(cfg, "TLS", tls)?;
        }
        if let Some(dev) = &config.net_devices {
            modify(cfg, "NET_DEVICES", dev)?;
        }
        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED)
                as u64,
            features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP) as u64,
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `params` and `cfg` are valid for the call; the API version is the one the
        // bindings were generated from (what the `ucp_init` inline passes).
        let code = unsafe {
            sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                cfg.0,
                &mut handle,
            )
        };
        check(code).map_err(|status| Error::Ucx {
            step: Step::Init,
            status,
        })?;
        Ok(Self {
            inner: Arc::new(ContextInner { handle }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Worker;

    #[test]
    fn a_variable_the_environment_sets_keeps_its_value() {
        let all: Vec<_> = unset_defaults(|_| false, None).collect();
        assert_eq!(all.len(), DEFAULTS.len());
        let rest: Vec<_> = unset_defaults(|var| var == "UCX_TCP_TX_SEG_SIZE", None).collect();
        let others: Vec<_> = DEFAULTS[1..].iter().map(|&(_, n, v, _)| (n, v)).collect();
        assert_eq!(rest, others);
        assert_eq!(unset_defaults(|_| true, None).count(), 0);
    }

    /// The tcp segment sizes are given only where tcp may be opened; elsewhere UCX warned
    /// "invalid configurations: TX_SEG_SIZE=1M,RX_SEG_SIZE=1M" at every worker's creation.
    #[test]
    fn a_transport_s_defaults_are_given_only_where_the_tls_may_open_it() {
        let tcp_defaults = |tls: Option<&str>| {
            unset_defaults(|_| false, tls)
                .filter(|(names, _)| names.iter().any(|n| n.contains("SEG_SIZE")))
                .count()
        };
        for tls in [
            None,
            Some(""),
            Some("tcp"),
            Some("all"),
            Some("sm,self,tcp"),
            Some("\\tcp"),
            Some("^rc,ud"),
            Some("rc,tcp:aux"),
        ] {
            assert_eq!(tcp_defaults(tls), 2, "TLS {tls:?} may open tcp");
        }
        for tls in [
            "sm,self",
            "posix,cma,self",
            "^tcp",
            "^rc,tcp",
            "tcpx",
            "rc,ud,sm,self",
        ] {
            assert_eq!(tcp_defaults(Some(tls)), 0, "TLS {tls:?} cannot open tcp");
        }
        // ucp's own settings go to every context.
        assert_eq!(unset_defaults(|_| false, Some("sm,self")).count(), 1);
    }

    fn tcp_worker(settings: &[(&[&str], &str)]) -> Result<Worker> {
        let mut raw: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: as in `Context::new`.
        let code = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw) };
        check(code).expect("ucp_config_read");
        let cfg = Config(raw);
        for (names, value) in settings {
            assert!(modify_any(&cfg, names, value), "UCX took none of {names:?}");
        }
        Worker::new(&Context::init(&cfg, &ContextConfig::with_tls("tcp"))?)
    }

    /// UCX 1.13 keeps names it does not know for the transports' tables and only warns when
    /// none takes one, so a name the tcp transport does not match would be dropped: an
    /// inconsistent pair under the same names must fail the tcp transport, the defaults not.
    #[test]
    fn the_defaults_reach_the_tcp_transport_and_it_accepts_them() {
        let defaults: Vec<_> = unset_defaults(|_| false, Some("tcp")).collect();
        tcp_worker(&defaults).expect("a tcp worker with the defaults");
        let inconsistent = [(DEFAULTS[0].1, "2M"), (DEFAULTS[1].1, "1M")];
        assert!(
            tcp_worker(&inconsistent).is_err(),
            "a send segment larger than the receive segment was not refused: the names do \
             not reach the tcp transport"
        );
    }

    /// A name UCX refuses (as releases after 1.18 refuse one no table has) is skipped for
    /// the next, and a default none of whose names UCX takes is left out.
    #[test]
    fn a_refused_name_falls_through_to_the_next() {
        let mut raw: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: as in `Context::new`.
        let code = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw) };
        check(code).expect("ucp_config_read");
        let cfg = Config(raw);
        // `ADDRESS_VERSION` is ucp's own setting ("v1" or "v2"): every release refuses "1M".
        assert!(!modify_any(&cfg, &["ADDRESS_VERSION"], "1M"));
        assert!(modify_any(
            &cfg,
            &["ADDRESS_VERSION", "TCP_TX_SEG_SIZE"],
            "1M"
        ));
    }
}
