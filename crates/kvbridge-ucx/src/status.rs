//! UCX status codes as [`Status`] values and results.

use std::ffi::CStr;

use kvbridge_ucx_sys as sys;

use crate::error::Status;

/// The text UCX gives a status.
pub(crate) fn status(code: sys::ucs_status_t) -> Status {
    // SAFETY: `ucs_status_string` returns a pointer to a static NUL-terminated string for
    // every value, known or not ("Unknown error" for the latter).
    let text = unsafe { CStr::from_ptr(sys::ucs_status_string(code)) };
    Status {
        code: code as i32,
        text: text.to_string_lossy().into_owned(),
    }
}

/// `Ok` on `UCS_OK`, the status otherwise.
pub(crate) fn check(code: sys::ucs_status_t) -> Result<(), Status> {
    if code == sys::UCS_OK {
        Ok(())
    } else {
        Err(status(code))
    }
}
