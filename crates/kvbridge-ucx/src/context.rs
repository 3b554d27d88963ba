//! The UCX context: the library instance that workers and memory registrations belong to.

use std::ffi::CString;
use std::ptr;
use std::sync::Arc;

use kvbridge_ucx_sys as sys;

use crate::error::{Error, Result, Step};
use crate::status::{check, status};

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
    /// Creates a context. UCX reads its environment (`UCX_*`) first; `config` overrides it.
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
        if let Some(tls) = &config.tls {
            modify(&cfg, "TLS", tls)?;
        }
        if let Some(dev) = &config.net_devices {
            modify(&cfg, "NET_DEVICES", dev)?;
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
