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
}

/// One chunk's page in a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Page index in the buffer.
    pub page: u32,
    /// The buffer already holds this chunk (filled by another request): do not send it.
    pub held: bool,
}

/// A granted allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
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
    Granted(Grant),
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Page {
    Free,
    Reserved(u64),
    Filled { refs: u32, key: Option<u64> },
    Quarantined,
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

    fn grant(&mut self, now: Instant, req: AllocReq) -> Grant {
        let no = self.next_no;
        self.next_no += 1;
        let mut slots = Vec::with_capacity(req.keys.len());
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
                slots: slots.clone(),
                state: ReqState::Writing,
                expires: now + self.ttl,
            },
        );
        Grant {
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
        let r = self.reqs.get_mut(req_id).ok_or(ReqError::Unknown)?;
        if &r.owner != owner {
            return Err(ReqError::NotOwner);
        }
        if r.state != ReqState::Writing {
            return Err(ReqError::WrongState("already complete"));
        }
        r.state = ReqState::Complete;
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

    /// The owner of a live request.
    pub fn owner(&self, req_id: &str) -> Option<&Owner> {
        self.reqs.get(req_id).map(|r| &r.owner)
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
                self.release_landed(req_id);
                Ok(self.serve_waiters(now))
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
                self.pages[page as usize] = Page::Free;
                self.free.push(page);
            }
        }
    }

    /// Releases a request none of whose writes can still land.
    fn release_landed(&mut self, req_id: &str) {
        let Some(r) = self.reqs.remove(req_id) else {
            return;
        };
        for s in r.slots {
            match self.pages[s.page as usize] {
                Page::Reserved(no) if no == r.no => {
                    self.pages[s.page as usize] = Page::Free;
                    self.free.push(s.page);
                }
                Page::Filled { .. } => self.unref(s.page),
                _ => {}
            }
        }
    }

    /// Ends a request that may still have writes in flight: its reserved pages go to
    /// quarantine until the owner confirms or its session ends.
    fn end_writing(&mut self, req_id: &str, reason: EndReason) -> Vec<Event> {
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
            Some(ReqState::Complete) => {
                self.release_landed(req_id);
                Vec::new()
            }
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
        self.release_landed(req_id);
        let mut out = Vec::new();
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
                self.pages[p as usize] = Page::Free;
                self.free.push(p);
            }
        }
    }

    /// The owner's session ended (failure, restart or close): its reader has stopped, so none
    /// of its writes can land. Its unfinished requests end and their pages return at once, as
    /// do its quarantined pages; its waiting allocations are dropped. Complete requests stay.
    pub fn owner_down(&mut self, now: Instant, owner: &Owner) -> Vec<Event> {
        let mut out = Vec::new();
        self.waiters.retain(|w| &w.req.owner != owner);
        let mut ids: Vec<String> = self
            .reqs
            .iter()
            .filter(|(_, r)| &r.owner == owner && r.state == ReqState::Writing)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        for id in ids {
            self.release_landed(&id);
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
                self.release_landed(&id);
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
            };
            let stray = (free[i] > 0 && *p != Page::Free)
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
        }
    }

    fn granted(ev: &[Event]) -> Vec<&Grant> {
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
}
