//! Who may write to a data connection's socket next: the writer, or a small frame skipping
//! its queue (the fast lane of [`crate::writer_queue`]).
//!
//! The state is sans-IO: a count of queued items, a flag for the socket being written, and
//! the tail of a frame the socket took only part of. [`crate::writer_queue`] puts a socket
//! and a queue around it; the loom models at the end of this file check its rules under
//! every interleaving of senders, fast-lane frames and the writer (`scripts/loom.sh`).
//!
//! The rules:
//! - an item is counted in `queued` before it enters the queue, and uncounted only once it
//!   is on the wire (when its [`WriterTurn`] ends);
//! - a frame takes the fast lane only while nothing is queued or being written: `queued` is 0 under
//!   `busy`, which the writer holds for each item it sends;
//! - a fast-lane frame the socket took only part of leaves its tail here while it still holds
//!   `busy`, and its sender queues an item (a wake-up) before letting go: the writer's next
//!   turn, whatever its item, sends the tail first, and until then every later frame queues.

#[cfg(all(test, kvbridge_loom))]
use loom::sync::atomic::{AtomicBool, AtomicUsize};
#[cfg(all(test, kvbridge_loom))]
use loom::sync::Mutex;
#[cfg(not(all(test, kvbridge_loom)))]
use std::sync::atomic::{AtomicBool, AtomicUsize};
#[cfg(not(all(test, kvbridge_loom)))]
use std::sync::Mutex;

use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The shared state of one connection's fast lane.
#[derive(Debug)]
pub(crate) struct FastLane {
    /// Items counted into the queue and not yet written out.
    queued: AtomicUsize,
    /// Someone writes to the socket: the writer for one item, or a fast-lane frame.
    busy: AtomicBool,
    /// The rest of a fast-lane frame the socket took only part of: the writer's next bytes.
    tail: Mutex<Option<Vec<u8>>>,
}

/// The right to write one frame on the fast lane; the socket is free for the writer again when it
/// drops.
#[derive(Debug)]
pub(crate) struct FastTurn<'a> {
    lane: &'a FastLane,
}

/// The writer's right to the socket for one item: the item counts as queued, and no frame
/// takes the fast lane, until this drops.
#[derive(Debug)]
pub(crate) struct WriterTurn {
    lane: Arc<FastLane>,
}

impl Default for FastLane {
    fn default() -> Self {
        Self {
            queued: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            tail: Mutex::new(None),
        }
    }
}

impl FastLane {
    /// Counts an item about to enter the queue (before it does, so no frame can take the fast lane
    /// past it in between).
    pub(crate) fn enqueue(&self) {
        self.queued.fetch_add(1, Ordering::SeqCst);
    }

    /// Uncounts an item [`FastLane::enqueue`] counted that did not enter the queue after all.
    pub(crate) fn unqueue(&self) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
    }

    /// The right to write a frame on the fast lane, while nothing is queued or being written.
    pub(crate) fn try_fast_turn(&self) -> Option<FastTurn<'_>> {
        if self.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        self.busy
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()?;
        let turn = FastTurn { lane: self };
        // Counted between the check above and taking `busy`: it was issued first, so it is
        // written first (dropping `turn` lets the writer have the socket).
        if self.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        Some(turn)
    }

    /// The writer's turn for its next item (already counted), unless a fast-lane frame is being
    /// written: that holds the socket for one send that never waits, so the caller retries.
    pub(crate) fn try_writer_turn(lane: &Arc<Self>) -> Option<WriterTurn> {
        lane.busy
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()?;
        Some(WriterTurn { lane: lane.clone() })
    }

    /// Runs `f` on the tail slot (never poisoned: nothing panics while holding it).
    fn with_tail<R>(&self, f: impl FnOnce(&mut Option<Vec<u8>>) -> R) -> R {
        let mut g = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }
}

impl FastTurn<'_> {
    /// Leaves the part of the frame the socket did not take for the writer's next turn. The
    /// caller queues an item to wake the writer before this turn ends.
    pub(crate) fn leave_tail(&self, rest: Vec<u8>) {
        self.lane.with_tail(|t| *t = Some(rest));
    }
}

impl Drop for FastTurn<'_> {
    fn drop(&mut self) {
        self.lane.busy.store(false, Ordering::SeqCst);
    }
}

impl WriterTurn {
    /// The rest of a frame sent in part on the fast lane: it goes out before this turn's
    /// item.
    pub(crate) fn take_tail(&self) -> Option<Vec<u8>> {
        self.lane.with_tail(Option::take)
    }
}

impl Drop for WriterTurn {
    fn drop(&mut self) {
        // Uncounted before the socket is free: a fast-lane frame that takes `busy` next sees
        // this item done.
        self.lane.queued.fetch_sub(1, Ordering::SeqCst);
        self.lane.busy.store(false, Ordering::SeqCst);
    }
}

#[cfg(all(test, kvbridge_loom))]
mod loom_models {
    //! `RUSTFLAGS="--cfg kvbridge_loom" cargo test -p kvbridge --lib loom_` (`scripts/loom.sh`).
    use super::*;
    use loom::sync::Mutex as LMutex;
    use std::collections::VecDeque;

    /// A queued item: a whole frame, or a wake-up for a tail.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Item {
        Frame(u8),
        Wake,
    }

    /// A connection: the lane, the writer's queue and the wire (bytes in the order written).
    struct Conn {
        lane: Arc<FastLane>,
        queue: LMutex<VecDeque<Item>>,
        wire: LMutex<Vec<u8>>,
    }

    /// A frame is two bytes: `[id, id]`. The socket takes a fast-lane frame whole, or, for
    /// `partial`, only its first byte.
    impl Conn {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                lane: Arc::new(FastLane::default()),
                queue: LMutex::new(VecDeque::new()),
                wire: LMutex::new(Vec::new()),
            })
        }

        /// `WriterQueue::send`.
        fn send(&self, item: Item) {
            self.lane.enqueue();
            self.queue.lock().unwrap().push_back(item);
        }

        /// `WriterQueue::send_fast`, then queueing the frame if it did not go.
        fn send_fast_or_queue(&self, id: u8, partial: bool) {
            if let Some(turn) = self.lane.try_fast_turn() {
                if partial {
                    self.wire.lock().unwrap().push(id);
                    turn.leave_tail(vec![id]);
                    self.send(Item::Wake);
                } else {
                    self.wire.lock().unwrap().extend([id, id]);
                }
                return;
            }
            self.send(Item::Frame(id));
        }

        /// The writer: writes queued items until `frames` frames are whole on the wire.
        fn run_writer(&self, frames: usize) {
            loop {
                if self.wire.lock().unwrap().len() == 2 * frames
                    && self.queue.lock().unwrap().is_empty()
                {
                    return;
                }
                let Some(item) = self.queue.lock().unwrap().pop_front() else {
                    loom::thread::yield_now();
                    continue;
                };
                let turn = loop {
                    match FastLane::try_writer_turn(&self.lane) {
                        Some(t) => break t,
                        None => loom::thread::yield_now(),
                    }
                };
                let mut wire = self.wire.lock().unwrap();
                if let Some(tail) = turn.take_tail() {
                    wire.extend(tail);
                }
                if let Item::Frame(id) = item {
                    wire.extend([id, id]);
                }
                drop(wire);
                drop(turn);
            }
        }
    }

    /// The frames on the wire, each whole (its two bytes adjacent), in order.
    fn frames(wire: &[u8]) -> Vec<u8> {
        assert!(wire.len().is_multiple_of(2), "a frame was torn: {wire:?}");
        wire.chunks(2)
            .map(|f| {
                assert_eq!(f[0], f[1], "a frame was torn: {wire:?}");
                f[0]
            })
            .collect()
    }

    fn before(order: &[u8], a: u8, b: u8) -> bool {
        let at = |x| order.iter().position(|&f| f == x).expect("frame lost");
        at(a) < at(b)
    }

    /// Two senders, each issuing a queued frame and a fast-lane one (in both orders, one of the
    /// fast-lane frames taken by the socket in part), with the writer running: every frame
    /// arrives whole and once, each sender's frames in the order it issued them, and the
    /// lane ends idle.
    #[test]
    fn loom_fast_lane_keeps_order_and_never_tears() {
        loom::model(|| {
            let c = Conn::new();
            let c1 = c.clone();
            let t1 = loom::thread::spawn(move || {
                c1.send(Item::Frame(1));
                c1.send_fast_or_queue(2, false);
            });
            let c2 = c.clone();
            let t2 = loom::thread::spawn(move || {
                c2.send_fast_or_queue(3, true);
                c2.send(Item::Frame(4));
            });
            c.run_writer(4);
            t1.join().unwrap();
            t2.join().unwrap();
            let order = frames(&c.wire.lock().unwrap());
            assert_eq!(order.len(), 4, "{order:?}");
            assert!(
                before(&order, 1, 2),
                "2 overtook 1 queued before it: {order:?}"
            );
            assert!(
                before(&order, 3, 4),
                "4 overtook 3 issued before it: {order:?}"
            );
            assert_eq!(c.lane.queued.load(Ordering::SeqCst), 0);
            assert!(!c.lane.busy.load(Ordering::SeqCst));
            assert!(c.lane.with_tail(|t| t.is_none()));
        });
    }

    /// Two fast-lane frames racing the writer's turn for a queued one: at most one writes at
    /// a time, and neither overtakes the frame queued before both were issued.
    #[test]
    fn loom_fast_lane_frames_wait_for_what_was_queued_first() {
        loom::model(|| {
            let c = Conn::new();
            c.send(Item::Frame(1));
            let c1 = c.clone();
            let t1 = loom::thread::spawn(move || c1.send_fast_or_queue(2, true));
            let c2 = c.clone();
            let t2 = loom::thread::spawn(move || c2.send_fast_or_queue(3, false));
            c.run_writer(3);
            t1.join().unwrap();
            t2.join().unwrap();
            let order = frames(&c.wire.lock().unwrap());
            assert_eq!(order.len(), 3, "{order:?}");
            assert!(before(&order, 1, 2) && before(&order, 1, 3), "{order:?}");
        });
    }
}
