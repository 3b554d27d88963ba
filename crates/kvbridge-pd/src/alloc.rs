//! The receiver's paged buffer, sans-IO: no sockets, no clock (time is passed in), no
//! memory — only which page belongs to whom.
//!
//! Rules it enforces:
//! - A request reserves *all* its pages at its first allocation, or none: concurrent requests
//!   cannot deadlock on a half-full buffer.
//! - A request that needs more pages than the buffer has is refused at once, naming both
//!   numbers; one that does not fit now waits (FIFO, first fit) until its deadline.
//! - Chunks whose key the buffer already holds (filled by an earlier request and not yet
//!   released) are shared by reference count and not written again.
//! - A page written by a request that ends before it completed goes to *quarantine*: it is
//!   not handed out again until the sender confirms that no write of that request can still
//!   land ([`PageAllocator::fence_acked`], ordered after its writes) or its session is gone
//!   ([`PageAllocator::owner_down`]: the session's reader has stopped).
//! - Pages return on retrieval, on cancel, when the sender fails or restarts, and after the
//!   TTL.
//! - A page can be *pinned*: by a reader borrowing a landed chunk in place
//!   ([`PageAllocator::pin_chunk`]) or by the receiver's own read in flight into it (pull
//!   mode, [`PageAllocator::begin_read`]). A pinned page that would become free is
//!   *draining* instead, and returns only when its last pin is dropped: nothing is reused
//!   under a reader or while a read can still land.
//! - Pull requests (the receiver reads from the sender) need no fence: only the receiver's
//!   own reads can land in their pages, so those pages return as soon as no read is in
//!   flight. A sender's cancel is acknowledged ([`Event::CancelAcked`]) once no read of the
//!   request is in flight; a `finish` is answered ([`Event::Completed`]) once every chunk
//!   was pulled.
//!
//! Every method returns the [`Event`]s the driver must act on (replies, fences, outcomes).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

/// The session that owns a request: a peer and its incarnation. Once that session is down,
/// none of its writes can land any more.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    /// The sender's peer id.
    pub peer: String,
    /// The sender's incarnation (random per process start).
    pub incarnation: u64,
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{:016x}", self.peer, self.incarnation)
    }
}

/// An allocation request, as the allocator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocReq {
    /// The request id (unique among live requests).
    pub req_id: String,
    /// Who will write the pages.
    pub owner: Owner,
    /// Opaque correlation id of the sender's call, handed back in the reply event.
    pub call: u64,
    /// One key hash per chunk, in order.
    pub keys: Vec<u64>,
    /// Prompt tokens (kept for the driver; the allocator only counts pages).
    pub tokens: u64,
    /// Pull mode: the receiver reads the chunks from the sender.
    pub pull: bool,
}

/// One chunk's page in an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Page index in the buffer.
    pub page: u32,
    /// The buffer already holds this chunk (filled by another request): do not send it.
    pub held: bool,
}

/// A granted allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The request.
    pub req_id: String,
    /// Its owner.
    pub owner: Owner,
    /// The sender's call id.
    pub call: u64,
    /// One slot per chunk, in order.
    pub slots: Vec<Slot>,
}

/// Why an allocation was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request needs more pages than the whole buffer has.
    NeverFits {
        /// Pages the request needs.
        needed: u64,
        /// Pages in the buffer.
        total: u64,
    },
    /// The request did not fit before its deadline.
    Timeout {
        /// Pages the request needs.
        needed: u64,
        /// Pages free when it gave up.
        free: u64,
        /// Pages in the buffer.
        total: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// A live request already has this id.
    Duplicate,
    /// The request was cancelled while it waited.
    Cancelled,
    /// The sender's session ended.
    OwnerDown,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NeverFits { needed, total } => write!(
                f,
                "request needs {needed} pages but the whole buffer has {total}; it can never fit"
            ),
            Refusal::Timeout {
                needed,
                free,
                total,
                waited,
            } => write!(
                f,
                "request needs {needed} pages, only {free} of {total} were free after waiting {waited:?}"
            ),
            Refusal::Duplicate => f.write_str("a live request already has this id"),
            Refusal::Cancelled => f.write_str("cancelled while waiting for pages"),
            Refusal::OwnerDown => f.write_str("the sender's session ended"),
        }
    }
}

/// Why a request ended before it completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// Cancelled on the receiver side.
    Cancelled,
    /// Cancelled by its sender.
    SenderCancelled,
    /// Its TTL passed.
    Expired,
    /// Its sender's session ended (failure or restart).
    OwnerDown,
}

/// What the driver must do after a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Send the grant to its owner.
    Granted(Allocation),
    /// Tell the owner its waiting allocation was refused.
    Refused {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
        /// The sender's call id.
        call: u64,
        /// Why.
        refusal: Refusal,
    },
    /// Ask the owner to stop writing the request and confirm (its pages are quarantined).
    Fence {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
    },
    /// A request with pages ended before it completed.
    Ended {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
        /// Why.
        reason: EndReason,
    },
    /// A completed request was dropped after its TTL without being retrieved.
    ExpiredUnretrieved {
        /// The request.
        req_id: String,
    },
    /// Answer the owner's `finish` call: every chunk landed, the request is complete.
    Completed {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
        /// The `finish` call answered.
        call: u64,
    },
    /// Answer the owner's `finish_when_landed` call: the request completes by itself when
    /// its last chunk lands.
    Accepted {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
        /// The `finish_when_landed` call answered.
        call: u64,
    },
    /// Refuse the owner's deferred `finish` call: the request ended first.
    FinishRefused {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
        /// The `finish` call answered.
        call: u64,
        /// Why, for people.
        reason: String,
    },
    /// Tell the owner of a pull request that the receiver gave it up (it should stop
    /// offering chunks). Nothing to wait for: only the receiver's own reads could land.
    Stop {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
    },
    /// Tell the owner of a pull request that no read of it is in flight or will start (the
    /// answer to its cancel): it may reuse the memory it offered.
    CancelAcked {
        /// The request.
        req_id: String,
        /// Its owner.
        owner: Owner,
    },
}

/// Errors of calls about a specific request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReqError {
    /// No live request has this id.
    Unknown,
    /// The caller is not the request's owner.
    NotOwner,
    /// The request is not in the state the call needs.
    WrongState(&'static str),
}

impl fmt::Display for ReqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReqError::Unknown => f.write_str("no such request"),
            ReqError::NotOwner => f.write_str("not the request's owner"),
            ReqError::WrongState(s) => write!(f, "request is {s}"),
        }
    }
}

/// Page counters. `leaked` counts pages in no consistent state and must stay 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Pages in the buffer.
    pub total: u64,
    /// Free pages.
    pub free: u64,
    /// Pages reserved for a write in progress.
    pub reserved: u64,
    /// Pages holding complete chunks.
    pub filled: u64,
    /// Pages of ended requests waiting until no write into them can land.
    pub quarantined: u64,
    /// Pages unaccounted for (a bug if ever non-zero).
    pub leaked: u64,
    /// Requests holding pages.
    pub requests: u64,
    /// Allocations waiting for pages.
    pub waiting: u64,
    /// Pages pinned by a reader or a read in flight (they are also counted in their state;
    /// a pinned page of an ended request is counted as quarantined until unpinned).
    pub pinned: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Page {
    Free,
    Reserved(u64),
    Filled {
        refs: u32,
        key: Option<u64>,
    },
    Quarantined,
    /// No longer anyone's, but pinned: free once the last pin is dropped.
    Draining,
}

/// State of a request holding pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqState {
    /// Pages reserved; the sender is writing.
    Writing,
    /// Every chunk landed.
    Complete,
    /// Being copied out; released by [`PageAllocator::end_retrieve`].
    Retrieving,
}

#[derive(Debug)]
struct Req {
    no: u64,
    owner: Owner,
    keys: Vec<u64>,
    tokens: u64,
    slots: Vec<Slot>,
    state: ReqState,
    expires: Instant,
    /// Per chunk: its bytes are in the page (held, written and announced, or pulled).
    landed: Vec<bool>,
    pull: bool,
    /// Pull: per chunk, a read into its page is in flight.
    reading: Vec<bool>,
    /// Pull: the owner's `finish` call, answered once every chunk landed.
    finish_call: Option<u64>,
    /// Push: the owner's [`PageAllocator::finish_when_landed`] was accepted; the request
    /// completes when its last chunk lands.
    complete_when_landed: bool,
}

/// A live request of `owner` that is still being written.
fn writing<'a>(
    reqs: &'a mut HashMap<String, Req>,
    req_id: &str,
    owner: &Owner,
) -> Result<&'a mut Req, ReqError> {
    let r = reqs.get_mut(req_id).ok_or(ReqError::Unknown)?;
    if &r.owner != owner {
        return Err(ReqError::NotOwner);
    }
    if r.state != ReqState::Writing {
        return Err(ReqError::WrongState("already complete"));
    }
    Ok(r)
}

/// A read of a pull request in flight, from [`PageAllocator::begin_read`] to
/// [`PageAllocator::end_read`]. Its page stays pinned in between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadTicket {
    /// The request.
    pub req_id: String,
    /// Its owner.
    pub owner: Owner,
    /// The chunk.
    pub index: u64,
    /// The page read into.
    pub page: u32,
    /// The grant the read belongs to (a later request with the same id is another grant).
    no: u64,
}

#[derive(Debug)]
struct Waiter {
    req: AllocReq,
    since: Instant,
    deadline: Instant,
}

/// The allocator. See the module docs.
#[derive(Debug)]
pub struct PageAllocator {
    pages: Vec<Page>,
    free: Vec<u32>,
    reqs: HashMap<String, Req>,
    index: HashMap<u64, u32>,
    quarantine: HashMap<(Owner, String), Vec<u32>>,
    waiters: VecDeque<Waiter>,
    alloc_timeout: Duration,
    ttl: Duration,
    next_no: u64,
    /// Per page: readers borrowing it plus reads in flight into it.
    pins: Vec<u32>,
    /// Pull: reads in flight per (owner, request), also after the request ended.
    reads: HashMap<(Owner, String), u32>,
    /// Pull: sender cancels to acknowledge once their reads resolved.
    ack_pending: HashMap<(Owner, String), ()>,
}

impl PageAllocator {
    /// A buffer of `total_pages` pages; waits for pages end after `alloc_timeout`, requests
    /// holding pages expire `ttl` after their grant (or completion).
    pub fn new(total_pages: u32, alloc_timeout: Duration, ttl: Duration) -> Self {
        Self {
            pages: vec![Page::Free; total_pages as usize],
            free: (0..total_pages).rev().collect(),
            reqs: HashMap::new(),
            index: HashMap::new(),
            quarantine: HashMap::new(),
            waiters: VecDeque::new(),
            alloc_timeout,
            ttl,
            next_no: 1,
            pins: vec![0; total_pages as usize],
            reads: HashMap::new(),
            ack_pending: HashMap::new(),
        }
    }

    /// Pages in the buffer.
    pub fn total_pages(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Pages a request with these keys needs now (keys not held).
    fn needed(&self, keys: &[u64]) -> u64 {
        keys.iter().filter(|k| !self.index.contains_key(k)).count() as u64
    }

    /// Asks for pages. Returns the events: a `Granted` or `Refused` now, or nothing when the
    /// request waits (its answer comes from a later call).
    pub fn alloc(&mut self, now: Instant, req: AllocReq) -> Vec<Event> {
        let refuse = |req: AllocReq, refusal| {
            vec![Event::Refused {
                req_id: req.req_id,
                owner: req.owner,
                call: req.call,
                refusal,
            }]
        };
        if self.reqs.contains_key(&req.req_id)
            || self.waiters.iter().any(|w| w.req.req_id == req.req_id)
        {
            return refuse(req, Refusal::Duplicate);
        }
        let needed = self.needed(&req.keys);
        if needed > self.total_pages() {
            let total = self.total_pages();
            return refuse(req, Refusal::NeverFits { needed, total });
        }
        // Waiters come first: a new request may not overtake one that waits for the same pages.
        if self.waiters.is_empty() && needed <= self.free.len() as u64 {
            return vec![Event::Granted(self.grant(now, req))];
        }
        self.waiters.push_back(Waiter {
            req,
            since: now,
            deadline: now + self.alloc_timeout,
        });
        self.serve_waiters(now)
    }

    fn grant(&mut self, now: Instant, req: AllocReq) -> Allocation {
        let no = self.next_no;
        self.next_no += 1;
        let n = req.keys.len();
        let mut slots = Vec::with_capacity(n);
        for k in &req.keys {
            if let Some(&p) = self.index.get(k) {
                if let Page::Filled { refs, .. } = &mut self.pages[p as usize] {
                    *refs += 1;
                    slots.push(Slot {
                        page: p,
                        held: true,
                    });
                    continue;
                }
            }
            // Checked by the caller: enough free pages for every key not held.
            let p = self.free.pop().expect("free pages were counted");
            self.pages[p as usize] = Page::Reserved(no);
            slots.push(Slot {
                page: p,
                held: false,
            });
        }
        self.reqs.insert(
            req.req_id.clone(),
            Req {
                no,
                owner: req.owner.clone(),
                keys: req.keys,
                tokens: req.tokens,
                landed: slots.iter().map(|s| s.held).collect(),
                slots: slots.clone(),
                state: ReqState::Writing,
                expires: now + self.ttl,
                pull: req.pull,
                reading: vec![false; n],
                finish_call: None,
                complete_when_landed: false,
            },
        );
        Allocation {
            req_id: req.req_id,
            owner: req.owner,
            call: req.call,
            slots,
        }
    }

    /// Grants waiters that fit now (FIFO order, first fit).
    fn serve_waiters(&mut self, now: Instant) -> Vec<Event> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() {
            let needed = self.needed(&self.waiters[i].req.keys);
            if needed <= self.free.len() as u64 {
                if let Some(w) = self.waiters.remove(i) {
                    out.push(Event::Granted(self.grant(now, w.req)));
                }
            } else {
                i += 1;
            }
        }
        out
    }

    /// The sender says every chunk of the request landed (its message is ordered after its
    /// writes).
    pub fn complete(&mut self, now: Instant, req_id: &str, owner: &Owner) -> Result<(), ReqError> {
        let r = writing(&mut self.reqs, req_id, owner)?;
        if r.pull && r.landed.iter().any(|l| !l) {
            return Err(ReqError::WrongState(
                "a pull request with chunks not pulled yet",
            ));
        }
        r.state = ReqState::Complete;
        r.landed.iter_mut().for_each(|l| *l = true);
        r.expires = now + self.ttl;
        for (slot, key) in r.slots.iter().zip(&r.keys) {
            if slot.held {
                continue;
            }
            self.pages[slot.page as usize] = Page::Filled {
                refs: 1,
                key: Some(*key),
            };
            self.index.entry(*key).or_insert(slot.page);
        }
        Ok(())
    }

    /// The state of a live request.
    pub fn state(&self, req_id: &str) -> Option<ReqState> {
        self.reqs.get(req_id).map(|r| r.state)
    }

    /// The prompt tokens of a live request.
    pub fn tokens(&self, req_id: &str) -> Option<u64> {
        self.reqs.get(req_id).map(|r| r.tokens)
    }

    /// The chunk key hashes of a live request, in order (as its sender computed them over
    /// its tokens: [`crate::chunk_keys`]).
    pub fn keys(&self, req_id: &str) -> Option<&[u64]> {
        self.reqs.get(req_id).map(|r| r.keys.as_slice())
    }

    /// The owner of a live request.
    pub fn owner(&self, req_id: &str) -> Option<&Owner> {
        self.reqs.get(req_id).map(|r| &r.owner)
    }

    /// Whether a live request is pulled (the receiver reads it; its sender writes nothing).
    pub fn is_pull(&self, req_id: &str) -> Option<bool> {
        self.reqs.get(req_id).map(|r| r.pull)
    }

    /// The slots of a live request.
    pub fn slots(&self, req_id: &str) -> Option<&[Slot]> {
        self.reqs.get(req_id).map(|r| r.slots.as_slice())
    }

    /// Starts copying a complete request out: its pages stay held (and the TTL no longer
    /// applies) until [`PageAllocator::end_retrieve`].
    pub fn begin_retrieve(&mut self, req_id: &str) -> Result<Vec<u32>, ReqError> {
        let r = self.reqs.get_mut(req_id).ok_or(ReqError::Unknown)?;
        match r.state {
            ReqState::Complete => {
                r.state = ReqState::Retrieving;
                Ok(r.slots.iter().map(|s| s.page).collect())
            }
            ReqState::Writing => Err(ReqError::WrongState("still being written")),
            ReqState::Retrieving => Err(ReqError::WrongState("already being retrieved")),
        }
    }

    /// Ends a retrieval: the request's pages return.
    pub fn end_retrieve(&mut self, now: Instant, req_id: &str) -> Result<Vec<Event>, ReqError> {
        match self.reqs.get(req_id).map(|r| r.state) {
            None => Err(ReqError::Unknown),
            Some(ReqState::Retrieving) => {
                let mut out = self.release_landed(req_id, "retrieved");
                out.extend(self.serve_waiters(now));
                Ok(out)
            }
            Some(_) => Err(ReqError::WrongState("not being retrieved")),
        }
    }

    /// Drops one reference of a filled page.
    fn unref(&mut self, page: u32) {
        if let Page::Filled { refs, key } = &mut self.pages[page as usize] {
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                if let Some(k) = key.take() {
                    if self.index.get(&k) == Some(&page) {
                        self.index.remove(&k);
                    }
                }
                self.free_page(page);
            }
        }
    }

    /// A page nobody owns any more: free, or draining while it is pinned.
    fn free_page(&mut self, page: u32) {
        if self.pins[page as usize] > 0 {
            self.pages[page as usize] = Page::Draining;
        } else {
            self.pages[page as usize] = Page::Free;
            self.free.push(page);
        }
    }

    /// The refusal of a deferred `finish` of a request that ends now.
    fn refuse_finish(r: &Req, req_id: &str, why: &str) -> Option<Event> {
        r.finish_call.map(|call| Event::FinishRefused {
            req_id: req_id.to_string(),
            owner: r.owner.clone(),
            call,
            reason: format!(
                "the receiver gave the request up before every chunk was pulled ({why})"
            ),
        })
    }

    /// Releases a request none of whose writes can still land (a pull request's pages that
    /// a read is in flight into drain until it resolves).
    fn release_landed(&mut self, req_id: &str, why: &str) -> Vec<Event> {
        let Some(r) = self.reqs.remove(req_id) else {
            return Vec::new();
        };
        let out = Self::refuse_finish(&r, req_id, why).into_iter().collect();
        for s in r.slots {
            match self.pages[s.page as usize] {
                Page::Reserved(no) if no == r.no => self.free_page(s.page),
                Page::Filled { .. } => self.unref(s.page),
                _ => {}
            }
        }
        out
    }

    /// Ends a request that may still have writes in flight: its reserved pages go to
    /// quarantine until the owner confirms or its session ends. A pull request needs no
    /// fence (only our own reads can land, and their pages drain until they resolve): its
    /// owner is told to stop.
    fn end_writing(&mut self, req_id: &str, reason: EndReason) -> Vec<Event> {
        let pull = match self.reqs.get(req_id) {
            Some(r) => r.pull,
            None => return Vec::new(),
        };
        if pull {
            let owner = self.reqs[req_id].owner.clone();
            let mut out = self.release_landed(req_id, &format!("{reason:?}"));
            out.push(Event::Ended {
                req_id: req_id.to_string(),
                owner: owner.clone(),
                reason,
            });
            out.push(Event::Stop {
                req_id: req_id.to_string(),
                owner,
            });
            return out;
        }
        let Some(r) = self.reqs.remove(req_id) else {
            return Vec::new();
        };
        let mut held = Vec::new();
        for s in &r.slots {
            match self.pages[s.page as usize] {
                Page::Reserved(no) if no == r.no => {
                    self.pages[s.page as usize] = Page::Quarantined;
                    held.push(s.page);
                }
                Page::Filled { .. } => self.unref(s.page),
                _ => {}
            }
        }
        let mut out = vec![Event::Ended {
            req_id: req_id.to_string(),
            owner: r.owner.clone(),
            reason,
        }];
        if !held.is_empty() {
            self.quarantine
                .entry((r.owner.clone(), req_id.to_string()))
                .or_default()
                .extend(held);
            out.push(Event::Fence {
                req_id: req_id.to_string(),
                owner: r.owner,
            });
        }
        out
    }

    /// Cancels a request on the receiver side (the decoder aborted it): a waiting allocation
    /// is refused, a request being written is fenced, a complete one is released.
    pub fn cancel(&mut self, now: Instant, req_id: &str) -> Result<Vec<Event>, ReqError> {
        if let Some(i) = self.waiters.iter().position(|w| w.req.req_id == req_id) {
            let w = self.waiters.remove(i).ok_or(ReqError::Unknown)?;
            return Ok(vec![Event::Refused {
                req_id: w.req.req_id,
                owner: w.req.owner,
                call: w.req.call,
                refusal: Refusal::Cancelled,
            }]);
        }
        let mut out = match self.reqs.get(req_id).map(|r| r.state) {
            None => return Err(ReqError::Unknown),
            Some(ReqState::Writing) => self.end_writing(req_id, EndReason::Cancelled),
            Some(ReqState::Complete) => self.release_landed(req_id, "cancelled"),
            Some(ReqState::Retrieving) => return Err(ReqError::WrongState("being retrieved")),
        };
        out.extend(self.serve_waiters(now));
        Ok(out)
    }

    /// The sender cancelled its request; its message is ordered after all its writes, so
    /// the pages return at once. A waiting allocation is dropped.
    pub fn sender_cancel(
        &mut self,
        now: Instant,
        req_id: &str,
        owner: &Owner,
    ) -> Result<Vec<Event>, ReqError> {
        if let Some(i) = self
            .waiters
            .iter()
            .position(|w| w.req.req_id == req_id && &w.req.owner == owner)
        {
            self.waiters.remove(i);
            return Ok(Vec::new());
        }
        let r = self.reqs.get(req_id).ok_or(ReqError::Unknown)?;
        if &r.owner != owner {
            return Err(ReqError::NotOwner);
        }
        let writing = r.state == ReqState::Writing;
        if r.state == ReqState::Retrieving {
            return Err(ReqError::WrongState("being retrieved"));
        }
        let mut out = self.release_landed(req_id, "cancelled by its sender");
        if writing {
            out.push(Event::Ended {
                req_id: req_id.to_string(),
                owner: owner.clone(),
                reason: EndReason::SenderCancelled,
            });
        }
        out.extend(self.serve_waiters(now));
        Ok(out)
    }

    /// The sender of a pull request gave it up: the request (or its waiting allocation)
    /// ends, and [`Event::CancelAcked`] follows once no read of it is in flight — at once
    /// when none is, also for a request the receiver no longer knows. No read of the request
    /// starts after this call.
    pub fn pull_cancel(&mut self, now: Instant, req_id: &str, owner: &Owner) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some(i) = self
            .waiters
            .iter()
            .position(|w| w.req.req_id == req_id && &w.req.owner == owner)
        {
            self.waiters.remove(i);
        }
        if let Some(r) = self.reqs.get(req_id) {
            if &r.owner == owner && r.state != ReqState::Retrieving {
                let writing = r.state == ReqState::Writing;
                out.extend(self.release_landed(req_id, "cancelled by its sender"));
                if writing {
                    out.push(Event::Ended {
                        req_id: req_id.to_string(),
                        owner: owner.clone(),
                        reason: EndReason::SenderCancelled,
                    });
                }
            }
        }
        let key = (owner.clone(), req_id.to_string());
        if self.reads.get(&key).copied().unwrap_or(0) == 0 {
            out.push(Event::CancelAcked {
                req_id: req_id.to_string(),
                owner: owner.clone(),
            });
        } else {
            self.ack_pending.insert(key, ());
        }
        out.extend(self.serve_waiters(now));
        out
    }

    /// The owner asks to complete the request (its `finish` call `call`). A push request
    /// completes now ([`Event::Completed`]); a pull request completes once every chunk was
    /// pulled and no read is in flight, now or from the [`PageAllocator::end_read`] that
    /// gets it there (a deferred answer; if the request ends first,
    /// [`Event::FinishRefused`]).
    pub fn finish(
        &mut self,
        now: Instant,
        req_id: &str,
        owner: &Owner,
        call: u64,
    ) -> Result<Vec<Event>, ReqError> {
        let r = writing(&mut self.reqs, req_id, owner)?;
        if r.pull && (r.landed.iter().any(|l| !l) || r.reading.iter().any(|x| *x)) {
            if r.finish_call.is_some() {
                return Err(ReqError::WrongState("already finishing"));
            }
            r.finish_call = Some(call);
            return Ok(Vec::new());
        }
        self.complete(now, req_id, owner)?;
        Ok(vec![Event::Completed {
            req_id: req_id.to_string(),
            owner: owner.clone(),
            call,
        }])
    }

    /// Push mode: the owner asks the request to complete by itself once every chunk has
    /// landed (each through [`PageAllocator::chunk_written`], which follows its write), and
    /// to be answered now ([`Event::Accepted`]), so its round trip runs while it writes
    /// instead of after its last write. Until then the request is live as any other: it
    /// ends on a cancel, on its TTL or with its owner's session, and its reader learns so.
    /// When every chunk landed already, this is [`PageAllocator::finish`].
    pub fn finish_when_landed(
        &mut self,
        now: Instant,
        req_id: &str,
        owner: &Owner,
        call: u64,
    ) -> Result<Vec<Event>, ReqError> {
        let r = writing(&mut self.reqs, req_id, owner)?;
        if r.pull {
            return Err(ReqError::WrongState(
                "a pull request (the receiver reads it)",
            ));
        }
        if r.complete_when_landed {
            return Err(ReqError::WrongState("already finishing"));
        }
        if r.landed.iter().all(|l| *l) {
            return self.finish(now, req_id, owner, call);
        }
        r.complete_when_landed = true;
        Ok(vec![Event::Accepted {
            req_id: req_id.to_string(),
            owner: owner.clone(),
            call,
        }])
    }

    /// Push mode: the owner says chunk `index` landed (its message is ordered after the
    /// write), so a reader may borrow it before the whole request is complete. After an
    /// accepted [`PageAllocator::finish_when_landed`], the last chunk to land completes the
    /// request.
    pub fn chunk_written(
        &mut self,
        now: Instant,
        req_id: &str,
        owner: &Owner,
        index: u64,
    ) -> Result<(), ReqError> {
        let r = self.reqs.get_mut(req_id).ok_or(ReqError::Unknown)?;
        if &r.owner != owner {
            return Err(ReqError::NotOwner);
        }
        if r.pull {
            return Err(ReqError::WrongState(
                "a pull request (the receiver reads it)",
            ));
        }
        if r.state != ReqState::Writing {
            return Err(ReqError::WrongState("already complete"));
        }
        let l = r
            .landed
            .get_mut(index as usize)
            .ok_or(ReqError::WrongState("without that chunk"))?;
        *l = true;
        if r.complete_when_landed && r.landed.iter().all(|l| *l) {
            self.complete(now, req_id, owner)?;
        }
        Ok(())
    }

    /// Per chunk of a live request: whether its bytes are in its page.
    pub fn landed(&self, req_id: &str) -> Option<&[bool]> {
        self.reqs.get(req_id).map(|r| r.landed.as_slice())
    }

    /// Pins the page of a landed chunk for a reader: it is not reused until
    /// [`PageAllocator::unpin`], whatever happens to the request meanwhile.
    pub fn pin_chunk(&mut self, req_id: &str, index: u64) -> Result<u32, ReqError> {
        let r = self.reqs.get(req_id).ok_or(ReqError::Unknown)?;
        match r.landed.get(index as usize) {
            None => return Err(ReqError::WrongState("without that chunk")),
            Some(false) => return Err(ReqError::WrongState("still waiting for that chunk")),
            Some(true) => {}
        }
        let page = r.slots[index as usize].page;
        match self.pages[page as usize] {
            Page::Reserved(no) if no == r.no => {}
            Page::Filled { .. } => {}
            _ => return Err(ReqError::WrongState("inconsistent (page not held)")),
        }
        self.pins[page as usize] += 1;
        Ok(page)
    }

    /// Pins the filled page holding the chunk with key hash `key`, if the buffer holds it.
    pub fn pin_key(&mut self, key: u64) -> Option<u32> {
        let &page = self.index.get(&key)?;
        match self.pages[page as usize] {
            Page::Filled { .. } => {
                self.pins[page as usize] += 1;
                Some(page)
            }
            _ => None,
        }
    }

    /// Drops one pin of `page`; a draining page with no pin left returns.
    pub fn unpin(&mut self, now: Instant, page: u32) -> Vec<Event> {
        let Some(n) = self.pins.get_mut(page as usize) else {
            return Vec::new();
        };
        *n = n.saturating_sub(1);
        if *n == 0 && self.pages[page as usize] == Page::Draining {
            self.pages[page as usize] = Page::Free;
            self.free.push(page);
            return self.serve_waiters(now);
        }
        Vec::new()
    }

    /// Pull mode: starts the receiver's read of chunk `index` (offered by `owner`). Only
    /// for a pull request still being written, a chunk not landed and not being read. The
    /// page stays pinned, and the request's in-flight read counted, until
    /// [`PageAllocator::end_read`]; no read can start once the request ended.
    pub fn begin_read(
        &mut self,
        req_id: &str,
        owner: &Owner,
        index: u64,
    ) -> Result<ReadTicket, ReqError> {
        let r = self.reqs.get_mut(req_id).ok_or(ReqError::Unknown)?;
        if &r.owner != owner {
            return Err(ReqError::NotOwner);
        }
        if !r.pull {
            return Err(ReqError::WrongState(
                "a push request (its sender writes it)",
            ));
        }
        if r.state != ReqState::Writing {
            return Err(ReqError::WrongState("already complete"));
        }
        let i = index as usize;
        match (r.landed.get(i), r.reading.get(i)) {
            (None, _) | (_, None) => return Err(ReqError::WrongState("without that chunk")),
            (Some(true), _) => return Err(ReqError::WrongState("holding that chunk already")),
            (_, Some(true)) => return Err(ReqError::WrongState("already reading that chunk")),
            _ => {}
        }
        r.reading[i] = true;
        let page = r.slots[i].page;
        let no = r.no;
        self.pins[page as usize] += 1;
        *self
            .reads
            .entry((owner.clone(), req_id.to_string()))
            .or_insert(0) += 1;
        Ok(ReadTicket {
            req_id: req_id.to_string(),
            owner: owner.clone(),
            index,
            page,
            no,
        })
    }

    /// Pull mode: the read of `t` resolved (`ok`: every byte landed; otherwise nothing more
    /// of it can land). Returns whether the chunk now counts as pulled (its request is still
    /// live) and the events: a deferred `finish` answered, a cancel acknowledged, a page
    /// that drained returned.
    pub fn end_read(&mut self, now: Instant, t: &ReadTicket, ok: bool) -> (bool, Vec<Event>) {
        let mut out = Vec::new();
        let key = (t.owner.clone(), t.req_id.clone());
        if let Some(n) = self.reads.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.reads.remove(&key);
                if self.ack_pending.remove(&key).is_some() {
                    out.push(Event::CancelAcked {
                        req_id: t.req_id.clone(),
                        owner: t.owner.clone(),
                    });
                }
            }
        }
        let mut pulled = false;
        if let Some(r) = self.reqs.get_mut(&t.req_id) {
            if r.no == t.no {
                let i = t.index as usize;
                r.reading[i] = false;
                if ok {
                    r.landed[i] = true;
                    pulled = true;
                }
                let done = r.landed.iter().all(|l| *l) && !r.reading.iter().any(|x| *x);
                if let (true, Some(call)) = (done, r.finish_call) {
                    r.finish_call = None;
                    let owner = r.owner.clone();
                    if self.complete(now, &t.req_id, &owner).is_ok() {
                        out.push(Event::Completed {
                            req_id: t.req_id.clone(),
                            owner,
                            call,
                        });
                    }
                }
            }
        }
        out.extend(self.unpin(now, t.page));
        (pulled, out)
    }

    /// The owner confirmed that no write of `req_id` can land any more: its quarantined pages
    /// return.
    pub fn fence_acked(&mut self, now: Instant, req_id: &str, owner: &Owner) -> Vec<Event> {
        if let Some(pages) = self.quarantine.remove(&(owner.clone(), req_id.to_string())) {
            self.free_quarantined(pages);
        }
        self.serve_waiters(now)
    }

    /// Whether pages of `req_id` still wait for `owner` to acknowledge a fence.
    pub fn fence_pending(&self, req_id: &str, owner: &Owner) -> bool {
        self.quarantine
            .contains_key(&(owner.clone(), req_id.to_string()))
    }

    fn free_quarantined(&mut self, pages: Vec<u32>) {
        for p in pages {
            if self.pages[p as usize] == Page::Quarantined {
                self.free_page(p);
            }
        }
    }

    /// The owner's session ended (failure, restart or close): its reader has stopped, so none
    /// of its writes can land. Its unfinished requests end and their pages return at once, as
    /// do its quarantined pages; its waiting allocations are dropped. Complete requests stay.
    pub fn owner_down(&mut self, now: Instant, owner: &Owner) -> Vec<Event> {
        let mut out = Vec::new();
        self.waiters.retain(|w| &w.req.owner != owner);
        // Nobody to acknowledge a cancel to any more.
        self.ack_pending.retain(|(o, _), _| o != owner);
        let mut ids: Vec<String> = self
            .reqs
            .iter()
            .filter(|(_, r)| &r.owner == owner && r.state == ReqState::Writing)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        for id in ids {
            out.extend(self.release_landed(&id, "its sender's session ended"));
            out.push(Event::Ended {
                req_id: id,
                owner: owner.clone(),
                reason: EndReason::OwnerDown,
            });
        }
        let keys: Vec<(Owner, String)> = self
            .quarantine
            .keys()
            .filter(|(o, _)| o == owner)
            .cloned()
            .collect();
        for k in keys {
            if let Some(pages) = self.quarantine.remove(&k) {
                self.free_quarantined(pages);
            }
        }
        out.extend(self.serve_waiters(now));
        out
    }

    /// Owners with requests, waits or quarantined pages (to re-check after missed events).
    pub fn owners(&self) -> Vec<Owner> {
        let mut v: Vec<Owner> = self
            .reqs
            .values()
            .map(|r| r.owner.clone())
            .chain(self.waiters.iter().map(|w| w.req.owner.clone()))
            .chain(self.quarantine.keys().map(|(o, _)| o.clone()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Applies deadlines: waits that passed theirs are refused, requests past their TTL end
    /// (fenced when still being written, released when complete).
    pub fn tick(&mut self, now: Instant) -> Vec<Event> {
        let mut out = Vec::new();
        let total = self.total_pages();
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].deadline <= now {
                if let Some(w) = self.waiters.remove(i) {
                    let needed = self.needed(&w.req.keys);
                    out.push(Event::Refused {
                        req_id: w.req.req_id,
                        owner: w.req.owner,
                        call: w.req.call,
                        refusal: Refusal::Timeout {
                            needed,
                            free: self.free.len() as u64,
                            total,
                            waited: now.saturating_duration_since(w.since),
                        },
                    });
                }
            } else {
                i += 1;
            }
        }
        let mut expired: Vec<(String, ReqState)> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.expires <= now && r.state != ReqState::Retrieving)
            .map(|(id, r)| (id.clone(), r.state))
            .collect();
        expired.sort_by(|a, b| a.0.cmp(&b.0));
        for (id, state) in expired {
            if state == ReqState::Writing {
                out.extend(self.end_writing(&id, EndReason::Expired));
            } else {
                out.extend(self.release_landed(&id, "expired"));
                out.push(Event::ExpiredUnretrieved { req_id: id });
            }
        }
        out.extend(self.serve_waiters(now));
        out
    }

    /// The earliest instant at which [`PageAllocator::tick`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiters
            .iter()
            .map(|w| w.deadline)
            .chain(
                self.reqs
                    .values()
                    .filter(|r| r.state != ReqState::Retrieving)
                    .map(|r| r.expires),
            )
            .min()
    }

    /// Counts pages by state and checks that every page is accounted for exactly once.
    pub fn counters(&self) -> Counters {
        let mut c = Counters {
            total: self.total_pages(),
            requests: self.reqs.len() as u64,
            waiting: self.waiters.len() as u64,
            ..Counters::default()
        };
        // Who claims each page.
        let mut reserved_by: Vec<u32> = vec![0; self.pages.len()];
        let mut refs: Vec<u32> = vec![0; self.pages.len()];
        let mut quarantined: Vec<u32> = vec![0; self.pages.len()];
        let mut free: Vec<u32> = vec![0; self.pages.len()];
        for r in self.reqs.values() {
            for s in &r.slots {
                match self.pages.get(s.page as usize) {
                    Some(Page::Reserved(no)) if *no == r.no => reserved_by[s.page as usize] += 1,
                    Some(Page::Filled { .. }) => refs[s.page as usize] += 1,
                    _ => c.leaked += 1,
                }
            }
        }
        for pages in self.quarantine.values() {
            for &p in pages {
                if let Some(q) = quarantined.get_mut(p as usize) {
                    *q += 1;
                }
            }
        }
        for &p in &self.free {
            if let Some(f) = free.get_mut(p as usize) {
                *f += 1;
            }
        }
        for (i, p) in self.pages.iter().enumerate() {
            let ok = match p {
                Page::Free => {
                    c.free += 1;
                    free[i] == 1
                }
                Page::Reserved(_) => {
                    c.reserved += 1;
                    reserved_by[i] == 1
                }
                Page::Filled { refs: n, .. } => {
                    c.filled += 1;
                    *n > 0 && refs[i] == *n
                }
                Page::Quarantined => {
                    c.quarantined += 1;
                    quarantined[i] == 1
                }
                Page::Draining => {
                    c.quarantined += 1;
                    self.pins[i] > 0
                }
            };
            if self.pins[i] > 0 {
                c.pinned += 1;
            }
            let stray = (self.pins[i] > 0 && *p == Page::Free)
                || (free[i] > 0 && *p != Page::Free)
                || (quarantined[i] > 0 && *p != Page::Quarantined);
            if !ok || stray {
                c.leaked += 1;
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(n: u64) -> Owner {
        Owner {
            peer: format!("p{n}"),
            incarnation: n,
        }
    }

    fn req(id: &str, o: u64, keys: &[u64]) -> AllocReq {
        AllocReq {
            req_id: id.into(),
            owner: owner(o),
            call: 1,
            keys: keys.to_vec(),
            tokens: keys.len() as u64,
            pull: false,
        }
    }

    fn pull_req(id: &str, o: u64, keys: &[u64]) -> AllocReq {
        AllocReq {
            pull: true,
            ..req(id, o, keys)
        }
    }

    fn granted(ev: &[Event]) -> Vec<&Allocation> {
        ev.iter()
            .filter_map(|e| match e {
                Event::Granted(g) => Some(g),
                _ => None,
            })
            .collect()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn whole_request_or_nothing_and_never_fits() {
        let t = Instant::now();
        let mut a = PageAllocator::new(4, S, 10 * S);
        let ev = a.alloc(t, req("big", 1, &[1, 2, 3, 4, 5]));
        assert_eq!(
            ev,
            vec![Event::Refused {
                req_id: "big".into(),
                owner: owner(1),
                call: 1,
                refusal: Refusal::NeverFits {
                    needed: 5,
                    total: 4
                }
            }]
        );
        assert_eq!(granted(&a.alloc(t, req("a", 1, &[1, 2, 3]))).len(), 1);
        // Needs 2, only 1 free: waits, holds nothing.
        assert!(a.alloc(t, req("b", 1, &[10, 11])).is_empty());
        assert_eq!(a.counters().free, 1);
        assert_eq!(a.counters().waiting, 1);
        // a completes and is retrieved: b is granted.
        a.complete(t, "a", &owner(1)).unwrap();
        a.begin_retrieve("a").unwrap();
        let ev = a.end_retrieve(t, "a").unwrap();
        assert_eq!(granted(&ev)[0].req_id, "b");
        assert_eq!(a.counters().leaked, 0);
    }

    #[test]
    fn waiter_times_out_naming_sizes() {
        let t = Instant::now();
        let mut a = PageAllocator::new(2, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2]));
        assert!(a.alloc(t, req("b", 1, &[3])).is_empty());
        assert!(a.tick(t + S / 2).is_empty());
        let ev = a.tick(t + S);
        assert!(matches!(
            &ev[0],
            Event::Refused {
                refusal: Refusal::Timeout {
                    needed: 1,
                    free: 0,
                    total: 2,
                    ..
                },
                ..
            }
        ));
        assert_eq!(a.counters().waiting, 0);
    }

    #[test]
    fn held_chunks_are_shared_not_resent() {
        let t = Instant::now();
        let mut a = PageAllocator::new(3, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2]));
        a.complete(t, "a", &owner(1)).unwrap();
        let ev = a.alloc(t, req("b", 2, &[1, 2, 9]));
        let g = granted(&ev)[0];
        assert_eq!(
            g.slots.iter().map(|s| s.held).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(a.counters().filled, 2);
        assert_eq!(a.counters().reserved, 1);
        // a leaves; the shared pages stay for b.
        a.begin_retrieve("a").unwrap();
        a.end_retrieve(t, "a").unwrap();
        assert_eq!(a.counters().filled, 2);
        a.complete(t, "b", &owner(2)).unwrap();
        a.begin_retrieve("b").unwrap();
        a.end_retrieve(t, "b").unwrap();
        let c = a.counters();
        assert_eq!((c.free, c.leaked), (3, 0));
    }

    #[test]
    fn cancelled_write_quarantines_until_fence_or_owner_down() {
        let t = Instant::now();
        let mut a = PageAllocator::new(2, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2]));
        let ev = a.cancel(t, "a").unwrap();
        assert!(ev.contains(&Event::Fence {
            req_id: "a".into(),
            owner: owner(1)
        }));
        assert_eq!(a.counters().quarantined, 2);
        // A new request must not get those pages yet.
        assert!(a.alloc(t, req("b", 2, &[3])).is_empty());
        let ev = a.fence_acked(t, "a", &owner(1));
        assert_eq!(granted(&ev)[0].req_id, "b");
        // Owner down frees quarantine too.
        a.cancel(t, "b").unwrap();
        assert_eq!(a.counters().quarantined, 1);
        a.owner_down(t, &owner(2));
        let c = a.counters();
        assert_eq!((c.free, c.quarantined, c.leaked), (2, 0, 0));
    }

    #[test]
    fn ttl_ends_writing_and_complete_requests() {
        let t = Instant::now();
        let mut a = PageAllocator::new(4, S, 2 * S);
        a.alloc(t, req("w", 1, &[1, 2]));
        a.alloc(t, req("c", 2, &[3, 4]));
        a.complete(t, "c", &owner(2)).unwrap();
        assert_eq!(a.next_deadline(), Some(t + 2 * S));
        let ev = a.tick(t + 2 * S);
        assert!(ev.contains(&Event::ExpiredUnretrieved { req_id: "c".into() }));
        assert!(ev.contains(&Event::Fence {
            req_id: "w".into(),
            owner: owner(1)
        }));
        let c = a.counters();
        assert_eq!((c.free, c.quarantined), (2, 2));
    }

    #[test]
    fn owner_down_frees_writing_keeps_complete() {
        let t = Instant::now();
        let mut a = PageAllocator::new(4, S, 10 * S);
        a.alloc(t, req("w", 1, &[1]));
        a.alloc(t, req("c", 1, &[2]));
        a.complete(t, "c", &owner(1)).unwrap();
        let ev = a.owner_down(t, &owner(1));
        assert!(ev.contains(&Event::Ended {
            req_id: "w".into(),
            owner: owner(1),
            reason: EndReason::OwnerDown
        }));
        assert_eq!(a.state("c"), Some(ReqState::Complete));
        assert_eq!(a.counters().free, 3);
        assert_eq!(a.complete(t, "c", &owner(2)), Err(ReqError::NotOwner));
    }

    #[test]
    fn duplicates_refused() {
        let t = Instant::now();
        let mut a = PageAllocator::new(4, S, 10 * S);
        a.alloc(t, req("x", 1, &[1]));
        assert!(matches!(
            &a.alloc(t, req("x", 1, &[1]))[0],
            Event::Refused {
                refusal: Refusal::Duplicate,
                ..
            }
        ));
    }

    #[test]
    fn borrowed_page_is_not_reused_under_its_reader() {
        let t = Instant::now();
        let mut a = PageAllocator::new(2, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2]));
        // Not landed yet: no borrow.
        assert!(a.pin_chunk("a", 0).is_err());
        a.chunk_written(t, "a", &owner(1), 0).unwrap();
        assert_eq!(a.landed("a"), Some(&[true, false][..]));
        let p = a.pin_chunk("a", 0).unwrap();
        a.complete(t, "a", &owner(1)).unwrap();
        a.begin_retrieve("a").unwrap();
        a.end_retrieve(t, "a").unwrap();
        // The reader still holds page p: it drains, it is not free.
        let c = a.counters();
        assert_eq!((c.free, c.quarantined, c.pinned, c.leaked), (1, 1, 1, 0));
        assert!(
            a.alloc(t, req("b", 2, &[7, 8])).is_empty(),
            "b must wait for p"
        );
        let ev = a.unpin(t, p);
        assert_eq!(granted(&ev)[0].req_id, "b");
        assert_eq!(a.counters().leaked, 0);
    }

    #[test]
    fn pinned_quarantined_page_drains_after_fence() {
        let t = Instant::now();
        let mut a = PageAllocator::new(1, S, 10 * S);
        a.alloc(t, req("a", 1, &[1]));
        a.chunk_written(t, "a", &owner(1), 0).unwrap();
        let p = a.pin_chunk("a", 0).unwrap();
        a.cancel(t, "a").unwrap();
        a.fence_acked(t, "a", &owner(1));
        assert_eq!(a.counters().free, 0);
        a.unpin(t, p);
        let c = a.counters();
        assert_eq!((c.free, c.pinned, c.leaked), (1, 0, 0));
    }

    #[test]
    fn finish_when_landed_answers_at_once_and_completes_with_the_last_chunk() {
        let t = Instant::now();
        let mut a = PageAllocator::new(4, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2, 3]));
        assert_eq!(
            a.finish_when_landed(t, "a", &owner(2), 7),
            Err(ReqError::NotOwner)
        );
        assert_eq!(
            a.finish_when_landed(t, "a", &owner(1), 7).unwrap(),
            vec![Event::Accepted {
                req_id: "a".into(),
                owner: owner(1),
                call: 7
            }]
        );
        assert!(a.finish_when_landed(t, "a", &owner(1), 8).is_err());
        // Chunks land in any order; the request completes with the last of them only.
        a.chunk_written(t, "a", &owner(1), 2).unwrap();
        a.chunk_written(t, "a", &owner(1), 0).unwrap();
        assert_eq!(a.state("a"), Some(ReqState::Writing));
        assert!(a.begin_retrieve("a").is_err());
        a.chunk_written(t, "a", &owner(1), 1).unwrap();
        assert_eq!(a.state("a"), Some(ReqState::Complete));
        a.begin_retrieve("a").unwrap();
        a.end_retrieve(t, "a").unwrap();
        assert_eq!(a.counters().leaked, 0);
        // Every chunk landed already: a plain finish. A pull request: refused.
        a.alloc(t, req("b", 1, &[4]));
        a.chunk_written(t, "b", &owner(1), 0).unwrap();
        assert!(matches!(
            a.finish_when_landed(t, "b", &owner(1), 9).unwrap()[..],
            [Event::Completed { call: 9, .. }]
        ));
        a.alloc(t, pull_req("c", 1, &[5]));
        assert!(a.finish_when_landed(t, "c", &owner(1), 10).is_err());
    }

    #[test]
    fn a_request_finishing_when_landed_still_expires() {
        let t = Instant::now();
        let mut a = PageAllocator::new(2, S, 10 * S);
        a.alloc(t, req("a", 1, &[1, 2]));
        a.finish_when_landed(t, "a", &owner(1), 1).unwrap();
        a.chunk_written(t, "a", &owner(1), 0).unwrap();
        let ev = a.tick(t + 11 * S);
        assert!(
            ev.iter()
                .any(|e| matches!(e, Event::Ended { req_id, .. } if req_id == "a")),
            "{ev:?}"
        );
        assert_eq!(a.state("a"), None);
        assert!(a.chunk_written(t + 11 * S, "a", &owner(1), 1).is_err());
        assert_eq!(a.counters().leaked, 0);
    }

    #[test]
    fn pull_reads_pin_pages_and_defer_finish_and_cancel_ack() {
        let t = Instant::now();
        let mut a = PageAllocator::new(3, S, 10 * S);
        a.alloc(t, pull_req("a", 1, &[1, 2]));
        // Only the owner, only a pull request, one read per chunk.
        assert_eq!(a.begin_read("a", &owner(2), 0), Err(ReqError::NotOwner));
        let r0 = a.begin_read("a", &owner(1), 0).unwrap();
        assert!(a.begin_read("a", &owner(1), 0).is_err());
        assert!(a.chunk_written(t, "a", &owner(1), 1).is_err());
        // Finish before the reads resolved: deferred.
        assert!(a.finish(t, "a", &owner(1), 9).unwrap().is_empty());
        let (pulled, ev) = a.end_read(t, &r0, true);
        assert!(pulled && ev.is_empty());
        let r1 = a.begin_read("a", &owner(1), 1).unwrap();
        let (_, ev) = a.end_read(t, &r1, true);
        assert_eq!(
            ev,
            vec![Event::Completed {
                req_id: "a".into(),
                owner: owner(1),
                call: 9
            }]
        );
        assert_eq!(a.state("a"), Some(ReqState::Complete));

        // A sender cancel while a read is in flight: the page drains, the ack waits.
        a.alloc(t, pull_req("b", 1, &[5]));
        let rb = a.begin_read("b", &owner(1), 0).unwrap();
        let ev = a.pull_cancel(t, "b", &owner(1));
        assert!(!ev.iter().any(|e| matches!(e, Event::CancelAcked { .. })));
        assert!(
            a.begin_read("b", &owner(1), 0).is_err(),
            "no read after the end"
        );
        assert_eq!(a.counters().free, 0, "the page read into is not free");
        assert!(a.alloc(t, req("c", 2, &[6])).is_empty());
        let (pulled, ev) = a.end_read(t, &rb, true);
        assert!(!pulled);
        assert!(ev.contains(&Event::CancelAcked {
            req_id: "b".into(),
            owner: owner(1)
        }));
        assert_eq!(granted(&ev)[0].req_id, "c");
        // Cancel of an unknown request: acknowledged at once.
        assert!(a
            .pull_cancel(t, "zz", &owner(1))
            .contains(&Event::CancelAcked {
                req_id: "zz".into(),
                owner: owner(1)
            }));
        assert_eq!(a.counters().leaked, 0);
    }

    #[test]
    fn pull_request_ended_by_receiver_refuses_deferred_finish_and_stops_sender() {
        let t = Instant::now();
        let mut a = PageAllocator::new(2, S, 2 * S);
        a.alloc(t, pull_req("a", 1, &[1, 2]));
        let r = a.begin_read("a", &owner(1), 0).unwrap();
        a.finish(t, "a", &owner(1), 4).unwrap();
        let ev = a.tick(t + 2 * S);
        assert!(ev
            .iter()
            .any(|e| matches!(e, Event::FinishRefused { call: 4, .. })));
        assert!(ev.iter().any(|e| matches!(e, Event::Stop { .. })));
        assert!(!ev.iter().any(|e| matches!(e, Event::Fence { .. })));
        // Page of chunk 1 is free at once; chunk 0's drains until its read resolves.
        assert_eq!(a.counters().free, 1);
        a.end_read(t, &r, false);
        let c = a.counters();
        assert_eq!((c.free, c.leaked, c.requests), (2, 0, 0));
    }
}
