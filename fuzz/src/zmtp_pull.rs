//! Target `zmtp_pull`: a byte stream from a hostile peer through the PULL side of the KV
//! outcome port (`kvbridge_proto::zmtp::PullSession`, what `kvbridge_proxy::outcome_port`
//! runs per connection), then each message through the proxy's outcome decoder and tag
//! check (`kvbridge_proxy::notif::decode_tagged`, `authentic`).
//!
//! Input: byte 0 picks the read size (1 to 256 bytes), byte 1 the limits (frame body 16 B to
//! 64 KiB, 1 to 16 frames a message); the rest is what the peer sends. Checked:
//! * no panic; an error is final (the caller closes the connection);
//! * fed whole or in reads of the chosen size, the session ends the same way, and gives the
//!   same events when it ends without an error;
//! * what it buffers never exceeds a frame header plus the frame limit, plus the message
//!   limit's worth of frames, whatever sizes the peer announces;
//! * every message has 1 to `max_frames` frames of at most `max_frame` bytes, and comes only
//!   after our `READY` was handed out;
//! * decoding an outcome and checking its tag never panics.

use kvbridge_proto::zmtp::{PullEvent, PullLimits, PullSession, ZmtpError};
use kvbridge_proxy::notif;

fn feed(limits: PullLimits, stream: &[u8], read: usize) -> (Vec<PullEvent>, Option<ZmtpError>) {
    let mut s = PullSession::new(limits);
    let mut events = Vec::new();
    let bound = 9 + limits.max_frame + limits.max_frames * limits.max_frame;
    for chunk in stream.chunks(read) {
        match s.feed(chunk) {
            Ok(ev) => events.extend(ev),
            Err(e) => return (events, Some(e)),
        }
        assert!(s.buffered() <= bound.max(9 + kvbridge_proto::zmtp::MAX_COMMAND_BODY));
    }
    (events, None)
}

/// The target's body.
pub fn run(data: &[u8]) {
    let [read, lim, stream @ ..] = data else {
        return;
    };
    let read = usize::from(*read) + 1;
    let limits = PullLimits {
        max_frame: 16 << (lim & 0x0f).min(12),
        max_frames: usize::from(lim >> 4) + 1,
    };
    let whole = feed(limits, stream, stream.len().max(1));
    let pieces = feed(limits, stream, read);
    // A failed `feed` gives no events (the connection is closed): on an error only the
    // error must agree; without one, every event.
    assert_eq!(whole.1, pieces.1, "the reads' sizes changed the ending");
    if whole.1.is_none() {
        assert_eq!(whole.0, pieces.0, "the reads' sizes changed the events");
    }
    let mut ready_sent = false;
    for ev in &pieces.0 {
        match ev {
            PullEvent::Send(_) => ready_sent = true,
            PullEvent::Message(frames) => {
                assert!(ready_sent, "a message before our READY");
                assert!(!frames.is_empty() && frames.len() <= limits.max_frames);
                for f in frames {
                    assert!(f.len() <= limits.max_frame);
                    if let Ok((msg, tag)) = notif::decode_tagged(f) {
                        let _ = notif::authentic(&msg, tag.as_deref(), b"secret");
                    }
                }
            }
        }
    }
}
