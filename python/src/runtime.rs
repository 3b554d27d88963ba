//! The process's tokio runtime, shared by every channel.

use std::sync::Mutex;
use tokio::runtime::{Builder, Handle, Runtime};

/// The runtime and the process it was built in: a child made by `fork` inherits the
/// parent's runtime without its threads, so it builds its own.
static RUNTIME: Mutex<Option<(u32, Handle)>> = Mutex::new(None);

/// A handle on the runtime, built on first use (and again in a forked child).
pub(crate) fn handle() -> std::io::Result<Handle> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((owner, h)) = slot.as_ref() {
        if *owner == pid {
            return Ok(h.clone());
        }
    }
    let rt: Runtime = Builder::new_multi_thread()
        .thread_name("kvbridge-rt")
        .enable_all()
        .build()?;
    // Lives as long as the process: channels may outlive any Python object that could own it,
    // and a runtime inherited through fork must not be dropped (its threads do not exist).
    let rt: &'static Runtime = Box::leak(Box::new(rt));
    let h = rt.handle().clone();
    *slot = Some((pid, h.clone()));
    Ok(h)
}
