//! `kvbridge.digest` and `kvbridge.digest_ranges`: the engine's integrity digest
//! (`kvbridge::digest`, XXH3-64) of caller memory, computed with the GIL released, so that a
//! sender can digest the blocks it writes and a receiver the blocks that landed.

use crate::buffer;
use crate::channel::usize_arg;
use crate::errors;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

/// The integrity digest (XXH3-64, seed 0; ``kvbridge.DIGEST_ALGORITHM``) of ``obj``'s
/// bytes: a C-contiguous buffer-protocol object (bytes, bytearray, memoryview, numpy array)
/// or a contiguous CPU tensor (``data_ptr()`` and ``nbytes``). The buffer export (or the
/// object) is held while the bytes are read, with the GIL released. Raises ``InvalidOp``
/// for an object that gives neither.
#[pyfunction]
pub(crate) fn digest(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let mem = buffer::memory_of(obj)?;
    let (ptr, len) = (mem.ptr, mem.len);
    if len == 0 {
        return Ok(kvbridge::digest::digest(&[]));
    }
    let d = py.allow_threads(|| {
        // SAFETY: `mem.keep` holds the buffer export (or the tensor and its storage) until
        // after this read, so `ptr .. ptr+len` stays the object's memory; the exporter gave
        // it as `len` readable bytes.
        kvbridge::digest::digest(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
    });
    drop(mem);
    Ok(d)
}

/// The digests of many raw ranges of this process's memory, one per ``(address, length)``
/// pair, in order, computed with the GIL released (for a worker that has its KV blocks as
/// tensors' ``data_ptr()``s). A range of length 0 gives the digest of no bytes whatever
/// its address.
///
/// kvbridge cannot check a raw address; the caller guarantees, for the whole call, that
/// every ``address .. address+length`` is memory of this process that is mapped and
/// readable (host memory: not a GPU pointer) and is not freed, unmapped or reallocated
/// meanwhile (its owner, such as a tensor, is kept alive). Breaking that crashes the
/// process (a read of unmapped memory) or digests unrelated memory. Bytes that are written
/// while they are read give a digest of some mix of old and new bytes: digest memory that
/// nothing writes meanwhile.
///
/// Raises ``InvalidOp`` (nothing read) for a null address of a non-empty range, a range
/// that overflows the address space, or a negative or too large integer, and
/// ``TypeError`` for anything that is not a sequence of pairs of ints.
#[pyfunction]
pub(crate) fn digest_ranges(py: Python<'_>, ranges: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if ranges.is_instance_of::<PyString>() || ranges.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "ranges must be a sequence of (address, length) pairs",
        ));
    }
    let mut spans = Vec::with_capacity(ranges.len().unwrap_or(0));
    for (i, item) in ranges.try_iter()?.enumerate() {
        let item = item?;
        let (a, l): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "range {i} must be an (address, length) pair of ints, not {}",
                item.get_type().name().map_or("?".into(), |n| n.to_string())
            ))
        })?;
        let addr = usize_arg(py, &a, &format!("range {i}: address"))?;
        let len = usize_arg(py, &l, &format!("range {i}: length"))?;
        if len > 0 && addr == 0 {
            return Err(errors::invalid(
                py,
                format!("range {i}: null address of {len} bytes"),
            ));
        }
        if addr.checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(errors::invalid(
                py,
                format!("range {i}: {addr:#x} + {len} overflows the address space"),
            ));
        }
        spans.push((addr, len));
    }
    Ok(py.allow_threads(|| {
        spans
            .iter()
            .map(|&(addr, len)| {
                if len == 0 {
                    return kvbridge::digest::digest(&[]);
                }
                // SAFETY: the caller guarantees (docstring) that the range is mapped,
                // readable memory of this process, not freed during the call; it is
                // non-null, within `isize::MAX` bytes and does not wrap (checked above).
                kvbridge::digest::digest(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len)
                })
            })
            .collect()
    }))
}
