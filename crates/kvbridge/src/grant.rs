//! Who may address a local region and what they may do with it: the grant given at
//! `register`, and the table every incoming batch is checked against.
//!
//! A grant names peers ([`Grant`]) and an [`Access`] mode. The receiver of a batch enforces
//! both wherever it does the copy itself (TCP): a batch that reads a write-only region or
//! writes a read-only one is refused with [`ErrorCode::AccessDenied`] and ends the session,
//! like any other op outside what was granted.
//!
//! Shared memory and cross-memory attach let the *peer* do the copy, so no mode can be
//! enforced on them: a mapped memfd is readable and writable, and a read-only descriptor
//! does not help (a process holding an `O_RDONLY` memfd can reopen it read-write through
//! `/proc/self/fd`, the inode being mode 0777; the test below shows it). A region whose
//! access is not [`Access::ReadWrite`] is therefore never offered over shared memory or
//! cross-memory attach: its batches go over TCP, where the mode holds.
//!
//! A grant may also confine a peer's writes, reads, or both to *windows*
//! ([`Permission::writes_in_windows`], [`Permission::reads_in_windows`]): byte ranges the
//! owner opens and closes again (`Channel::close_window`). A window is open either to one
//! peer (`Channel::open_window`, `Channel::open_peer_window`) or to a *grant token*
//! (`Channel::open_token_window`): a random 128-bit [`GrantToken`] the owner mints per
//! request and hands, out of band, to whoever is to read or write under it, when it does
//! not know which peer that will be. A peer's batch may name a token
//! (`Channel::read_with_grant`); an op on a confined direction is admitted when it lies
//! wholly inside the windows of the token the batch names that allow that direction, or
//! else wholly inside the peer's own; otherwise the batch is refused with `AccessDenied`
//! (counted in `Stats::access_denied`, the first refusal of each peer logged at WARN). A
//! write so refused ends the session; a read does not (it carries no payload: nothing is
//! left on the connection, and the peer's other batches go on). The
//! table records which authenticated peers (the session's id, never a claim of a message)
//! had a batch admitted through a token's windows (`Channel::token_users`), so an
//! application can take a request's "done" only from the peers that read under its grant.
//! A holder's windows on one region never overlap. An owner that opens or closes many at
//! once (the pages of one allocation) does so in one call and one lock of the table
//! (`Channel::open_peer_windows`, `open_token_windows`, `close_windows`), all or none.
//!
//! Closing a window stops new ops at once and returns a [`WindowDrain`] that waits for the
//! ops that had already passed it (writes still landing, read responses still being sent),
//! so the owner can hand the bytes to someone else only when nothing of the old holder can
//! land or be read any more. Windows hold where the receiver does the copy (TCP), so a
//! region with windows, like one with a mode, stays off shared memory, cross-memory attach
//! and UCX, unless its grant says [`Permission::with_direct_copies`]: then same-host peers
//! map it (or copy by address), UCX peers put and get by key, and they reach all of it; the
//! mode and windows hold for TCP peers only (`docs/threat-model.md`). A batch that names a
//! token always goes over TCP (`kvbridge_proto::route::ways`).
//!
//! [`ErrorCode::AccessDenied`]: kvbridge_proto::msg::ErrorCode::AccessDenied

use crate::error::{Error, Result};
use crate::landing::{Landing, LandingHold};
use crate::region::{Region, RegionUse};
use kvbridge_proto::msg::{ErrorCode, MemInfo, OpDesc, RegionInfo};
use kvbridge_proto::{GrantToken, PeerId, RegionId};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A fresh grant token: 128 bits from the operating system's random source.
pub fn new_grant_token() -> GrantToken {
    let mut b = [0u8; GrantToken::LEN];
    // Never all zero (that is what an unset value looks like, and owners refuse it).
    while b == [0; GrantToken::LEN] {
        crate::random::rand_bytes(&mut b);
    }
    GrantToken::from_bytes(b)
}

/// Which peers may address a region.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Grant {
    /// Every peer of the channel.
    #[default]
    AllPeers,
    /// Only these peers.
    Peers(Vec<PeerId>),
}

impl Grant {
    fn allows(&self, peer: &PeerId) -> bool {
        match self {
            Grant::AllPeers => true,
            Grant::Peers(p) => p.contains(peer),
        }
    }

    /// These peers may only read the region.
    pub fn read_only(self) -> Permission {
        self.with_access(Access::ReadOnly)
    }

    /// These peers may only write the region.
    pub fn write_only(self) -> Permission {
        self.with_access(Access::WriteOnly)
    }

    /// These peers get `access` to the region.
    pub fn with_access(self, access: Access) -> Permission {
        Permission {
            peers: self,
            access,
            windowed: false,
            reads_windowed: false,
            direct: false,
        }
    }
}

/// What granted peers may do with a region; also what a window lets pass.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Read and write (what a plain [`Grant`] gives). The only mode offered over shared
    /// memory and cross-memory attach.
    #[default]
    ReadWrite,
    /// Read only: the peer's writes are refused. Carried over TCP only.
    ReadOnly,
    /// Write only: the peer's reads are refused. Carried over TCP only.
    WriteOnly,
}

impl Access {
    /// Whether a transfer that writes (`true`) or reads (`false`) the region is allowed.
    fn allows(self, writes: bool) -> bool {
        match self {
            Access::ReadWrite => true,
            Access::ReadOnly => !writes,
            Access::WriteOnly => writes,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Access::ReadOnly => "read-only",
            Access::WriteOnly => "write-only",
            Access::ReadWrite => "read-write",
        }
    }
}

/// A grant with its access mode: what `Channel::register` takes. A plain [`Grant`] converts
/// into read-write access, so `register(&r, Grant::AllPeers)` keeps its meaning.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Permission {
    /// Who.
    pub peers: Grant,
    /// What they may do.
    pub access: Access,
    /// Writes land only inside windows (see the module doc).
    pub windowed: bool,
    /// Reads are served only from inside windows (see the module doc).
    pub reads_windowed: bool,
    /// Offered over shared memory, cross-memory attach and UCX even with a mode or windows,
    /// which then hold for TCP peers only.
    pub direct: bool,
}

impl From<Grant> for Permission {
    fn from(peers: Grant) -> Self {
        peers.with_access(Access::ReadWrite)
    }
}

impl Permission {
    fn allows(&self, peer: &PeerId) -> bool {
        self.peers.allows(peer)
    }

    /// A peer's writes land only inside windows open to it or to the grant token its batch
    /// names (enforced where the receiver copies: TCP).
    pub fn writes_in_windows(mut self) -> Permission {
        self.windowed = true;
        self
    }

    /// A peer's reads are served only from inside windows open to it or to the grant token
    /// its batch names (enforced where the receiver copies: TCP).
    pub fn reads_in_windows(mut self) -> Permission {
        self.reads_windowed = true;
        self
    }

    /// Offers the region over shared memory, cross-memory attach and UCX despite a mode or
    /// windows: peers reaching it that way then reach all of it, and the restriction holds
    /// for TCP peers only. For a hot path where a same-host peer is trusted as much as a
    /// process of the same user already is (it could ptrace us where the host allows that).
    pub fn with_direct_copies(mut self) -> Permission {
        self.direct = true;
        self
    }

    /// Whether transfers in that direction must lie inside windows.
    fn confined(&self, writes: bool) -> bool {
        if writes {
            self.windowed
        } else {
            self.reads_windowed
        }
    }

    /// Whether a peer may copy by itself (shared memory, cross-memory attach, UCX).
    fn direct_allowed(&self) -> bool {
        self.direct || (self.access == Access::ReadWrite && !self.windowed && !self.reads_windowed)
    }
}

/// An open window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowId(u64);

impl WindowId {
    /// The id as a number (unique within its channel; for bindings that hand ids out).
    pub fn value(self) -> u64 {
        self.0
    }
}

/// The ops still running through closed windows: no new one can pass them.
pub struct WindowDrain(Vec<Arc<Landing>>);

impl WindowDrain {
    /// Whether no op through the windows is running any more.
    pub fn is_drained(&self) -> bool {
        self.0.iter().all(|l| l.count() == 0)
    }

    /// Waits until no op through the windows is running: no write landing, no read
    /// response being sent. Each is bounded by the channel's payload deadline (past it its
    /// session ends and the op with it), so this returns within about the op deadline;
    /// callers still bound it.
    pub async fn drained(&self) {
        for l in &self.0 {
            l.drained().await;
        }
    }

    fn running(&self) -> usize {
        self.0.iter().map(|l| l.count()).sum()
    }
}

impl std::fmt::Debug for WindowDrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WindowDrain({} running)", self.running())
    }
}

/// The windows of a grant token, closed together (`Channel::close_token`).
#[derive(Debug)]
pub struct ClosedGrant {
    /// The ops that had passed the token's windows and may still be running.
    pub drain: WindowDrain,
    /// The authenticated peers that had a batch admitted through the token's windows, in
    /// peer-id order. Complete: an op admitted before the close recorded its peer first.
    pub users: Vec<PeerId>,
}

/// Whom a window is open to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    Peer(PeerId),
    Token(GrantToken),
}

struct Window {
    id: WindowId,
    end: u64,
    access: Access,
    uses: Arc<Landing>,
}

/// One holder's windows on one region, by start offset; they never overlap.
type Windows = BTreeMap<u64, Window>;

/// Holds on every window of `ws` that `offset..offset+len` passes through, when windows that
/// allow the direction (`writes`) cover it without a gap.
fn cover(ws: Option<&Windows>, offset: u64, len: u64, writes: bool) -> Option<Vec<LandingHold>> {
    let ws = ws?;
    let end = offset.checked_add(len)?;
    let mut holds = Vec::new();
    if len == 0 {
        return Some(holds);
    }
    let mut pos = offset;
    while pos < end {
        let (_, w) = ws.range(..=pos).next_back()?;
        if w.end <= pos || !w.access.allows(writes) {
            return None;
        }
        holds.push(LandingHold::new(&w.uses));
        pos = w.end;
    }
    Some(holds)
}

struct Entry {
    region: Region,
    permission: Permission,
    /// Per peer, the windows open to it.
    by_peer: HashMap<PeerId, Windows>,
    /// Per grant token, the windows open to it.
    by_token: HashMap<GrantToken, Windows>,
}

impl Entry {
    fn windows_of_mut(&mut self, holder: &Holder) -> Option<&mut Windows> {
        match holder {
            Holder::Peer(p) => self.by_peer.get_mut(p),
            Holder::Token(t) => self.by_token.get_mut(t),
        }
    }

    fn forget_if_empty(&mut self, holder: &Holder) {
        match holder {
            Holder::Peer(p) => {
                if self.by_peer.get(p).is_some_and(BTreeMap::is_empty) {
                    self.by_peer.remove(p);
                }
            }
            Holder::Token(t) => {
                if self.by_token.get(t).is_some_and(BTreeMap::is_empty) {
                    self.by_token.remove(t);
                }
            }
        }
    }

    /// The region in use for one op of `peer` (its bounds and grant checked), counted in the
    /// windows it passes when the direction is confined. `Ok((use, through_token))`.
    fn admit(
        &self,
        peer: &PeerId,
        grant: Option<&GrantToken>,
        op: &OpDesc,
        writes: bool,
    ) -> std::result::Result<(RegionUse, bool), Denied> {
        let p = &self.permission;
        if !p.access.allows(writes) {
            return Err(Denied::Mode(p.access));
        }
        if !self.region.contains(op.offset, op.len) {
            return Err(Denied::OutOfBounds {
                region_len: self.region.len() as u64,
            });
        }
        let begin = || {
            if writes {
                self.region.begin_write()
            } else {
                self.region.begin_use()
            }
        };
        if !p.confined(writes) {
            return Ok((begin(), false));
        }
        let by_token = grant.and_then(|t| cover(self.by_token.get(t), op.offset, op.len, writes));
        let through_token = by_token.is_some();
        let holds = by_token
            .or_else(|| cover(self.by_peer.get(peer), op.offset, op.len, writes))
            .ok_or(Denied::OutsideWindows {
                offset: op.offset,
                len: op.len,
                writes,
                token: grant.is_some(),
            })?;
        Ok((begin().within(holds), through_token))
    }
}

/// What the table knows of a grant token while it has windows open.
#[derive(Default)]
struct TokenRecord {
    windows: HashSet<WindowId>,
    /// The peers that had a batch admitted through the token's windows. Written under the
    /// table's read lock (admissions run side by side), read under its write lock.
    users: Mutex<BTreeSet<PeerId>>,
}

#[derive(Default)]
struct Tables {
    regions: HashMap<RegionId, Entry>,
    /// Where each open window is: region, holder, start.
    windows: HashMap<WindowId, (RegionId, Holder, u64)>,
    /// The tokens with windows open.
    tokens: HashMap<GrantToken, TokenRecord>,
    next_window: u64,
}

impl Tables {
    /// Takes an open window out of every index; `None` when it is not open.
    fn take_window(&mut self, wid: WindowId) -> Option<Window> {
        let (id, holder, start) = self.windows.remove(&wid)?;
        if let Holder::Token(t) = &holder {
            if let Some(rec) = self.tokens.get_mut(t) {
                rec.windows.remove(&wid);
            }
        }
        let e = self.regions.get_mut(&id)?;
        let ws = e.windows_of_mut(&holder)?;
        let w = ws.remove(&start).filter(|w| w.id == wid)?;
        e.forget_if_empty(&holder);
        Some(w)
    }
}

/// Refuses a window of `access` on a region whose grant confines neither direction it names
/// (it would change nothing).
fn check_window_access(id: &RegionId, p: &Permission, access: Access) -> Result<()> {
    let matters = (access.allows(true) && p.windowed) || (access.allows(false) && p.reads_windowed);
    if matters {
        return Ok(());
    }
    Err(Error::Local(format!(
        "a {} window on region {id}, which was registered with neither {}: it would change \
         nothing",
        access.name(),
        match access {
            Access::ReadOnly => "reads_in_windows",
            Access::WriteOnly => "writes_in_windows",
            Access::ReadWrite => "writes_in_windows nor reads_in_windows",
        }
    )))
}

/// Why a peer's op on a region is refused, for its `Reject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No such region, or not granted to this peer (the two are not told apart).
    NotGranted,
    /// Granted, but not for this direction.
    Mode(Access),
    /// Reaches outside its region.
    OutOfBounds {
        /// The region's length.
        region_len: u64,
    },
    /// Outside the windows open to this peer (and to the token its batch names).
    OutsideWindows {
        /// First byte.
        offset: u64,
        /// Length.
        len: u64,
        /// The op writes.
        writes: bool,
        /// The batch named a grant token.
        token: bool,
    },
}

impl Denied {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            Denied::NotGranted => ErrorCode::UnknownRegion,
            Denied::OutOfBounds { .. } => ErrorCode::OutOfBounds,
            Denied::Mode(_) | Denied::OutsideWindows { .. } => ErrorCode::AccessDenied,
        }
    }

    pub(crate) fn message(&self, op: usize, o: &OpDesc, writes: bool) -> String {
        let region = o.region;
        match self {
            Denied::NotGranted => format!("op {op}: region {region} is not granted to this peer"),
            Denied::Mode(a) => format!(
                "op {op}: region {region} is granted {} to this peer: {} refused",
                a.name(),
                if writes { "writes" } else { "reads" }
            ),
            Denied::OutOfBounds { region_len } => format!(
                "op {op}: {} bytes at offset {} outside region {region} of {region_len} bytes",
                o.len, o.offset
            ),
            Denied::OutsideWindows {
                offset,
                len,
                writes,
                token,
            } => format!(
                "op {op}: {len} bytes at offset {offset} of region {region} are outside the \
                 ranges open to this peer{} for {}",
                if *token {
                    " or to the grant token its batch names"
                } else {
                    ""
                },
                if *writes { "writing" } else { "reading" }
            ),
        }
    }
}

/// Refusals for a mode or windows: counted, and the first of each peer logged at WARN.
#[derive(Default)]
struct DenialLog {
    count: AtomicU64,
    /// Peers already warned about (at most [`DenialLog::MAX_PEERS`]; past that, peers not in
    /// it are logged at debug).
    warned: Mutex<HashSet<PeerId>>,
}

impl DenialLog {
    const MAX_PEERS: usize = 4096;

    fn note(&self, peer: &PeerId, message: &str, ends_session: bool) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let first = {
            let mut w = self.warned.lock().unwrap_or_else(|p| p.into_inner());
            w.len() < Self::MAX_PEERS && w.insert(peer.clone())
        };
        let outcome = if ends_session {
            "its session ended"
        } else {
            "its session goes on"
        };
        if first {
            tracing::warn!(%peer, "a batch refused (AccessDenied), {outcome}: {message} \
                (later refusals of this peer are logged at debug and counted in Stats::access_denied)");
        } else {
            tracing::debug!(%peer, "a batch refused (AccessDenied), {outcome}: {message}");
        }
    }
}

/// The channel's local regions, who may address them, and the windows open on them.
/// Written by `register`, `deregister` and the window calls only; a region is in the table
/// before any peer can learn its id.
#[derive(Default)]
pub(crate) struct RegionTable {
    map: RwLock<Tables>,
    denials: DenialLog,
}

impl RegionTable {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        self.map.read().expect("region table poisoned")
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.map.write().expect("region table poisoned")
    }

    pub(crate) fn insert(&self, r: Region, p: Permission) -> Result<()> {
        let mut t = self.write();
        if t.regions.contains_key(&r.id()) {
            return Err(Error::Local(format!(
                "region {} already registered",
                r.id()
            )));
        }
        t.regions.insert(
            r.id(),
            Entry {
                region: r,
                permission: p,
                by_peer: HashMap::new(),
                by_token: HashMap::new(),
            },
        );
        Ok(())
    }

    pub(crate) fn remove(&self, id: &RegionId) -> Option<Region> {
        let mut t = self.write();
        let e = t.regions.remove(id)?;
        let gone: Vec<WindowId> = (t.windows.iter())
            .filter(|(_, (r, _, _))| r == id)
            .map(|(w, _)| *w)
            .collect();
        for wid in gone {
            if let Some((_, Holder::Token(tok), _)) = t.windows.remove(&wid) {
                if let Some(rec) = t.tokens.get_mut(&tok) {
                    rec.windows.remove(&wid);
                    if rec.windows.is_empty() {
                        t.tokens.remove(&tok);
                    }
                }
            }
        }
        Some(e.region)
    }

    /// Opens a window of `len` bytes at `offset` of region `id` to `peer`'s ops of `access`.
    pub(crate) fn open_peer_window(
        &self,
        id: &RegionId,
        peer: &PeerId,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<WindowId> {
        let holder = Holder::Peer(peer.clone());
        Ok(self.open(id, holder, &[(offset, len)], access)?[0])
    }

    /// Opens one window per `(offset, len)` of `ranges` on region `id` to `peer`'s ops of
    /// `access`, all or none, under one lock: the ids in the order of `ranges`.
    pub(crate) fn open_peer_windows(
        &self,
        id: &RegionId,
        peer: &PeerId,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<WindowId>> {
        self.open(id, Holder::Peer(peer.clone()), ranges, access)
    }

    /// Opens a window of `len` bytes at `offset` of region `id` to the ops of `access` of
    /// batches that name `token`.
    pub(crate) fn open_token_window(
        &self,
        id: &RegionId,
        token: &GrantToken,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<WindowId> {
        Ok(self.open_token_windows(id, token, &[(offset, len)], access)?[0])
    }

    /// [`RegionTable::open_peer_windows`] for the batches that name `token`.
    pub(crate) fn open_token_windows(
        &self,
        id: &RegionId,
        token: &GrantToken,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<WindowId>> {
        if token.is_zero() {
            return Err(Error::Local(
                "an all-zero grant token is what an unset value looks like, not a random \
                 token: mint one (kvbridge::new_grant_token)"
                    .into(),
            ));
        }
        self.open(id, Holder::Token(*token), ranges, access)
    }

    /// Opens a window per range to `holder`, or none: every range is checked (inside the
    /// region, not empty, overlapping neither a window of the holder nor another range)
    /// before the first is inserted, all under the table's write lock.
    fn open(
        &self,
        id: &RegionId,
        holder: Holder,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<WindowId>> {
        let mut t = self.write();
        let first = t.next_window;
        let e = t
            .regions
            .get_mut(id)
            .ok_or_else(|| Error::Local(format!("region {id} is not registered")))?;
        check_window_access(id, &e.permission, access)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let mut sorted: Vec<(u64, u64)> = ranges.to_vec();
        sorted.sort_unstable();
        for (k, &(offset, len)) in sorted.iter().enumerate() {
            if len == 0 || !e.region.contains(offset, len) {
                return Err(Error::Local(format!(
                    "window of {len} bytes at offset {offset} is not inside region {id} of {} bytes",
                    e.region.len()
                )));
            }
            if let Some(&(prev, plen)) = k.checked_sub(1).map(|j| &sorted[j]) {
                if prev + plen > offset {
                    return Err(Error::Local(format!(
                        "windows at offsets {prev} ({plen} bytes) and {offset} of region {id} \
                         overlap: one batch opens ranges that do not"
                    )));
                }
            }
            let held = match &holder {
                Holder::Peer(p) => e.by_peer.get(p),
                Holder::Token(tok) => e.by_token.get(tok),
            };
            if let Some((start, w)) = held.and_then(|ws| ws.range(..offset + len).next_back()) {
                if w.end > offset {
                    return Err(Error::Local(format!(
                        "window of {len} bytes at offset {offset} of region {id} overlaps the one \
                         open at {start}..{} to the same holder: close that one first",
                        w.end
                    )));
                }
            }
        }
        let ws = match &holder {
            Holder::Peer(p) => e.by_peer.entry(p.clone()).or_default(),
            Holder::Token(tok) => e.by_token.entry(*tok).or_default(),
        };
        let ids: Vec<WindowId> = (first..first + ranges.len() as u64).map(WindowId).collect();
        for (&(offset, len), &wid) in ranges.iter().zip(&ids) {
            let window = Window {
                id: wid,
                end: offset + len,
                access,
                uses: Arc::default(),
            };
            ws.insert(offset, window);
        }
        t.next_window += ranges.len() as u64;
        if let Holder::Token(tok) = &holder {
            let rec = t.tokens.entry(*tok).or_default();
            rec.windows.extend(ids.iter().copied());
        }
        for (&(offset, _), &wid) in ranges.iter().zip(&ids) {
            t.windows.insert(wid, (*id, holder.clone(), offset));
        }
        Ok(ids)
    }

    /// Closes a window: no op passes it from now on. `None` when it is not open. Closing a
    /// token's last window forgets who used the token.
    pub(crate) fn close_window(&self, wid: WindowId) -> Option<WindowDrain> {
        self.close_windows(&[wid]).pop().flatten()
    }

    /// Closes each window of `wids` under one lock: no op passes any of them from then on.
    /// The drain of each, in the order of `wids`; `None` for one that is not open.
    pub(crate) fn close_windows(&self, wids: &[WindowId]) -> Vec<Option<WindowDrain>> {
        let mut t = self.write();
        wids.iter()
            .map(|&wid| {
                let holder = t.windows.get(&wid).map(|(_, h, _)| h.clone())?;
                let w = t.take_window(wid)?;
                if let Holder::Token(tok) = holder {
                    if t.tokens.get(&tok).is_some_and(|r| r.windows.is_empty()) {
                        t.tokens.remove(&tok);
                    }
                }
                Some(WindowDrain(vec![w.uses]))
            })
            .collect()
    }

    /// Closes every window of `token` at once; `None` when it has none open.
    pub(crate) fn close_token(&self, token: &GrantToken) -> Option<ClosedGrant> {
        let mut t = self.write();
        let rec = t.tokens.remove(token)?;
        let mut uses = Vec::with_capacity(rec.windows.len());
        for wid in rec.windows {
            if let Some(w) = t.take_window(wid) {
                uses.push(w.uses);
            }
        }
        let users = rec
            .users
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .collect();
        Some(ClosedGrant {
            drain: WindowDrain(uses),
            users,
        })
    }

    /// The peers that had a batch admitted through `token`'s windows, while it has any open.
    pub(crate) fn token_users(&self, token: &GrantToken) -> Vec<PeerId> {
        let t = self.read();
        t.tokens
            .get(token)
            .map(|r| {
                let u = r.users.lock().unwrap_or_else(|p| p.into_inner());
                u.iter().cloned().collect()
            })
            .unwrap_or_default()
    }

    /// Admits every op of a batch of `peer` (naming `grant`, if any; `writes`: the batch
    /// writes into our regions) or none: the regions marked in use, in op order, counted in
    /// the windows they pass, atomically with respect to `remove` and the window calls.
    /// When an op passed a token's windows, `peer` is recorded as a user of the token
    /// before the table is let go. The refusal names the first op refused.
    pub(crate) fn admit(
        &self,
        peer: &PeerId,
        grant: Option<&GrantToken>,
        ops: &[OpDesc],
        writes: bool,
    ) -> std::result::Result<Vec<RegionUse>, (usize, Denied)> {
        let t = self.read();
        let mut out = Vec::with_capacity(ops.len());
        let mut through_token = false;
        for (i, op) in ops.iter().enumerate() {
            let e = match t.regions.get(&op.region) {
                Some(e) if e.permission.allows(peer) => e,
                _ => return Err((i, Denied::NotGranted)),
            };
            let (u, via) = e.admit(peer, grant, op, writes).map_err(|d| (i, d))?;
            through_token |= via;
            out.push(u);
        }
        if let (true, Some(tok)) = (through_token, grant) {
            if let Some(rec) = t.tokens.get(tok) {
                let mut users = rec.users.lock().unwrap_or_else(|p| p.into_inner());
                if !users.contains(peer) {
                    users.insert(peer.clone());
                }
            }
        }
        Ok(out)
    }

    /// Counts a batch of `peer` refused for a mode or windows, and logs the first of each
    /// peer at WARN (saying whether the refusal `ends_session`).
    pub(crate) fn note_denied(&self, peer: &PeerId, message: &str, ends_session: bool) {
        self.denials.note(peer, message, ends_session);
    }

    /// Batches refused for a mode or windows since the channel started.
    pub(crate) fn denied(&self) -> u64 {
        self.denials.count.load(Ordering::Relaxed)
    }

    /// The regions granted to `peer` that it may reach directly: the shared ones, and with
    /// `cma` those that cross-memory attach carries too. Only unrestricted grants (or those
    /// that ask for it): the peer copies by itself there, so no mode or window could be
    /// enforced (see the module doc).
    pub(crate) fn direct_copy_regions_for(&self, peer: &PeerId, cma: bool) -> Vec<Region> {
        let t = self.read();
        t.regions
            .values()
            .filter(|e| {
                let r = &e.region;
                e.permission.allows(peer) && (r.is_shared() || (cma && r.wants_cma()))
            })
            .filter(|e| {
                let p = &e.permission;
                let direct = p.direct_allowed();
                if !direct {
                    tracing::debug!(%peer, region = %e.region.id(), access = ?p.access, writes_windowed = p.windowed, reads_windowed = p.reads_windowed, "region not offered over shared memory or cross-memory attach: the peer would copy by itself and its access mode or windows could not be enforced; it is served over TCP");
                }
                direct
            })
            .map(|e| e.region.clone())
            .collect()
    }

    /// The regions granted to `peer` that it may reach over UCX: the unrestricted grants (or
    /// those that ask for direct copies), since the peer then puts and gets by key without
    /// us seeing an op, as over shared memory.
    #[cfg(feature = "ucx")]
    pub(crate) fn ucx_for(&self, peer: &PeerId) -> Vec<Region> {
        let t = self.read();
        t.regions
            .values()
            .filter(|e| e.permission.allows(peer) && e.permission.direct_allowed())
            .map(|e| e.region.clone())
            .collect()
    }

    /// What this side grants to `peer`.
    pub(crate) fn granted_to(&self, peer: &PeerId) -> MemInfo {
        let t = self.read();
        let mut regions: Vec<RegionInfo> = t
            .regions
            .values()
            .filter(|e| e.permission.allows(peer))
            .map(|e| e.region.info())
            .collect();
        regions.sort_by_key(|r| r.id);
        MemInfo { regions }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// Why a read-only descriptor is no read-only grant: whoever holds an `O_RDONLY` memfd
    /// reopens it read-write through `/proc/self/fd`, and can then map it writable.
    #[test]
    fn a_read_only_memfd_descriptor_reopens_read_write() {
        let fd = crate::region::memfd(4096).expect("memfd");
        let open = |path: String, flags| {
            let p = CString::new(path).unwrap();
            // SAFETY: p is a valid C string; open has no other argument here.
            let raw = unsafe { libc::open(p.as_ptr(), flags | libc::O_CLOEXEC) };
            assert!(raw >= 0, "open: {}", std::io::Error::last_os_error());
            // SAFETY: raw is a fresh descriptor that nothing else owns.
            unsafe { OwnedFd::from_raw_fd(raw) }
        };
        let ro = open(format!("/proc/self/fd/{}", fd.as_raw_fd()), libc::O_RDONLY);
        let rw = open(format!("/proc/self/fd/{}", ro.as_raw_fd()), libc::O_RDWR);
        // SAFETY: maps 4096 bytes of an open memfd of that size; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                rw.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "the reopened descriptor maps writable");
        // SAFETY: p maps 4096 bytes.
        unsafe { libc::munmap(p, 4096) };
    }

    /// One op of `len` bytes at `off` of region `id` by `peer`, under `grant`.
    fn use_for(
        t: &RegionTable,
        peer: &PeerId,
        grant: Option<&GrantToken>,
        id: &RegionId,
        off: u64,
        len: u64,
        writes: bool,
    ) -> std::result::Result<RegionUse, Denied> {
        let op = OpDesc {
            region: *id,
            offset: off,
            len,
        };
        t.admit(peer, grant, &[op], writes)
            .map(|mut u| u.pop().unwrap())
            .map_err(|(_, d)| d)
    }

    #[test]
    fn modes_refuse_the_other_direction_only() {
        let t = RegionTable::default();
        let me = PeerId::new("p").unwrap();
        let ro = Region::alloc(4096, 4096).unwrap();
        let wo = Region::alloc(4096, 4096).unwrap();
        let rw = Region::alloc(4096, 4096).unwrap();
        t.insert(ro.clone(), Grant::AllPeers.read_only()).unwrap();
        t.insert(wo.clone(), Grant::AllPeers.write_only()).unwrap();
        t.insert(rw.clone(), Grant::AllPeers.into()).unwrap();
        let use_for = |id: &RegionId, writes| use_for(&t, &me, None, id, 0, 8, writes);
        assert!(use_for(&ro.id(), false).is_ok());
        assert_eq!(
            use_for(&ro.id(), true).err(),
            Some(Denied::Mode(Access::ReadOnly))
        );
        assert!(use_for(&wo.id(), true).is_ok());
        assert_eq!(
            use_for(&wo.id(), false).err(),
            Some(Denied::Mode(Access::WriteOnly))
        );
        assert!(use_for(&rw.id(), true).is_ok());
        assert!(use_for(&rw.id(), false).is_ok());
        // Only the read-write region is offered for direct copies.
        let direct: Vec<_> = t
            .direct_copy_regions_for(&me, true)
            .iter()
            .map(|r| r.id())
            .collect();
        assert_eq!(direct, vec![rw.id()]);
    }

    #[tokio::test]
    async fn windows_confine_writes_and_closing_one_waits_for_what_passed_it() {
        let t = RegionTable::default();
        let (a, b) = (PeerId::new("a").unwrap(), PeerId::new("b").unwrap());
        let r = Region::alloc(4 * 4096, 4096).unwrap();
        t.insert(r.clone(), Grant::AllPeers.write_only().writes_in_windows())
            .unwrap();
        let open = |off, len| t.open_peer_window(&r.id(), &a, off, len, Access::WriteOnly);
        let w1 = open(0, 4096).unwrap();
        let w2 = open(4096, 4096).unwrap();
        let write = |p, off, len| use_for(&t, p, None, &r.id(), off, len, true);
        // Inside, and across two adjacent windows of the same peer.
        assert!(write(&a, 100, 8).is_ok());
        assert!(write(&a, 4000, 200).is_ok());
        // Outside, past the end of the last window, or another peer's.
        for (p, off, len) in [(&a, 8192, 8), (&a, 8000, 400), (&b, 0, 8)] {
            assert!(
                matches!(write(p, off, len), Err(Denied::OutsideWindows { .. })),
                "{p} {off} {len}"
            );
        }
        assert!(matches!(
            write(&a, u64::MAX, 2),
            Err(Denied::OutOfBounds { .. })
        ));
        // A write in flight through w1 holds its drain.
        let landing = write(&a, 0, 8).unwrap();
        let again = landing.again();
        let d = t.close_window(w1).unwrap();
        assert!(t.close_window(w1).is_none());
        assert!(write(&a, 0, 8).is_err(), "closed window passed a write");
        assert!(!d.is_drained());
        drop(landing);
        assert!(!d.is_drained(), "the split part still lands");
        let waiter = tokio::spawn(async move { d.drained().await });
        drop(again);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("drained")
            .unwrap();
        assert!(t.close_window(w2).unwrap().is_drained());
        assert!(open(4 * 4096, 1).is_err());
    }

    /// A batch of windows opens all or none: a range that would fail alone, or two ranges
    /// of the batch that overlap, leave the table as it was; an open batch confines writes
    /// as the windows opened one by one do, and closing it closes each, draining each.
    #[test]
    fn a_batch_of_windows_opens_all_or_none_and_closes_together() {
        let t = RegionTable::default();
        let (a, b) = (PeerId::new("a").unwrap(), PeerId::new("b").unwrap());
        let r = Region::alloc(8 * 4096, 4096).unwrap();
        t.insert(r.clone(), Grant::AllPeers.write_only().writes_in_windows())
            .unwrap();
        t.open_peer_window(&r.id(), &a, 6 * 4096, 4096, Access::WriteOnly)
            .unwrap();
        let write = |p, off| use_for(&t, p, None, &r.id(), off, 8, true);
        let page = |i: u64| (i * 4096, 4096);
        for (case, ranges) in [
            ("a range past the region", vec![page(0), page(8)]),
            ("an empty range", vec![page(0), (4096, 0)]),
            ("two ranges that overlap", vec![page(0), (4000, 200)]),
            ("the same page twice", vec![page(1), page(2), page(1)]),
            ("a range over a window of the peer", vec![page(0), page(6)]),
        ] {
            let err = t.open_peer_windows(&r.id(), &a, &ranges, Access::WriteOnly);
            assert!(err.is_err(), "{case}");
            assert!(
                write(&a, 0).is_err(),
                "{case}: a page of the refused batch opened"
            );
        }
        let tok = new_grant_token();
        let zero = GrantToken::from_bytes([0; GrantToken::LEN]);
        assert!(t
            .open_token_windows(&r.id(), &zero, &[page(0)], Access::WriteOnly)
            .is_err());
        assert!(t
            .open_peer_windows(&r.id(), &a, &[page(0)], Access::ReadOnly)
            .is_err());
        assert_eq!(
            t.open_peer_windows(&r.id(), &a, &[], Access::WriteOnly)
                .unwrap(),
            vec![]
        );
        // Out of order and adjacent: ids follow the ranges.
        let ids = t
            .open_peer_windows(&r.id(), &a, &[page(3), page(0), page(1)], Access::WriteOnly)
            .unwrap();
        assert_eq!(ids.len(), 3);
        for off in [0, 4096, 3 * 4096, 4000] {
            assert!(write(&a, off).is_ok(), "{off}");
        }
        assert!(write(&a, 2 * 4096).is_err(), "a page no range named");
        assert!(write(&b, 0).is_err(), "another peer");
        let by_token = t
            .open_token_windows(&r.id(), &tok, &[page(2), page(4)], Access::WriteOnly)
            .unwrap();
        assert!(use_for(&t, &b, Some(&tok), &r.id(), 4 * 4096, 8, true).is_ok());
        // One write lands through page 0 (ids[1]) while the batch closes it with page 3.
        let landing = write(&a, 0).unwrap();
        let gone = WindowId(u64::MAX);
        let drains = t.close_windows(&[ids[0], gone, ids[1], by_token[1]]);
        assert_eq!(
            drains.iter().map(Option::is_some).collect::<Vec<_>>(),
            vec![true, false, true, true]
        );
        assert!(drains[0].as_ref().unwrap().is_drained());
        assert!(
            !drains[2].as_ref().unwrap().is_drained(),
            "the write through page 0"
        );
        for off in [0, 3 * 4096] {
            assert!(
                write(&a, off).is_err(),
                "a closed window passed a write at {off}"
            );
        }
        assert!(write(&a, 4096).is_ok(), "a window the close did not name");
        assert!(use_for(&t, &b, Some(&tok), &r.id(), 4 * 4096, 8, true).is_err());
        assert!(use_for(&t, &b, Some(&tok), &r.id(), 2 * 4096, 8, true).is_ok());
        drop(landing);
        assert!(drains[2].as_ref().unwrap().is_drained());
        assert!(t.close_windows(&[ids[1]])[0].is_none(), "closed twice");
        // The token's last window closing forgets it, as close_window does.
        t.close_windows(&[by_token[0]]);
        assert!(t.close_token(&tok).is_none());
    }

    /// Reads confined to windows pass only inside the windows of the token the batch names
    /// (allowing reads), or of the peer itself; a token names no one else's windows.
    #[test]
    fn token_windows_confine_reads_to_their_ranges_and_direction() {
        let t = RegionTable::default();
        let (a, b) = (PeerId::new("a").unwrap(), PeerId::new("b").unwrap());
        let r = Region::alloc(8 * 4096, 4096).unwrap();
        t.insert(
            r.clone(),
            Permission::from(Grant::AllPeers)
                .reads_in_windows()
                .writes_in_windows(),
        )
        .unwrap();
        let (tok, other) = (new_grant_token(), new_grant_token());
        t.open_token_window(&r.id(), &tok, 0, 8192, Access::ReadOnly)
            .unwrap();
        t.open_token_window(&r.id(), &other, 16384, 4096, Access::ReadWrite)
            .unwrap();
        t.open_peer_window(&r.id(), &b, 20480, 4096, Access::ReadOnly)
            .unwrap();
        let op = |p, g, off, len, writes| use_for(&t, p, g, &r.id(), off, len, writes);
        // Inside the token's window, by any peer that names it.
        assert!(op(&a, Some(&tok), 0, 8192, false).is_ok());
        assert!(op(&b, Some(&tok), 4096, 100, false).is_ok());
        let outside = |res: std::result::Result<RegionUse, Denied>| {
            matches!(res, Err(Denied::OutsideWindows { .. }))
        };
        for (case, res) in [
            ("no token", op(&a, None, 0, 8, false)),
            ("another token", op(&a, Some(&other), 0, 8, false)),
            (
                "past the window's end",
                op(&a, Some(&tok), 8000, 400, false),
            ),
            (
                "a write through a read window",
                op(&a, Some(&tok), 0, 8, true),
            ),
            ("another peer's window", op(&a, Some(&tok), 20480, 8, false)),
            ("a gap between windows", op(&a, Some(&tok), 8192, 8, false)),
        ] {
            assert!(outside(res), "{case}");
        }
        // A peer's own windows still hold when its batch names a token that misses.
        assert!(op(&b, Some(&tok), 20480, 8, false).is_ok());
        // A read-write token window passes both.
        assert!(op(&a, Some(&other), 16384, 8, true).is_ok());
        assert!(op(&a, Some(&other), 16384, 8, false).is_ok());
        // Reads confined to windows keep the region off every direct way.
        assert!(t.direct_copy_regions_for(&a, true).is_empty());
        #[cfg(feature = "ucx")]
        assert!(t.ucx_for(&a).is_empty());
    }

    /// Users are the peers that had a whole batch admitted through the token's windows:
    /// not one refused, not one that passed through its own windows; all of them at the
    /// close, and forgotten with the token's last window.
    #[test]
    fn token_users_are_the_peers_admitted_through_its_windows() {
        let t = RegionTable::default();
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|p| PeerId::new(p).unwrap());
        let r = Region::alloc(4 * 4096, 4096).unwrap();
        t.insert(
            r.clone(),
            Permission::from(Grant::AllPeers).reads_in_windows(),
        )
        .unwrap();
        let tok = new_grant_token();
        let w = t
            .open_token_window(&r.id(), &tok, 0, 4096, Access::ReadOnly)
            .unwrap();
        t.open_token_window(&r.id(), &tok, 8192, 4096, Access::ReadOnly)
            .unwrap();
        t.open_peer_window(&r.id(), &c, 4096, 4096, Access::ReadOnly)
            .unwrap();
        let op = |off| OpDesc {
            region: r.id(),
            offset: off,
            len: 8,
        };
        assert!(t.admit(&b, Some(&tok), &[op(8192)], false).is_ok());
        assert!(t.admit(&a, Some(&tok), &[op(0)], false).is_ok());
        assert!(t.admit(&a, Some(&tok), &[op(8192)], false).is_ok());
        // Refused as a whole at its second op: no use.
        assert_eq!(
            t.admit(&d, Some(&tok), &[op(0), op(4096)], false)
                .err()
                .map(|(i, _)| i),
            Some(1)
        );
        // Through its own window only.
        assert!(t.admit(&c, Some(&tok), &[op(4096)], false).is_ok());
        assert_eq!(t.token_users(&tok), vec![a.clone(), b.clone()]);
        assert!(t.token_users(&new_grant_token()).is_empty());
        t.close_window(w).unwrap();
        assert_eq!(t.token_users(&tok), vec![a.clone(), b.clone()]);
        let closed = t.close_token(&tok).expect("one window left");
        assert_eq!(closed.users, vec![a.clone(), b]);
        assert!(closed.drain.is_drained());
        assert!(t.close_token(&tok).is_none());
        assert!(t.token_users(&tok).is_empty(), "forgotten with its windows");
        assert!(t.admit(&a, Some(&tok), &[op(0)], false).is_err());
    }

    /// Closing a token waits for the reads that passed any of its windows, and a deregister
    /// forgets the token's windows on that region.
    #[tokio::test]
    async fn closing_a_token_waits_for_its_reads_and_deregister_forgets_its_windows() {
        let t = RegionTable::default();
        let a = PeerId::new("a").unwrap();
        let (r1, r2) = (
            Region::alloc(4096, 4096).unwrap(),
            Region::alloc(4096, 4096).unwrap(),
        );
        for r in [&r1, &r2] {
            t.insert(r.clone(), Grant::AllPeers.read_only().reads_in_windows())
                .unwrap();
        }
        let tok = new_grant_token();
        for r in [&r1, &r2] {
            t.open_token_window(&r.id(), &tok, 0, 4096, Access::ReadOnly)
                .unwrap();
        }
        let reading = use_for(&t, &a, Some(&tok), &r2.id(), 0, 64, false).unwrap();
        let closed = t.close_token(&tok).unwrap();
        assert_eq!(closed.users, vec![a.clone()]);
        assert!(
            !closed.drain.is_drained(),
            "a read response is still being sent"
        );
        let waiter = tokio::spawn(async move { closed.drain.drained().await });
        drop(reading);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("drained")
            .unwrap();
        let w = t
            .open_token_window(&r1.id(), &tok, 0, 4096, Access::ReadOnly)
            .unwrap();
        assert!(t.remove(&r1.id()).is_some());
        assert!(t.close_window(w).is_none());
        assert!(t.close_token(&tok).is_none(), "no window of it is left");
    }

    /// The check alone, without a network: admitting a batch of 64 ops of 4 KiB on a plain
    /// region against the same batch on a region whose reads are confined to windows, one
    /// window per op open to the token (5 repetitions alternated, medians and min-max).
    /// `cargo test --release -p kvbridge --lib admission_cost -- --ignored --nocapture`;
    /// `kvbridge bench grant` measures the same with the network around it.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn admission_cost() {
        const OPS: u64 = 64;
        const ROUNDS: usize = 20_000;
        let t = RegionTable::default();
        let me = PeerId::new("decode-0").unwrap();
        let plain = Region::alloc(OPS as usize * 4096, 4096).unwrap();
        let windowed = Region::alloc(OPS as usize * 4096, 4096).unwrap();
        t.insert(plain.clone(), Grant::AllPeers.into()).unwrap();
        t.insert(
            windowed.clone(),
            Permission::from(Grant::AllPeers).reads_in_windows(),
        )
        .unwrap();
        let tok = new_grant_token();
        for i in 0..OPS {
            t.open_token_window(&windowed.id(), &tok, i * 4096, 4096, Access::ReadOnly)
                .unwrap();
        }
        let ops = |r: &Region| -> Vec<OpDesc> {
            (0..OPS)
                .map(|i| OpDesc {
                    region: r.id(),
                    offset: (i * 7 % OPS) * 4096,
                    len: 4096,
                })
                .collect()
        };
        let (p, w) = (ops(&plain), ops(&windowed));
        let time = |batch: &[OpDesc], grant: Option<&GrantToken>| {
            let start = std::time::Instant::now();
            for _ in 0..ROUNDS {
                drop(t.admit(&me, grant, batch, false).unwrap());
            }
            start.elapsed().as_nanos() as f64 / ROUNDS as f64
        };
        let (mut ps, mut ws) = (Vec::new(), Vec::new());
        for rep in 0..5 {
            if rep % 2 == 0 {
                ps.push(time(&p, None));
                ws.push(time(&w, Some(&tok)));
            } else {
                ws.push(time(&w, Some(&tok)));
                ps.push(time(&p, None));
            }
        }
        let stat = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[0], v[v.len() - 1])
        };
        let ((pm, plo, phi), (wm, wlo, whi)) = (stat(ps), stat(ws));
        println!(
            "admission of {OPS} ops, ns per batch, median (min-max) of 5: plain {pm:.0} \
             ({plo:.0}-{phi:.0}), under a token, one window per op {wm:.0} ({wlo:.0}-{whi:.0}); \
             the windows cost {:.1} ns per op",
            (wm - pm) / OPS as f64
        );
    }

    /// What a window cannot be: overlapping another of its holder, outside its region,
    /// for a direction its region does not confine, or for the all-zero token.
    #[test]
    fn windows_that_cannot_be_are_refused() {
        let t = RegionTable::default();
        let a = PeerId::new("a").unwrap();
        let r = Region::alloc(4 * 4096, 4096).unwrap();
        let plain = Region::alloc(4096, 4096).unwrap();
        t.insert(
            r.clone(),
            Permission::from(Grant::AllPeers).reads_in_windows(),
        )
        .unwrap();
        t.insert(plain.clone(), Grant::AllPeers.into()).unwrap();
        let tok = new_grant_token();
        let open = |off, len, access| t.open_token_window(&r.id(), &tok, off, len, access);
        open(4096, 4096, Access::ReadOnly).unwrap();
        for (case, off, len, access) in [
            ("overlaps its start", 0, 4097, Access::ReadOnly),
            ("overlaps its end", 8191, 2, Access::ReadOnly),
            ("inside it", 5000, 10, Access::ReadWrite),
            ("past the region", 12288, 4097, Access::ReadOnly),
            ("empty", 0, 0, Access::ReadOnly),
            (
                "writes, which the region does not confine",
                0,
                4096,
                Access::WriteOnly,
            ),
        ] {
            assert!(open(off, len, access).is_err(), "{case}");
        }
        // Adjacent ones, and the same range for another holder, are fine.
        open(0, 4096, Access::ReadOnly).unwrap();
        open(8192, 4096, Access::ReadWrite).unwrap();
        t.open_peer_window(&r.id(), &a, 4096, 4096, Access::ReadOnly)
            .unwrap();
        t.open_token_window(&r.id(), &new_grant_token(), 4096, 4096, Access::ReadOnly)
            .unwrap();
        let zero = GrantToken::from_bytes([0; 16]);
        assert!(t
            .open_token_window(&r.id(), &zero, 0, 4096, Access::ReadOnly)
            .is_err());
        assert!(t
            .open_token_window(&plain.id(), &tok, 0, 4096, Access::ReadWrite)
            .is_err());
        assert_ne!(new_grant_token(), new_grant_token());
    }
}
