//! The seam every one-sided transport sits behind, as the data path drives it: a backend
//! says what it can do for a batch ([`OneSided::offer`]), posts it ([`OneSided::post`]) and
//! completes it ([`Posted::complete`]). The data path holds each session's backends as
//! `dyn OneSided` and knows none by name; which one a batch tries first is
//! `kvbridge_proto::route::ways`'s decision. TCP, two-sided, is not behind this seam: the
//! data path falls back to its data connections when every backend declined.
//!
//! A backend's completion means the batch's bytes are in place at the peer (a notification
//! sent afterwards follows them), or that the batch failed; [`Outcome`] says whether bytes
//! of a failed batch may still land, in which case the data path ends the session.

use crate::dir::Dir;
use crate::error::Error;
use crate::region::LocalSlice;
use kvbridge_proto::msg::OpDesc;
use kvbridge_proto::route::Offer;
use kvbridge_proto::PeerId;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// One batch as the data path hands it to a backend: borrowed, so a backend that gives it
/// back has taken nothing.
pub(crate) struct BatchRef<'a> {
    /// The session's peer, named in errors.
    pub(crate) peer: &'a PeerId,
    /// `Write`: `locals` are the sources; `Read`: the destinations.
    pub(crate) dir: Dir,
    /// The peer's ranges, one per local slice.
    pub(crate) descs: &'a [OpDesc],
    /// The local ranges.
    pub(crate) locals: &'a [LocalSlice],
    /// Payload bytes.
    pub(crate) bytes: u64,
    /// The batch's deadline, named in a `Timeout` error.
    pub(crate) deadline: Duration,
    /// When it passes.
    pub(crate) until: tokio::time::Instant,
}

/// How a posted batch ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Its bytes are in place at the peer.
    Done,
    /// Nothing was done (a region is not, or no longer, reached this way): the next way is
    /// tried.
    GivenBack,
    /// It failed and nothing of it lands later.
    Failed(Error),
    /// It failed and some of its operations may still land: the session must end.
    FailedMayLand(Error),
    /// The backend's side of the session ended under the batch (the session is tearing
    /// down); nothing of it lands later. The data path names the session's own error.
    SessionEnded,
}

/// What [`OneSided::run_queued`] did with a batch queued on a data connection.
pub(crate) enum RunQueued {
    /// The backend does not run it (a region is not reached this way, or the backend runs
    /// no batch in a writer): nothing was done, the batch goes over TCP.
    NotHere,
    /// The batch had already ended (the session is tearing down): nothing to run.
    AlreadyEnded,
    /// The batch ran, with this outcome.
    Done(crate::error::Result<()>),
}

/// A batch a backend posted: completed inside `post`, or completing on the backend's agent.
pub(crate) enum Posted<'a> {
    /// Completed inside [`OneSided::post`] (a copy on the calling thread).
    Ended(Outcome),
    /// Completes when this future does; it waits no longer than the batch's `until`.
    Pending(Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>),
}

impl Posted<'_> {
    /// Waits for the batch's outcome.
    pub(crate) async fn complete(self) -> Outcome {
        match self {
            Posted::Ended(o) => o,
            Posted::Pending(f) => f.await,
        }
    }
}

/// A one-sided backend of one session: the peer's regions reached by mapping, by address, or
/// through a fabric's endpoint. Shared by the session's callers, so `&self`.
pub(crate) trait OneSided: Send + Sync {
    /// Its name in logs (one per kind of backend: a session holds at most one of each).
    fn name(&self) -> &'static str;

    /// What it can do for a `dir` batch naming `descs`, looked up without waiting and
    /// without side effects.
    fn offer(&self, dir: Dir, descs: &[OpDesc]) -> Offer;

    /// Whether it reaches at least one of the peer's regions now.
    fn reaches_any(&self) -> bool;

    /// Posts `batch`. The data path calls it with no await between its last check that the
    /// session is open and this call, so a backend that copies inside `post` copies only
    /// while the session holds.
    fn post<'a>(&'a self, batch: BatchRef<'a>) -> Posted<'a>;

    /// Runs a batch queued on a data connection, right in that connection's writer and in
    /// order with its frames, when this backend completes batches in the caller and reaches
    /// every region `descs` names; [`RunQueued::NotHere`], with nothing done, otherwise (the
    /// default: a backend whose batches complete elsewhere). `locals` gives the local ranges
    /// once the batch is known to run here (`None`: the batch already ended). The writer may
    /// run on a thread outside the runtime: the batch runs on the calling thread.
    fn run_queued(
        &self,
        dir: Dir,
        descs: &[OpDesc],
        locals: &mut dyn FnMut() -> Option<Vec<LocalSlice>>,
    ) -> RunQueued {
        let _ = (dir, descs, locals);
        RunQueued::NotHere
    }
}
