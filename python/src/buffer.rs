//! Caller memory from Python objects: the buffer protocol (bytearray, numpy, memoryview)
//! or a tensor's `data_ptr()`.
//!
//! `PyObject_GetBuffer` is part of the stable ABI only from Python 3.11, but exported (with
//! this `Py_buffer` layout, unchanged since 3.3) by every CPython 3.x; the binding targets
//! abi3-py310, so it declares both itself.

use crate::errors;
use pyo3::ffi;
use pyo3::prelude::*;
use std::os::raw::{c_char, c_int, c_void};

#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_C_CONTIGUOUS`: one C-contiguous block (any exporter that cannot give one refuses);
/// without `PyBUF_WRITABLE`, so that a read-only exporter says so in `readonly` instead of
/// refusing.
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | 0x0010 | 0x0008;

/// A buffer export held until drop: the exporter keeps the memory where it is meanwhile (a
/// bytearray cannot be resized, a numpy array cannot be resized in place).
pub(crate) struct HeldBuffer {
    view: Box<RawBuffer>,
}

// SAFETY: the view is only released (with the GIL held) and never read after construction.
unsafe impl Send for HeldBuffer {}
unsafe impl Sync for HeldBuffer {}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released once.
        Python::with_gil(|_| unsafe { PyBuffer_Release(&mut *self.view) });
    }
}

/// What keeps a registered object's memory valid.
// Never read: each variant's user is its `Drop`, which releases the buffer or the reference
// when the registration that holds it goes.
pub(crate) enum Keep {
    /// A buffer export.
    Buffer(#[allow(dead_code)] HeldBuffer),
    /// A reference to an object that owns its memory (a tensor), and to its storage where it
    /// has one (`untyped_storage()`): a tensor moved to other memory (`set_`) leaves the
    /// registered bytes allocated.
    Object(
        #[allow(dead_code)] Py<PyAny>,
        #[allow(dead_code)] Option<Py<PyAny>>,
    ),
}

/// Caller memory found in a Python object.
pub(crate) struct Memory {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    pub(crate) readonly: bool,
    /// What keeps the memory valid (none for a raw pointer: its caller does).
    pub(crate) keep: Option<Keep>,
}

/// The memory of `obj`: through the buffer protocol (C-contiguous), or through
/// `obj.data_ptr()` and `obj.nbytes` (or `numel() * element_size()`) for a contiguous CPU
/// tensor.
pub(crate) fn memory_of(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    let py = obj.py();
    let mut view = Box::new(RawBuffer {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    });
    // SAFETY: obj is a live object (GIL held); view is a zeroed Py_buffer.
    let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_C_CONTIGUOUS) };
    if rc == 0 {
        let mem = Memory {
            ptr: view.buf as usize,
            len: usize::try_from(view.len).unwrap_or(0),
            readonly: view.readonly != 0,
            keep: Some(Keep::Buffer(HeldBuffer { view })),
        };
        return Ok(mem);
    }
    let buffer_error = PyErr::fetch(py);
    if !obj.hasattr("data_ptr")? {
        return Err(errors::invalid(
            py,
            format!(
                "{} gives no C-contiguous buffer and has no data_ptr(): {buffer_error}",
                type_name(obj)
            ),
        ));
    }
    if obj.hasattr("device")? {
        let device = obj.getattr("device")?;
        let kind = device.getattr("type").map_or_else(
            |_| device.str().map(|s| s.to_string()),
            |t| t.str().map(|s| s.to_string()),
        )?;
        if kind != "cpu" {
            return Err(errors::invalid(
                py,
                format!(
                    "{} is on device {kind}: kvbridge registers CPU memory",
                    type_name(obj)
                ),
            ));
        }
    }
    if obj.hasattr("is_contiguous")? && !obj.call_method0("is_contiguous")?.is_truthy()? {
        return Err(errors::invalid(
            py,
            format!("{} is not contiguous", type_name(obj)),
        ));
    }
    // A torch tensor's memory is its storage's. A storage that torch may reallocate
    // (`resize_` past its size frees the old memory) could move under peers still reading
    // and writing the registered range: refused. One that cannot (memory torch did not
    // allocate: `torch.frombuffer`, `torch.from_numpy`) is kept, with the tensor, until the
    // region goes.
    let storage = if obj.hasattr("untyped_storage")? {
        let storage = obj.call_method0("untyped_storage")?;
        if storage.call_method0("resizable")?.is_truthy()? {
            return Err(errors::invalid(
                py,
                format!(
                    "{}'s storage is resizable: torch may move its memory (resize_) while peers \
                     use it; register a tensor over memory torch did not allocate \
                     (torch.frombuffer, torch.from_numpy) or a buffer-protocol object",
                    type_name(obj)
                ),
            ));
        }
        Some(storage.unbind())
    } else {
        None
    };
    let ptr: u64 = obj.call_method0("data_ptr")?.extract()?;
    let len: u64 = if obj.hasattr("nbytes")? {
        obj.getattr("nbytes")?.extract()?
    } else {
        let n: u64 = obj.call_method0("numel")?.extract()?;
        let size: u64 = obj.call_method0("element_size")?.extract()?;
        n.checked_mul(size)
            .ok_or_else(|| errors::invalid(py, "tensor size overflows"))?
    };
    Ok(Memory {
        ptr: usize::try_from(ptr).map_err(|_| errors::invalid(py, "pointer out of range"))?,
        len: usize::try_from(len).map_err(|_| errors::invalid(py, "length out of range"))?,
        readonly: false,
        keep: Some(Keep::Object(obj.clone().unbind(), storage)),
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "object".to_string(), |n| n.to_string())
}
