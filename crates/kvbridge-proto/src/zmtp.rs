//! ZMTP 3.0 (rfc.zeromq.org/spec/23) with the NULL mechanism, sans-IO: the greeting, the
//! `READY` command, message frames, and the receiving side of a PULL connection as a state
//! machine that takes bytes and gives back what to send and the messages received.
//!
//! Used by both ends of the KV outcome channel: the PD sender's PUSH connection and the
//! proxy's PULL listener. Every size a peer announces is checked against a limit before
//! anything is allocated for it: a frame header announcing 2^50 bytes is an error, not an
//! allocation.

/// Length of the greeting each side sends first.
pub const GREETING_LEN: usize = 64;

/// Frame flag: more frames of this message follow.
pub const FLAG_MORE: u8 = 0x01;
/// Frame flag: the size field is 8 bytes (else 1).
pub const FLAG_LONG: u8 = 0x02;
/// Frame flag: a command frame (else a message frame).
pub const FLAG_COMMAND: u8 = 0x04;

/// Largest command body a PULL side reads (a `READY` with a few properties).
pub const MAX_COMMAND_BODY: usize = 4096;

/// Why a peer's bytes are not acceptable ZMTP 3.0 NULL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The greeting does not start with ZMTP's signature.
    NotZmtp,
    /// The peer speaks an older major version.
    Version(u8),
    /// The peer wants a security mechanism other than NULL.
    Mechanism,
    /// A frame announced more bytes than the limit.
    FrameTooLarge {
        /// Announced body length.
        len: u64,
        /// The limit for this kind of frame.
        max: u64,
    },
    /// A message of more frames, or more bytes in all, than the limit.
    MessageTooLarge,
    /// Reserved flag bits set.
    ReservedFlags(u8),
    /// The first command was not `READY`, or a `READY` was malformed.
    NotReady,
    /// The peer's `READY` names a socket type this side cannot talk to.
    SocketType,
}

impl std::fmt::Display for ZmtpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ZmtpError::NotZmtp => write!(f, "the peer did not greet as ZMTP"),
            ZmtpError::Version(v) => write!(f, "the peer speaks ZMTP {v}, not 3"),
            ZmtpError::Mechanism => {
                write!(f, "the peer wants a security mechanism other than NULL")
            }
            ZmtpError::FrameTooLarge { len, max } => {
                write!(
                    f,
                    "a frame of {len} bytes announced, at most {max} accepted"
                )
            }
            ZmtpError::MessageTooLarge => write!(f, "a message of too many frames or bytes"),
            ZmtpError::ReservedFlags(b) => write!(f, "reserved frame flags set: {b:#04x}"),
            ZmtpError::NotReady => write!(f, "the peer did not send a well-formed READY"),
            ZmtpError::SocketType => write!(f, "the peer's socket type does not match"),
        }
    }
}

impl std::error::Error for ZmtpError {}

/// A greeting: signature, version 3.0, mechanism `NULL`, as-server 0, filler.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting: the signature, major version 3 or later, mechanism NULL.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ZmtpError::NotZmtp);
    }
    if g[10] < 3 {
        return Err(ZmtpError::Version(g[10]));
    }
    if &g[12..17] != b"NULL\0" {
        return Err(ZmtpError::Mechanism);
    }
    Ok(())
}

/// One frame: `flags` (a combination of [`FLAG_MORE`] and [`FLAG_COMMAND`]), the long-size
/// flag when the body needs it, the size, the body.
pub fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        f.push(flags | FLAG_LONG);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        f.push(flags);
        f.push(body.len() as u8);
    }
    f.extend_from_slice(body);
    f
}

/// A `READY` command frame announcing `Socket-Type: socket_type` (`PUSH`, `PULL`).
pub fn ready_command(socket_type: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    frame(FLAG_COMMAND, &body)
}

/// A frame header: its flags and the announced body length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Flag byte (without [`FLAG_LONG`], which only says how the size was written).
    pub flags: u8,
    /// Announced body length.
    pub body_len: u64,
    /// Bytes the header took (2 or 9).
    pub header_len: usize,
}

/// Parses the frame header at the start of `buf`: `Ok(None)` when more bytes are needed; an
/// error for reserved flag bits, or a body over `max_body` (checked before the caller
/// allocates anything for it).
pub fn parse_frame_header(buf: &[u8], max_body: u64) -> Result<Option<FrameHeader>, ZmtpError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::ReservedFlags(flags));
    }
    let (body_len, header_len) = if flags & FLAG_LONG != 0 {
        let Some(b) = buf.get(1..9) else {
            return Ok(None);
        };
        let mut n = [0u8; 8];
        n.copy_from_slice(b);
        (u64::from_be_bytes(n), 9)
    } else {
        let Some(&n) = buf.get(1) else {
            return Ok(None);
        };
        (u64::from(n), 2)
    };
    if body_len > max_body {
        return Err(ZmtpError::FrameTooLarge {
            len: body_len,
            max: max_body,
        });
    }
    Ok(Some(FrameHeader {
        flags: flags & !FLAG_LONG,
        body_len,
        header_len,
    }))
}

/// The properties of a `READY` command body (`[5]READY` then properties), or an error when
/// it is not one.
pub fn ready_properties(body: &[u8]) -> Result<&[u8], ZmtpError> {
    match body.split_first() {
        Some((5, rest)) if rest.starts_with(b"READY") => Ok(&rest[5..]),
        _ => Err(ZmtpError::NotReady),
    }
}

/// Whether the `READY` properties `props` say `Socket-Type` is `want` (names compare
/// without case, as the spec says). Truncated or malformed properties are not a match.
pub fn socket_type_is(mut props: &[u8], want: &[u8]) -> bool {
    while let Some((&n, rest)) = props.split_first() {
        let n = n as usize;
        if rest.len() < n + 4 {
            return false;
        }
        let (name, rest) = rest.split_at(n);
        let (vlen, rest) = rest.split_at(4);
        let v = u32::from_be_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
        if rest.len() < v {
            return false;
        }
        let (value, rest) = rest.split_at(v);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return value == want;
        }
        props = rest;
    }
    false
}

/// Limits of a [`PullSession`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullLimits {
    /// Largest message frame body.
    pub max_frame: usize,
    /// Most frames in one message.
    pub max_frames: usize,
}

/// What a [`PullSession`] asks of its caller after some input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEvent {
    /// Bytes to write to the peer.
    Send(Vec<u8>),
    /// A whole message: its frames, in order.
    Message(Vec<Vec<u8>>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Ready,
    Traffic,
}

/// The receiving side of one PULL connection (or, with [`PullSession::with_socket_types`],
/// of a SUB or PUB connection: the side that reads messages), sans-IO. The caller writes [`PullSession::start`]'s
/// bytes, then hands over whatever it reads; [`PullSession::feed`] returns what to write and
/// the messages completed. It buffers at most one frame (header plus at most
/// [`PullLimits::max_frame`] bytes) and one message (at most `max_frames` frames); any
/// violation is an error after which the connection must be closed.
#[derive(Debug)]
pub struct PullSession {
    limits: PullLimits,
    /// Our socket type, announced in our `READY`.
    own: &'static str,
    /// The socket type the peer must announce.
    peer: &'static [u8],
    phase: Phase,
    buf: Vec<u8>,
    message: Vec<Vec<u8>>,
}

impl PullSession {
    /// A session that enforces `limits`.
    pub fn new(limits: PullLimits) -> Self {
        Self::with_socket_types(limits, "PULL", b"PUSH")
    }

    /// A session that announces `own` and accepts only a peer that announces `peer`
    /// (`SUB` with `PUB`, `PUB` with `SUB`). Commands after `READY` are skipped, so a
    /// ZMTP 3.1 `SUBSCRIBE` command is not seen; ZMTP 3.0 peers, which this greeting makes
    /// of every peer, subscribe with messages.
    pub fn with_socket_types(limits: PullLimits, own: &'static str, peer: &'static [u8]) -> Self {
        PullSession {
            limits,
            own,
            peer,
            phase: Phase::Greeting,
            buf: Vec::new(),
            message: Vec::new(),
        }
    }

    /// Bytes to send as soon as the connection is up: our greeting.
    pub fn start(&self) -> Vec<u8> {
        greeting().to_vec()
    }

    /// Whether the handshake (both greetings and the peer's `READY`) is done.
    pub fn established(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// Whether part of a greeting, command or frame is buffered (a peer in the middle of
    /// sending something).
    pub fn mid_frame(&self) -> bool {
        !self.buf.is_empty() || !self.message.is_empty()
    }

    /// Bytes held for the unit in progress and the message being assembled (bounded by
    /// the limits: a header plus `max_frame`, and `max_frames` frames).
    pub fn buffered(&self) -> usize {
        self.buf.len() + self.message.iter().map(Vec::len).sum::<usize>()
    }

    /// Takes bytes read from the peer; returns what to send and the messages completed.
    pub fn feed(&mut self, mut data: &[u8]) -> Result<Vec<PullEvent>, ZmtpError> {
        let mut out = Vec::new();
        while !data.is_empty() {
            // Never more than the unit in progress is buffered: a greeting, a header, or one
            // frame whose header (and so its size limit) was already checked.
            let take = self
                .wanted()
                .saturating_sub(self.buf.len())
                .clamp(1, data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            self.step(&mut out)?;
        }
        Ok(out)
    }

    /// Bytes the buffer should hold before [`PullSession::step`] can make progress: a whole
    /// greeting, a whole header, or a whole frame once its header is known.
    fn wanted(&self) -> usize {
        match self.phase {
            Phase::Greeting => GREETING_LEN,
            Phase::Ready | Phase::Traffic => match parse_frame_header(&self.buf, u64::MAX) {
                Ok(Some(h)) => h.header_len + h.body_len.min(self.max_body() as u64) as usize,
                _ if self.buf.first().is_some_and(|f| f & FLAG_LONG != 0) => 9,
                _ => 2,
            },
        }
    }

    fn max_body(&self) -> usize {
        match self.phase {
            Phase::Traffic => self.limits.max_frame,
            _ => MAX_COMMAND_BODY,
        }
    }

    fn step(&mut self, out: &mut Vec<PullEvent>) -> Result<(), ZmtpError> {
        if self.phase == Phase::Greeting {
            if self.buf.len() < GREETING_LEN {
                return Ok(());
            }
            let mut g = [0u8; GREETING_LEN];
            g.copy_from_slice(&self.buf);
            check_greeting(&g)?;
            self.buf.clear();
            self.phase = Phase::Ready;
            out.push(PullEvent::Send(ready_command(self.own)));
            return Ok(());
        }
        let Some(h) = parse_frame_header(&self.buf, self.max_body() as u64)? else {
            return Ok(());
        };
        let end = h.header_len + h.body_len as usize;
        if self.buf.len() < end {
            return Ok(());
        }
        let body = self.buf[h.header_len..end].to_vec();
        self.buf.clear();
        let command = h.flags & FLAG_COMMAND != 0;
        match self.phase {
            Phase::Ready => {
                if !command || h.flags & FLAG_MORE != 0 {
                    return Err(ZmtpError::NotReady);
                }
                let props = ready_properties(&body)?;
                if !socket_type_is(props, self.peer) {
                    return Err(ZmtpError::SocketType);
                }
                self.phase = Phase::Traffic;
            }
            Phase::Traffic if command => {
                // Commands after READY (PING, or unknown ones) carry nothing for a PULL;
                // a command in the middle of a multi-frame message is a protocol error.
                if !self.message.is_empty() {
                    return Err(ZmtpError::NotReady);
                }
            }
            Phase::Traffic => {
                if self.message.len() >= self.limits.max_frames {
                    return Err(ZmtpError::MessageTooLarge);
                }
                self.message.push(body);
                if h.flags & FLAG_MORE == 0 {
                    out.push(PullEvent::Message(std::mem::take(&mut self.message)));
                }
            }
            Phase::Greeting => unreachable!("handled above"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PullLimits = PullLimits {
        max_frame: 1024,
        max_frames: 4,
    };

    fn push_peer_hello() -> Vec<u8> {
        let mut b = greeting().to_vec();
        b.extend_from_slice(&ready_command("PUSH"));
        b
    }

    #[test]
    fn frames_pick_their_size_field() {
        assert_eq!(frame(0, b"ab"), [0, 2, b'a', b'b']);
        let long = frame(0, &[7; 300]);
        assert_eq!(long[0], FLAG_LONG);
        assert_eq!(&long[1..9], &300u64.to_be_bytes());
        assert_eq!(long.len(), 309);
    }

    #[test]
    fn ready_names_the_socket_type() {
        let r = ready_command("PUSH");
        assert_eq!(r[0], FLAG_COMMAND);
        assert_eq!(r[1] as usize, r.len() - 2);
        let props = ready_properties(&r[2..]).unwrap();
        assert!(socket_type_is(props, b"PUSH"));
        assert!(!socket_type_is(props, b"PULL"));
        for cut in 0..props.len() - 1 {
            assert!(!socket_type_is(&props[..cut], b"PUSH"));
        }
        assert!(!socket_type_is(&[200, 1, 2], b"PUSH"));
        assert_eq!(ready_properties(b"\x04PING"), Err(ZmtpError::NotReady));
    }

    /// The header announcing 2^50 bytes is refused from its 9 header bytes alone.
    #[test]
    fn a_huge_announced_frame_is_an_error_before_any_allocation() {
        let mut hdr = vec![FLAG_LONG];
        hdr.extend_from_slice(&(1u64 << 50).to_be_bytes());
        assert_eq!(
            parse_frame_header(&hdr, 1024),
            Err(ZmtpError::FrameTooLarge {
                len: 1 << 50,
                max: 1024
            })
        );
        for at in [true, false] {
            let mut s = PullSession::new(LIMITS);
            let mut input = greeting().to_vec();
            if at {
                input.extend_from_slice(&ready_command("PUSH"));
            }
            input.push(if at { 0 } else { FLAG_COMMAND } | FLAG_LONG);
            input.extend_from_slice(&(1u64 << 50).to_be_bytes());
            assert!(matches!(
                s.feed(&input),
                Err(ZmtpError::FrameTooLarge { len, .. }) if len == 1 << 50
            ));
            assert!(s.buf.capacity() < 4096, "nothing reserved for the frame");
        }
    }

    #[test]
    fn messages_arrive_whole_whatever_the_chunking() {
        let mut input = push_peer_hello();
        input.extend_from_slice(&frame(0, b"one"));
        input.extend_from_slice(&frame(FLAG_COMMAND, b"\x04PING\x00\x00"));
        input.extend_from_slice(&frame(FLAG_MORE, b"a"));
        input.extend_from_slice(&frame(0, &[9; 300]));
        input.extend_from_slice(&frame(0, b""));
        for chunk in [1, 2, 7, 64, 1000] {
            let mut s = PullSession::new(LIMITS);
            assert_eq!(s.start(), greeting());
            let mut events = Vec::new();
            for c in input.chunks(chunk) {
                events.extend(s.feed(c).unwrap());
            }
            assert_eq!(
                events,
                vec![
                    PullEvent::Send(ready_command("PULL")),
                    PullEvent::Message(vec![b"one".to_vec()]),
                    PullEvent::Message(vec![b"a".to_vec(), vec![9; 300]]),
                    PullEvent::Message(vec![vec![]]),
                ],
                "chunk {chunk}"
            );
            assert!(s.established() && !s.mid_frame() && s.buffered() == 0);
        }
        // A command in the middle of a multi-frame message breaks the protocol.
        let mut input = push_peer_hello();
        input.extend_from_slice(&frame(FLAG_MORE, b"a"));
        input.extend_from_slice(&frame(FLAG_COMMAND, b"\x04PING\x00\x00"));
        assert_eq!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::NotReady)
        );
    }

    #[test]
    fn bad_peers_get_typed_errors() {
        let mut s = PullSession::new(LIMITS);
        assert_eq!(s.feed(&[b'G'; 64]), Err(ZmtpError::NotZmtp));
        let mut g = greeting();
        g[10] = 2;
        assert_eq!(
            PullSession::new(LIMITS).feed(&g),
            Err(ZmtpError::Version(2))
        );
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        assert_eq!(PullSession::new(LIMITS).feed(&g), Err(ZmtpError::Mechanism));
        let mut input = greeting().to_vec();
        input.extend_from_slice(&ready_command("PUB"));
        assert_eq!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::SocketType)
        );
        let mut input = greeting().to_vec();
        input.extend_from_slice(&frame(0, b"data before READY"));
        assert_eq!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::NotReady)
        );
        let mut input = push_peer_hello();
        input.push(0x80);
        assert_eq!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::ReservedFlags(0x80))
        );
        let mut input = push_peer_hello();
        for _ in 0..5 {
            input.extend_from_slice(&frame(FLAG_MORE, b"x"));
        }
        assert_eq!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::MessageTooLarge)
        );
        let mut input = push_peer_hello();
        input.extend_from_slice(&frame(0, &[0; 1025]));
        assert!(matches!(
            PullSession::new(LIMITS).feed(&input),
            Err(ZmtpError::FrameTooLarge { len: 1025, .. })
        ));
    }

    #[test]
    fn a_truncated_greeting_is_only_waiting() {
        let mut s = PullSession::new(LIMITS);
        assert_eq!(s.feed(&greeting()[..10]), Ok(vec![]));
        assert!(s.mid_frame() && !s.established());
    }
}
