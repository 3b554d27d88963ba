//! Windows and grant tokens as Python sees them: tokens as 16 `bytes`, checked here; window
//! ids as ints this binding hands out; closes that wait for their drain within a timeout
//! and can be waited on again after one passed.

use crate::errors;
use kvbridge::{Access, Channel, GrantToken, WindowDrain, WindowId};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A grant token argument: `bytes` of exactly 16 bytes, not all zero. `TypeError` for any
/// other type (an int, a str, a bytearray), `InvalidOp` (a `ValueError`) for another length
/// or all zeros.
pub(crate) fn token_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<GrantToken> {
    let Ok(b) = obj.downcast::<PyBytes>() else {
        return Err(PyTypeError::new_err(format!(
            "a grant token must be 16 bytes (e.g. kvbridge.new_grant_token() or \
             secrets.token_bytes(16)), not {}",
            obj.get_type().name()?
        )));
    };
    let bytes: [u8; GrantToken::LEN] = b.as_bytes().try_into().map_err(|_| {
        errors::invalid(
            py,
            format!(
                "a grant token is {} bytes, not {}",
                GrantToken::LEN,
                b.as_bytes().len()
            ),
        )
    })?;
    let token = GrantToken::from_bytes(bytes);
    if token.is_zero() {
        return Err(errors::invalid(
            py,
            "an all-zero grant token is what an unset value looks like, not a random token",
        ));
    }
    Ok(token)
}

/// An optional grant token argument (`None` names none).
pub(crate) fn opt_token_arg(
    py: Python<'_>,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<GrantToken>> {
    match obj {
        Some(o) if !o.is_none() => token_arg(py, o).map(Some),
        _ => Ok(None),
    }
}

/// What `access=` names, for a region or a window.
pub(crate) fn access_arg(py: Python<'_>, access: &str, what: &str) -> PyResult<Access> {
    match access {
        "readwrite" => Ok(Access::ReadWrite),
        "read" => Ok(Access::ReadOnly),
        "write" => Ok(Access::WriteOnly),
        other => Err(errors::invalid(
            py,
            format!("{what} {other:?}: \"readwrite\", \"read\" or \"write\""),
        )),
    }
}

/// A close still waiting for its drain: a window's, or every window of a token's.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Closing {
    Window(u64),
    Token([u8; GrantToken::LEN]),
}

/// What a close has to wait for: the drain, and for a token who used it.
pub(crate) type Draining = (Option<Arc<WindowDrain>>, Vec<String>);

#[derive(Default)]
struct Book {
    /// Open windows by the id Python holds, with the token they are open to.
    open: HashMap<u64, (WindowId, Option<GrantToken>)>,
    /// Closed, and not yet seen drained by a close call.
    draining: HashMap<Closing, Draining>,
}

/// A channel's windows as this binding handed them out.
#[derive(Default)]
pub(crate) struct Windows(Mutex<Book>);

impl Windows {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a window just opened; returns the id Python gets.
    pub(crate) fn opened(&self, id: WindowId, token: Option<GrantToken>) -> u64 {
        self.book().open.insert(id.value(), (id, token));
        id.value()
    }

    /// [`Windows::opened`] for windows opened together.
    pub(crate) fn opened_many(&self, ids: &[WindowId], token: Option<GrantToken>) -> Vec<u64> {
        let mut b = self.book();
        ids.iter()
            .map(|id| {
                b.open.insert(id.value(), (*id, token));
                id.value()
            })
            .collect()
    }

    /// Closes the windows of `ids` this binding opened, under one engine lock, or finds
    /// their closes still draining: each id with what to wait for. An id that is neither
    /// open nor draining (never handed out, or its close already seen drained by another
    /// caller) is left out.
    pub(crate) fn close_windows(&self, ch: &Channel, ids: &[u64]) -> Vec<(u64, Draining)> {
        let mut b = self.book();
        let mut out = Vec::with_capacity(ids.len());
        let mut closing = Vec::new();
        for &id in ids {
            if let Some(d) = b.draining.get(&Closing::Window(id)) {
                out.push((id, d.clone()));
            } else if let Some((wid, _)) = b.open.remove(&id) {
                closing.push((id, wid));
            }
        }
        let wids: Vec<WindowId> = closing.iter().map(|(_, w)| *w).collect();
        for ((id, _), drain) in closing.into_iter().zip(ch.close_windows(&wids)) {
            // `None` from the engine: its region was deregistered, nothing of it runs.
            let d = (drain.map(Arc::new), Vec::new());
            b.draining.insert(Closing::Window(id), d.clone());
            out.push((id, d));
        }
        out
    }

    /// [`Windows::drained_window`] for several.
    pub(crate) fn drained_windows(&self, ids: &[u64]) {
        let mut b = self.book();
        for &id in ids {
            b.draining.remove(&Closing::Window(id));
        }
    }

    /// Closes window `id` (or finds its close still draining): what to wait for, `None`
    /// when this binding never opened it or a close already saw it drained.
    pub(crate) fn close_window(&self, ch: &Channel, id: u64) -> Option<Draining> {
        let mut b = self.book();
        let key = Closing::Window(id);
        if let Some(d) = b.draining.get(&key) {
            return Some(d.clone());
        }
        let (wid, _) = b.open.remove(&id)?;
        // `None` from the engine: its region was deregistered, nothing of it runs.
        let d = (ch.close_window(wid).map(Arc::new), Vec::new());
        b.draining.insert(key, d.clone());
        Some(d)
    }

    /// Closes every window of `token` (or finds that close still draining); `None` when it
    /// has none open.
    pub(crate) fn close_token(&self, ch: &Channel, token: &GrantToken) -> Option<Draining> {
        let mut b = self.book();
        let key = Closing::Token(token.to_bytes());
        if let Some(d) = b.draining.get(&key) {
            return Some(d.clone());
        }
        b.open.retain(|_, (_, t)| t.as_ref() != Some(token));
        let closed = ch.close_token(token)?;
        let users = closed.users.iter().map(|p| p.to_string()).collect();
        let d = (Some(Arc::new(closed.drain)), users);
        b.draining.insert(key, d.clone());
        Some(d)
    }

    /// A close saw its drain end: forget it.
    pub(crate) fn drained_window(&self, id: u64) {
        self.book().draining.remove(&Closing::Window(id));
    }

    /// [`Windows::drained_window`] for a token's close.
    pub(crate) fn drained_token(&self, token: &GrantToken) {
        self.book()
            .draining
            .remove(&Closing::Token(token.to_bytes()));
    }
}
