//! Target `frame_decoder`: a byte stream through the frame header check and the msgpack
//! message decoder, fed whole and in pieces, by two readers that must agree.
//!
//! Input: byte 0 picks the body limit, byte 1 the read size (1 to 256 bytes), the rest is
//! the stream. Checked, frame by frame:
//! * `FrameDecoder` (kvbridge-proto) on every prefix of the frame answers "need more" until
//!   the whole frame is there, then the same message or the same error as on the whole
//!   buffer (an error is final: more bytes never turn it into a frame);
//! * what decodes round-trips: encode → decode gives the same message, and encoding is
//!   canonical (the re-encoded frame decodes and re-encodes to the same bytes);
//! * an accepted header is within the limit, a refused one is refused for a true reason;
//! * the engine's control-connection reader (`kvbridge::fuzzing::read_frames`, reading in
//!   pieces of the chosen size) yields the same messages and ends the same way.

use kvbridge::fuzzing::{read_frames, StreamEnd};
use kvbridge_proto::frame::{DEFAULT_MAX_FRAME_LEN, MAGIC};
use kvbridge_proto::msg::{FrameDecoder, Message};
use kvbridge_proto::{FrameError, FRAME_HEADER_LEN, PROTOCOL_VERSION};

/// Most frames decoded from one input (inputs are small; this bounds the loop anyway).
const MAX_FRAMES: usize = 64;

/// The target's body.
pub fn run(data: &[u8]) {
    let [sel, chunk, stream @ ..] = data else {
        return;
    };
    let max_body = match sel & 3 {
        0 => DEFAULT_MAX_FRAME_LEN,
        1 => 4096,
        2 => 64,
        _ => u32::from(*sel >> 2),
    };
    let chunk = usize::from(*chunk) + 1;
    let dec = FrameDecoder::new(max_body);

    let mut frames = Vec::new();
    let mut pos = 0;
    let end = loop {
        if frames.len() == MAX_FRAMES {
            break None;
        }
        let rest = &stream[pos..];
        let whole = dec.decode(rest);
        check_prefixes(&dec, rest, &whole, chunk);
        match whole {
            Ok(Some((m, used))) => {
                check_accepted_header(rest, used, max_body);
                check_round_trip(&m);
                frames.push(m);
                pos += used;
            }
            Ok(None) => break Some(Ok(rest.len())),
            Err(e) => {
                check_refusal(rest, &e, max_body);
                break Some(Err((e, rest.len())));
            }
        }
    };

    // The engine's reader must see the same frames and end the same way.
    let (wire, wire_end) = read_frames(stream, max_body, chunk, MAX_FRAMES);
    assert_eq!(wire, frames, "the two readers decoded different frames");
    match (end, wire_end) {
        (None, StreamEnd::Limit) => {}
        (Some(Ok(0)), StreamEnd::Eof) => {}
        // Nonempty leftovers that are not a whole frame: the stream ended inside one.
        (Some(Ok(_)), StreamEnd::Frame(FrameError::Truncated)) => {}
        // The proto decoder refuses a bad magic from 2 bytes on; the reader first waits for a
        // whole header, which never comes.
        (Some(Err((FrameError::BadMagic { .. }, n))), StreamEnd::Frame(FrameError::Truncated))
            if n < FRAME_HEADER_LEN => {}
        (Some(Err((e, _))), StreamEnd::Frame(w)) => assert_eq!(e, w, "readers disagree"),
        (a, b) => panic!("readers ended differently: decoder {a:?}, engine reader {b:?}"),
    }
}

/// Feeds `buf` to the decoder as a reader would see it grow, `chunk` bytes at a time, and
/// checks each answer against the answer on the whole buffer.
fn check_prefixes(
    dec: &FrameDecoder,
    buf: &[u8],
    whole: &Result<Option<(Message, usize)>, FrameError>,
    chunk: usize,
) {
    let mut k = 0;
    // Bounded: k grows by `chunk` >= 1 up to buf.len().
    while k < buf.len() {
        let part = dec.decode(&buf[..k]);
        match (&part, whole) {
            (Ok(None), _) => {}
            // Only reachable once the prefix holds the whole frame.
            (Ok(Some((m, used))), Ok(Some((wm, wused)))) => {
                assert!(*used <= k);
                assert_eq!((m, used), (wm, wused), "prefix decoded another frame");
            }
            (Err(e), Err(we)) => assert_eq!(e, we, "prefix refused for another reason"),
            _ => panic!("prefix of {k} bytes gave {part:?}, the whole buffer {whole:?}"),
        }
        if !matches!(part, Ok(None)) {
            return;
        }
        k += chunk;
    }
}

fn check_accepted_header(buf: &[u8], used: usize, max_body: u32) {
    assert!(used >= FRAME_HEADER_LEN && used <= buf.len());
    assert_eq!(buf[..2], MAGIC);
    assert_eq!(buf[2], PROTOCOL_VERSION);
    assert_eq!(buf[3], 0);
    let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    assert!(len <= max_body, "accepted a body over the limit");
    assert_eq!(used, FRAME_HEADER_LEN + len as usize);
}

fn check_refusal(buf: &[u8], e: &FrameError, max_body: u32) {
    assert!(!e.to_string().is_empty());
    match e {
        FrameError::BadMagic { got } => {
            assert_eq!(got[..], buf[..2]);
            assert_ne!(*got, MAGIC);
        }
        FrameError::UnsupportedVersion { got, supported } => {
            assert_eq!((*got, *supported), (buf[2], PROTOCOL_VERSION));
            assert_ne!(*got, PROTOCOL_VERSION);
        }
        FrameError::BadFlags(f) => assert!(*f != 0 && *f == buf[3]),
        FrameError::TooLarge { len, limit } => assert!(*len > *limit && *limit == max_body),
        FrameError::Malformed(_) => {}
        FrameError::Truncated => panic!("a buffer decoder cannot see a truncation"),
    }
}

fn check_round_trip(m: &Message) {
    assert!(!m.name().is_empty());
    let _ = format!("{m:?}");
    let frame = m.to_frame().expect("a decoded message encodes");
    let body = m.encode_body().expect("a decoded message encodes");
    assert_eq!(frame[FRAME_HEADER_LEN..], body[..]);
    let (back, used) = FrameDecoder::new(u32::MAX)
        .decode(&frame)
        .expect("an encoded message decodes")
        .expect("an encoded frame is whole");
    assert_eq!(used, frame.len());
    assert_eq!(&back, m, "decode -> encode -> decode changed the message");
    assert_eq!(back.to_frame().unwrap(), frame, "encoding is not canonical");
}
