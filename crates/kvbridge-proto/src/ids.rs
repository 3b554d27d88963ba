//! Identifiers that cross the wire.

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Longest peer id accepted, in bytes.
pub const MAX_PEER_ID_LEN: usize = 256;

/// A peer's stable name (for example `prefill-0/rank3`), chosen by configuration. A process
/// that restarts keeps its peer id and gets a new [`Incarnation`].
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct PeerId(String);

/// Decoding refuses an id longer than [`MAX_PEER_ID_LEN`] before it allocates anything for
/// it (an empty one is refused later, by the handshake, with a typed error).
impl<'de> Deserialize<'de> for PeerId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        bounded_string(d, MAX_PEER_ID_LEN).map(PeerId)
    }
}

/// Deserializes a string of at most `max` bytes; a longer one is an error before any
/// allocation (the decoder lends the bytes from the frame body).
pub fn bounded_string<'de, D: Deserializer<'de>>(d: D, max: usize) -> Result<String, D::Error> {
    struct Bounded(usize);
    impl Visitor<'_> for Bounded {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a string of at most {} bytes", self.0)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
            if v.len() > self.0 {
                return Err(E::invalid_length(v.len(), &self));
            }
            Ok(v.to_owned())
        }
    }
    d.deserialize_str(Bounded(max))
}

impl PeerId {
    /// Makes a peer id; `None` when it is empty or longer than [`MAX_PEER_ID_LEN`].
    pub fn new(s: impl Into<String>) -> Option<Self> {
        let s = s.into();
        (!s.is_empty() && s.len() <= MAX_PEER_ID_LEN).then_some(Self(s))
    }

    /// Whether a value that came off the wire is acceptable as a peer id.
    pub fn is_valid(&self) -> bool {
        !self.0.is_empty() && self.0.len() <= MAX_PEER_ID_LEN
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// A random id drawn at every process (channel) start. A peer id seen with a new incarnation
/// is a restarted peer: its old session is replaced and work in flight on it fails.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Incarnation(pub u64);

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

macro_rules! bytes16_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 16]);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for b in &self.0 {
                    write!(f, "{b:02x}")?;
                }
                Ok(())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let b = Blob::deserialize(d)?;
                let arr: [u8; 16] = b.0.as_slice().try_into().map_err(|_| {
                    de::Error::invalid_length(b.0.len(), &"16 bytes")
                })?;
                Ok(Self(arr))
            }
        }
    };
}

bytes16_id!(
    /// A registered memory region's id (a random 128-bit value, like a uuid).
    RegionId
);
bytes16_id!(
    /// The secret a listener hands an initiator in `Welcome`; the initiator presents it on its
    /// data connection(s) so the listener can bind them to that session and no other.
    SessionToken
);

/// A bearer credential for grant windows: a random 128-bit value the owner of a region
/// mints per request and opens windows for, and hands (out of band, e.g. in a request's
/// transfer parameters) to whoever is to read or write under it. A batch that names it
/// ([`crate::msg::Batch::grant`]) may reach what the token's windows cover. Whoever learns a
/// token can use it until its windows close, so it is never printed: `Debug` and `Display`
/// redact it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrantToken([u8; 16]);

impl GrantToken {
    /// Length in bytes.
    pub const LEN: usize = 16;

    /// The token with these bytes. An all-zero token is representable (it comes off the
    /// wire like any other) but never minted: owners refuse to open windows for it.
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self(b)
    }

    /// Its bytes (to hand to a peer; keep them out of logs).
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// Whether every byte is zero: what an unset value looks like, not a random token.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Debug for GrantToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GrantToken(<redacted>)")
    }
}

impl fmt::Display for GrantToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<grant token>")
    }
}

impl Serialize for GrantToken {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for GrantToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let b = Blob::deserialize(d)?;
        let arr: [u8; 16] =
            b.0.as_slice()
                .try_into()
                .map_err(|_| de::Error::invalid_length(b.0.len(), &"16 bytes"))?;
        Ok(Self(arr))
    }
}

/// An opaque byte string, encoded as msgpack `bin` (and accepted as an array of integers, as
/// some encoders write it).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Blob(pub Vec<u8>);

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Blob;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Blob, E> {
                Ok(Blob(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
                Ok(Blob(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Blob, A::Error> {
                // Cap the preallocation: the length hint comes from the peer.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(Blob(out))
            }
        }
        d.deserialize_any(V)
    }
}
