//! Notifications waiting for the application: one bounded queue per peer, a cap on the
//! bytes of all of them together, and the application's receives taking from the peers in
//! turn.
//!
//! A peer's data-connection reader ([`Inlet::room`]) asks for room for each notification
//! before it confirms or delivers it. Room is there when the peer's own queue stays within
//! [`Caps::per_peer`] notifications and [`Caps::per_peer_bytes`], and all queues together
//! within [`Caps::total_bytes`]. The application's receive ([`Outlet::take`]) takes the next
//! notification of the peer whose turn it is, then moves that peer to the back of the turns:
//! with `n` peers holding notifications, each one's next notification is taken within `n`
//! receives, however many another peer queued. A peer's own notifications keep their order.
//!
//! **A peer over its share is paused, not refused.** When there is no room, the reader waits
//! (the `op` deadline, as for a payload) and reads nothing more of that data connection
//! meanwhile, so TCP flow control pushes back on that peer alone. Refusing would end the
//! session of an honest peer whose burst (a PD sender posts one note per chunk) met an
//! application that had not caught up yet, and its posted notes would be lost with it;
//! pausing costs nothing while the application keeps receiving. Only a notification that
//! found no room within the deadline ends its session, typed (`Timeout` at step `Notify`,
//! counted in [`Snapshot::timeouts`]), so the peer learns of it; none is dropped silently.
//! A reader that found its own peer's queue full goes on once the application has taken
//! that queue down to half, not at the first notification taken: a flood then costs the
//! receiving host one wake-up of its reader per half a queue, not one per notification.
//!
//! **Freed room goes to the peer that holds least.** When several readers wait, the room a
//! receive frees goes first to the waiting peer with the fewest bytes queued (then the one
//! that waited longest), never to a newcomer ahead of it. So a flood that fills the total
//! does not keep an honest peer out: its notification takes the first room freed that fits
//! it.
//!
//! Fairness is per peer id. Under the shared secret an id is self-asserted, so a holder that
//! claims many ids gets a turn for each; the total cap still bounds what all of them hold.

use crate::events::Notification;
use kvbridge_proto::PeerId;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;

/// The bounds of the queues (from `Limits`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// Most notifications queued for one peer.
    pub(crate) per_peer: usize,
    /// Most bytes queued for one peer.
    pub(crate) per_peer_bytes: u64,
    /// Most bytes queued for all peers together.
    pub(crate) total_bytes: u64,
}

/// What the queues hold right now, and their counters (`Stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// Notifications queued (delivered to the queues, not yet received).
    pub(crate) queued: usize,
    /// Their bytes, with room granted and not filled yet.
    pub(crate) bytes: u64,
    /// The most bytes ever held at once.
    pub(crate) peak: u64,
    /// Readers waiting for room now.
    pub(crate) paused: usize,
    /// Times a reader waited for room.
    pub(crate) pauses: u64,
    /// Notifications that found no room within their deadline (each ended its session).
    pub(crate) timeouts: u64,
}

/// One peer's queue.
#[derive(Default)]
struct PeerQueue {
    items: VecDeque<Notification>,
    /// Notifications queued plus rooms granted and not filled yet.
    count: usize,
    /// Their bytes.
    bytes: u64,
}

/// A reader waiting for room.
struct Waiter {
    ticket: u64,
    peer: PeerId,
    len: u64,
    /// Room was set aside for it; it fills it once it wakes.
    granted: bool,
    /// It found its own peer's queue full: it waits until that queue is down to half.
    own_full: bool,
}

#[derive(Default)]
struct State {
    queues: HashMap<PeerId, PeerQueue>,
    /// Peers with a notification to take, in the order their turns come.
    turns: VecDeque<PeerId>,
    /// Bytes of every queue.
    total: u64,
    peak: u64,
    /// In ticket order (the order they began to wait).
    waiters: Vec<Waiter>,
    next_ticket: u64,
    pauses: u64,
    timeouts: u64,
    /// Every inlet is gone: no notification will come.
    inputs_closed: bool,
    /// The application's outlet is gone: nothing will be taken.
    output_closed: bool,
}

/// Whether a notification may be queued now.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Fits,
    /// Its peer's own queue is full.
    PeerFull,
    /// All queues together are full, or a waiter that holds less comes first.
    TotalFull,
}

impl State {
    fn held_by(&self, peer: &PeerId) -> (usize, u64) {
        self.queues.get(peer).map_or((0, 0), |q| (q.count, q.bytes))
    }

    /// May `len` bytes from a reader of `peer` that is not waiting yet be queued now? It
    /// comes after every waiter of its own peer, and after every waiter for the total that
    /// holds no more than its peer does.
    fn verdict(&self, caps: &Caps, peer: &PeerId, len: u64) -> Verdict {
        let (count, bytes) = self.held_by(peer);
        if count >= caps.per_peer || bytes + len > caps.per_peer_bytes {
            return Verdict::PeerFull;
        }
        if self.total + len > caps.total_bytes {
            return Verdict::TotalFull;
        }
        let behind_own = self.waiters.iter().any(|w| !w.granted && w.peer == *peer);
        let behind_other = self.contenders(caps).any(|w| self.key(w).0 <= bytes);
        if behind_own || behind_other {
            Verdict::TotalFull
        } else {
            Verdict::Fits
        }
    }

    /// The order in which waiters get room: fewest bytes queued for their peer first, then
    /// the one that waited longest.
    fn key(&self, w: &Waiter) -> (u64, u64) {
        (self.held_by(&w.peer).1, w.ticket)
    }

    /// Waiters that are not granted yet, each peer's earliest only, whose own queue has
    /// room for them (down to half, for one that found it full): they wait for the total
    /// alone.
    fn contenders<'a>(&'a self, caps: &'a Caps) -> impl Iterator<Item = &'a Waiter> + 'a {
        self.waiters.iter().enumerate().filter_map(move |(i, w)| {
            let earlier_of_peer = self.waiters[..i]
                .iter()
                .any(|e| !e.granted && e.peer == w.peer);
            let (count, bytes) = self.held_by(&w.peer);
            let own_room = count < caps.per_peer && bytes + w.len <= caps.per_peer_bytes;
            let drained =
                !w.own_full || (count <= caps.per_peer / 2 && bytes <= caps.per_peer_bytes / 2);
            (!w.granted && !earlier_of_peer && own_room && drained).then_some(w)
        })
    }

    fn reserve(&mut self, peer: &PeerId, len: u64) {
        let q = self.queues.entry(peer.clone()).or_default();
        q.count += 1;
        q.bytes += len;
        self.total += len;
        self.peak = self.peak.max(self.total);
    }

    fn release(&mut self, peer: &PeerId, len: u64) {
        if let Some(q) = self.queues.get_mut(peer) {
            q.count -= 1;
            q.bytes -= len;
            self.total -= len;
            if q.count == 0 {
                self.queues.remove(peer);
            }
        }
    }

    /// Sets room aside for waiters, the first in line first, while it fits. Whether any
    /// got room.
    fn grant(&mut self, caps: &Caps) -> bool {
        let mut any = false;
        loop {
            let next = self
                .contenders(caps)
                .min_by_key(|w| self.key(w))
                .map(|w| (w.ticket, w.peer.clone(), w.len));
            match next {
                Some((ticket, peer, len)) if self.total + len <= caps.total_bytes => {
                    self.reserve(&peer, len);
                    if let Some(w) = self.waiters.iter_mut().find(|w| w.ticket == ticket) {
                        w.granted = true;
                    }
                    any = true;
                }
                _ => return any,
            }
        }
    }

    fn fill(&mut self, n: Notification) {
        let q = self.queues.entry(n.peer.clone()).or_default();
        if q.items.is_empty() {
            self.turns.push_back(n.peer.clone());
        }
        q.items.push_back(n);
    }

    /// The next notification of the peer whose turn it is; that peer goes to the back.
    fn take(&mut self) -> Option<Notification> {
        let peer = self.turns.pop_front()?;
        let q = self
            .queues
            .get_mut(&peer)
            .expect("a peer with a turn has a queue");
        let n = q
            .items
            .pop_front()
            .expect("a peer with a turn has a notification");
        if !q.items.is_empty() {
            self.turns.push_back(peer.clone());
        }
        self.release(&peer, n.data.len() as u64);
        Some(n)
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            queued: self.queues.values().map(|q| q.items.len()).sum(),
            bytes: self.total,
            peak: self.peak,
            paused: self.waiters.iter().filter(|w| !w.granted).count(),
            pauses: self.pauses,
            timeouts: self.timeouts,
        }
    }
}

/// The queues, shared by the readers ([`Inlet`]) and the application ([`Outlet`]).
struct Queues {
    caps: Caps,
    state: Mutex<State>,
    /// A notification was queued (or the inlets are gone).
    arrived: Notify,
    /// Room was granted (or the outlet is gone).
    room: Notify,
}

impl Queues {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The queues as the application holds them.
pub(crate) struct Outlet(Arc<Queues>);

/// The queues as the sessions hold them (shared; once the last is dropped, receives return
/// `None` after the queued notifications).
pub(crate) struct Inlet(Arc<Queues>);

/// Empty queues within `caps`.
pub(crate) fn queues(caps: Caps) -> (Arc<Inlet>, Outlet) {
    let q = Arc::new(Queues {
        caps,
        state: Mutex::new(State::default()),
        arrived: Notify::new(),
        room: Notify::new(),
    });
    (Arc::new(Inlet(q.clone())), Outlet(q))
}

/// What a reader got when it asked for room.
pub(crate) enum Admission<'a> {
    /// Room for the notification: fill it (or drop it to give it back).
    Room(Room<'a>),
    /// The application is gone: nothing is delivered any more.
    Gone,
    /// No room came within the deadline.
    TimedOut,
}

/// Room set aside in a peer's queue for one notification; given back when dropped unfilled.
pub(crate) struct Room<'a> {
    queues: &'a Queues,
    peer: PeerId,
    len: u64,
    filled: bool,
}

impl Room<'_> {
    /// Queues `n` (of the length the room was asked for) for the application.
    pub(crate) fn fill(mut self, n: Notification) {
        debug_assert_eq!(n.data.len() as u64, self.len);
        debug_assert_eq!(n.peer, self.peer);
        self.queues.lock().fill(n);
        self.filled = true;
        self.queues.arrived.notify_waiters();
    }
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        if self.filled {
            return;
        }
        let mut s = self.queues.lock();
        s.release(&self.peer, self.len);
        if s.grant(&self.queues.caps) {
            self.queues.room.notify_waiters();
        }
    }
}

/// Takes a waiter out of the line when its wait ends, however it ends: room granted to it
/// meanwhile and not taken is given back.
struct InLine<'a> {
    queues: &'a Queues,
    ticket: u64,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        let mut s = self.queues.lock();
        let Some(i) = s.waiters.iter().position(|w| w.ticket == self.ticket) else {
            return;
        };
        let w = s.waiters.remove(i);
        if w.granted {
            s.release(&w.peer, w.len);
        }
        // Those behind it may now be first in line.
        if s.grant(&self.queues.caps) {
            self.queues.room.notify_waiters();
        }
    }
}

impl Inlet {
    /// Room for a notification of `len` bytes from `peer`, waiting at most `deadline` for
    /// it (see the module docs for who gets room first).
    pub(crate) async fn room(
        &self,
        peer: &PeerId,
        len: usize,
        deadline: Duration,
    ) -> Admission<'_> {
        let q = &*self.0;
        let len = len as u64;
        let ticket = {
            let mut s = q.lock();
            if s.output_closed {
                return Admission::Gone;
            }
            let verdict = s.verdict(&q.caps, peer, len);
            if verdict == Verdict::Fits {
                s.reserve(peer, len);
                return Admission::Room(self.room_of(peer, len));
            }
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            s.pauses += 1;
            s.waiters.push(Waiter {
                ticket,
                peer: peer.clone(),
                len,
                granted: false,
                own_full: verdict == Verdict::PeerFull,
            });
            ticket
        };
        // Out of the line when the wait ends, however it ends (room granted meanwhile and
        // not taken is given back).
        let _line = InLine { queues: q, ticket };
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let woken = q.room.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            {
                let mut s = q.lock();
                if s.output_closed {
                    return Admission::Gone;
                }
                let i = s
                    .waiters
                    .iter()
                    .position(|w| w.ticket == ticket)
                    .expect("a waiter stays in line until its wait ends");
                if s.waiters[i].granted {
                    // The room is its own now: out of the line without giving it back.
                    s.waiters.remove(i);
                    return Admission::Room(self.room_of(peer, len));
                }
                if tokio::time::Instant::now() >= until {
                    s.timeouts += 1;
                    return Admission::TimedOut;
                }
            }
            let _ = tokio::time::timeout_at(until, woken).await;
        }
    }

    fn room_of(&self, peer: &PeerId, len: u64) -> Room<'_> {
        Room {
            queues: &self.0,
            peer: peer.clone(),
            len,
            filled: false,
        }
    }

    /// What the queues hold.
    pub(crate) fn snapshot(&self) -> Snapshot {
        self.0.lock().snapshot()
    }
}

impl Drop for Inlet {
    fn drop(&mut self) {
        self.0.lock().inputs_closed = true;
        self.0.arrived.notify_waiters();
    }
}

impl Outlet {
    /// The next notification, the peers taking turns; `None` at once when none is queued.
    pub(crate) fn try_take(&self) -> Option<Notification> {
        let q = &*self.0;
        let mut s = q.lock();
        let n = s.take()?;
        if s.grant(&q.caps) {
            q.room.notify_waiters();
        }
        Some(n)
    }

    /// The next notification, the peers taking turns; `None` once no session is left to
    /// send one and the queues are empty.
    pub(crate) async fn take(&self) -> Option<Notification> {
        loop {
            let arrived = self.0.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(n) = self.try_take() {
                return Some(n);
            }
            if self.0.lock().inputs_closed {
                return None;
            }
            arrived.await;
        }
    }
}

impl Drop for Outlet {
    fn drop(&mut self) {
        self.0.lock().output_closed = true;
        self.0.room.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_proto::Incarnation;

    const CAPS: Caps = Caps {
        per_peer: 8,
        per_peer_bytes: 1000,
        total_bytes: 1500,
    };
    const LONG: Duration = Duration::from_secs(3600);

    fn id(name: &str) -> PeerId {
        PeerId::new(name).unwrap()
    }

    fn note(peer: &str, tag: u8, len: usize) -> Notification {
        let mut data = vec![0u8; len];
        if let Some(b) = data.first_mut() {
            *b = tag;
        }
        Notification {
            peer: id(peer),
            incarnation: Incarnation(1),
            data,
        }
    }

    /// Queues `n` at once; panics when it would have to wait.
    async fn put(inlet: &Inlet, n: Notification) {
        match inlet.room(&n.peer, n.data.len(), Duration::ZERO).await {
            Admission::Room(r) => r.fill(n),
            Admission::Gone => panic!("gone"),
            Admission::TimedOut => panic!("no room for {} from {}", n.data.len(), n.peer),
        }
    }

    /// A reader of its own that queues `notes` in order, waiting for room as long as it
    /// takes.
    fn reader(inlet: &Arc<Inlet>, notes: Vec<Notification>) -> tokio::task::JoinHandle<()> {
        let inlet = inlet.clone();
        tokio::spawn(async move {
            for n in notes {
                match inlet.room(&n.peer, n.data.len(), LONG).await {
                    Admission::Room(r) => r.fill(n),
                    _ => return,
                }
            }
        })
    }

    /// Lets the spawned readers run until each waits or is done (current-thread runtime:
    /// nothing else runs meanwhile).
    async fn settle() {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn peers_take_turns_and_keep_their_order() {
        let (inlet, outlet) = queues(CAPS);
        for i in 0..8 {
            put(&inlet, note("flood", i, 100)).await;
        }
        for i in 0..3 {
            put(&inlet, note("honest", i, 10)).await;
        }
        let got: Vec<(String, u8)> = std::iter::from_fn(|| outlet.try_take())
            .map(|n| (n.peer.to_string(), n.data[0]))
            .collect();
        // Alternating while both have notifications, each peer's in its own order.
        let honest_at: Vec<usize> = (0..got.len()).filter(|&i| got[i].0 == "honest").collect();
        assert_eq!(honest_at, [1, 3, 5], "{got:?}");
        let flood: Vec<u8> = got.iter().filter(|g| g.0 == "flood").map(|g| g.1).collect();
        assert_eq!(flood, (0..8).collect::<Vec<u8>>());
        assert_eq!(
            inlet.snapshot(),
            Snapshot {
                peak: 830,
                ..Snapshot::default()
            }
        );
    }

    #[tokio::test]
    async fn a_peer_is_held_to_its_own_count_and_bytes() {
        let (inlet, outlet) = queues(CAPS);
        for i in 0..8 {
            put(&inlet, note("many", i, 0)).await;
        }
        assert!(matches!(
            inlet.room(&id("many"), 0, Duration::ZERO).await,
            Admission::TimedOut
        ));
        put(&inlet, note("big", 0, 1000)).await;
        assert!(matches!(
            inlet.room(&id("big"), 1, Duration::ZERO).await,
            Admission::TimedOut
        ));
        // Another peer still gets room, within the total.
        put(&inlet, note("other", 0, 500)).await;
        let s = inlet.snapshot();
        assert_eq!((s.queued, s.bytes, s.timeouts), (10, 1500, 2), "{s:?}");
        assert!(outlet.try_take().is_some());
    }

    /// Two flooders fill the total and wait with more; an honest peer's reader comes last.
    /// The first room a receive frees goes to the honest peer, which holds nothing, and its
    /// notification is taken within one round of turns; the total never passes its cap.
    #[tokio::test]
    async fn freed_room_goes_first_to_the_peer_that_holds_least() {
        let caps = Caps {
            per_peer: 64,
            per_peer_bytes: 1000,
            total_bytes: 1000,
        };
        let (inlet, outlet) = queues(caps);
        let flood = |p: &str| (0..20).map(|i| note(p, i, 100)).collect::<Vec<_>>();
        let f1 = reader(&inlet, flood("flood-1"));
        settle().await;
        let f2 = reader(&inlet, flood("flood-2"));
        settle().await;
        let s = inlet.snapshot();
        assert_eq!((s.bytes, s.paused), (1000, 2), "{s:?}");
        let honest = reader(&inlet, vec![note("honest", 7, 10)]);
        settle().await;
        assert_eq!(inlet.snapshot().paused, 3);
        let mut takes = 0;
        let mut honest_after = None;
        while let Some(n) = outlet.try_take() {
            takes += 1;
            assert!(inlet.snapshot().bytes <= caps.total_bytes);
            if n.peer == id("honest") {
                honest_after = Some(takes);
                break;
            }
            settle().await;
        }
        // The honest peer gets room once every waiting peer that held no more than it did
        // got some (flood-2, which held nothing either: one receive each), and its turn
        // comes within one round of the three peers after that.
        let after = honest_after.expect("the honest notification was never taken");
        assert!(
            after <= 2 + 3,
            "the honest notification came after {after} receives"
        );
        assert!(inlet.snapshot().peak <= caps.total_bytes);
        honest.await.unwrap();
        f1.abort();
        f2.abort();
    }

    /// A flood's reader that found its queue full is woken once the application took half
    /// of it, not at every notification taken.
    #[tokio::test]
    async fn a_reader_that_found_its_queue_full_goes_on_once_it_is_down_to_half() {
        let (inlet, outlet) = queues(CAPS);
        let flood = reader(&inlet, (0..12).map(|i| note("flood", i, 10)).collect());
        settle().await;
        for taken in 0..4 {
            let s = inlet.snapshot();
            assert_eq!((s.queued, s.paused, s.pauses), (8 - taken, 1, 1), "{s:?}");
            assert!(outlet.try_take().is_some());
            settle().await;
        }
        // Down to 4 of 8: it went on, and queued its last four without pausing again.
        let s = inlet.snapshot();
        assert_eq!((s.queued, s.paused, s.pauses), (8, 0, 1), "{s:?}");
        flood.await.unwrap();
        let order: Vec<u8> = std::iter::from_fn(|| outlet.try_take())
            .map(|n| n.data[0])
            .collect();
        assert_eq!(order, (4..12).collect::<Vec<u8>>());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_past_its_deadline_is_counted_and_gives_its_place_back() {
        let caps = Caps {
            per_peer: 64,
            per_peer_bytes: 100,
            total_bytes: 100,
        };
        let (inlet, outlet) = queues(caps);
        put(&inlet, note("a", 0, 100)).await;
        let waited = inlet.room(&id("b"), 50, Duration::from_secs(1)).await;
        assert!(matches!(waited, Admission::TimedOut));
        let s = inlet.snapshot();
        assert_eq!((s.paused, s.pauses, s.timeouts), (0, 1, 1), "{s:?}");
        assert!(outlet.try_take().is_some());
        put(&inlet, note("b", 0, 100)).await;
    }

    #[tokio::test]
    async fn room_given_back_unfilled_is_released() {
        let (inlet, _outlet) = queues(CAPS);
        match inlet.room(&id("a"), 1000, LONG).await {
            Admission::Room(r) => drop(r),
            _ => panic!("no room"),
        }
        assert_eq!(inlet.snapshot().bytes, 0);
        put(&inlet, note("a", 0, 1000)).await;
    }

    #[tokio::test]
    async fn a_waiting_reader_learns_that_the_application_is_gone() {
        let caps = Caps {
            per_peer: 1,
            ..CAPS
        };
        let (inlet, outlet) = queues(caps);
        put(&inlet, note("a", 0, 1)).await;
        let i2 = inlet.clone();
        let waiting =
            tokio::spawn(
                async move { matches!(i2.room(&id("a"), 1, LONG).await, Admission::Gone) },
            );
        settle().await;
        drop(outlet);
        assert!(waiting.await.unwrap());
        assert!(matches!(
            inlet.room(&id("b"), 1, LONG).await,
            Admission::Gone
        ));
    }

    #[tokio::test]
    async fn receives_end_once_no_session_is_left_and_the_queues_are_empty() {
        let (inlet, outlet) = queues(CAPS);
        put(&inlet, note("a", 3, 1)).await;
        drop(inlet);
        assert_eq!(outlet.take().await.map(|n| n.data), Some(vec![3]));
        assert_eq!(outlet.take().await, None);
    }

    #[tokio::test]
    async fn a_receive_waiting_wakes_for_a_notification() {
        let (inlet, outlet) = queues(CAPS);
        let outlet = Arc::new(outlet);
        let o2 = outlet.clone();
        let waiting = tokio::spawn(async move { o2.take().await.map(|n| n.data) });
        settle().await;
        put(&inlet, note("a", 9, 1)).await;
        assert_eq!(waiting.await.unwrap(), Some(vec![9]));
    }
}
