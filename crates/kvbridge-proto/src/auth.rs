//! Mutual authentication with a shared secret: HMAC-SHA256 challenge/response.
//!
//! Each side sends a fresh 32-byte challenge and proves it knows the secret by a MAC over
//! both challenges and both peer ids, with the role in the MAC's domain so that one side's
//! proof can never be replayed as the other's. Proofs are compared in constant time.

use crate::ids::{PeerId, SessionToken};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// Length of a challenge in bytes.
pub const CHALLENGE_LEN: usize = 32;

/// A shared secret. Its `Debug` never shows the bytes, so it cannot end up in a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Fewest bytes a channel accepts as its secret (128 bits when they are random): the
    /// listener proves itself first, so anyone can take one proof away and search for a
    /// short secret offline.
    pub const MIN_LEN: usize = 16;

    /// A secret from bytes; `None` when empty. Channels refuse one shorter than
    /// [`Secret::MIN_LEN`] with a configuration error that names both lengths.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Self> {
        let b = bytes.into();
        (!b.is_empty()).then_some(Self(b))
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty (never, for a secret made by [`Secret::new`]).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Per-peer keys: a listener with a keyring checks a `Hello` that claims an id of the ring
/// against that id's key only (and proves itself with it), so a peer that holds another
/// id's key, or the shared secret, cannot claim that id. Ids not in the ring fall back to
/// the shared secret when one is set; without one they get a decoy key derived from the
/// ring, so the exchange fails exactly as with a wrong key and tells nobody which ids the
/// ring holds. `Debug` never shows a key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Keyring {
    keys: std::collections::BTreeMap<PeerId, Secret>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Keyring({} keys, <redacted>)", self.keys.len())
    }
}

impl Keyring {
    /// An empty ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) `peer`'s key.
    pub fn insert(&mut self, peer: PeerId, key: Secret) {
        self.keys.insert(peer, key);
    }

    /// How many ids have a key.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no id has a key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The shortest key in the ring (for the channel's minimum-length check).
    pub fn shortest(&self) -> Option<(&PeerId, usize)> {
        self.keys
            .iter()
            .map(|(p, k)| (p, k.len()))
            .min_by_key(|(_, l)| *l)
    }

    /// Parses `peer-id key` lines (blank lines and `#` comments skipped); the error names
    /// the line, never a key.
    pub fn parse(text: &str) -> Result<Keyring, String> {
        let mut ring = Keyring::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (id, key) = line
                .split_once(char::is_whitespace)
                .ok_or_else(|| format!("line {}: expected `peer-id key`", n + 1))?;
            let id = PeerId::new(id)
                .ok_or_else(|| format!("line {}: {id:?} is not a valid peer id", n + 1))?;
            let key = Secret::new(key.trim().as_bytes().to_vec())
                .ok_or_else(|| format!("line {}: empty key", n + 1))?;
            ring.insert(id, key);
        }
        Ok(ring)
    }

    /// The key a peer claiming `claimed` must prove: its own, else `shared`, else a decoy.
    pub fn key_for(&self, claimed: &PeerId, shared: Option<&Secret>) -> Secret {
        if let Some(k) = self.keys.get(claimed) {
            return k.clone();
        }
        if let Some(s) = shared {
            return s.clone();
        }
        // Unguessable while any key of the ring is secret, and stable per id.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(b"kvbridge/1 keyring decoy")
            .expect("any key length");
        for (p, k) in &self.keys {
            m.update(p.as_str().as_bytes());
            m.update(&[0]);
            m.update(&k.0);
            m.update(&[0]);
        }
        m.update(claimed.as_str().as_bytes());
        Secret(m.finalize().into_bytes().to_vec())
    }
}

/// Which side a proof is for (or the session's data-connection key).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    Initiator,
    Listener,
    DataKey,
}

/// A session's key for its data connections, derived from the secret and the session's
/// authentication exchange (both fresh challenges, both ids): each data connection proves
/// with it that it belongs to that session, in answer to a fresh challenge of the listener
/// (`DataChallenge`). Seeing a data connection's bytes teaches nothing that opens another.
/// Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct DataKey([u8; 32]);

impl fmt::Debug for DataKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataKey(<redacted>)")
    }
}

impl DataKey {
    fn mac(&self, nonce: &[u8], token: &SessionToken, stream: u32) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        m.update(b"kvbridge/1 data connection");
        m.update(&(nonce.len() as u32).to_le_bytes());
        m.update(nonce);
        m.update(&token.0);
        m.update(&stream.to_le_bytes());
        m
    }

    /// The initiator's answer to the challenge `nonce` on its data connection `stream` of
    /// the session whose token is `token`.
    pub fn prove(&self, nonce: &[u8], token: &SessionToken, stream: u32) -> Vec<u8> {
        self.mac(nonce, token, stream)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Checks such an answer, in constant time.
    pub fn verify(&self, nonce: &[u8], token: &SessionToken, stream: u32, proof: &[u8]) -> bool {
        self.mac(nonce, token, stream).verify_slice(proof).is_ok()
    }
}

/// The data-connection key of the session whose authentication exchanged `ci` and `cl`.
pub(crate) fn data_key(
    secret: &Secret,
    ci: &[u8],
    cl: &[u8],
    initiator: &PeerId,
    listener: &PeerId,
) -> DataKey {
    let k = mac(secret, Role::DataKey, ci, cl, initiator, listener).finalize();
    DataKey(k.into_bytes().into())
}

fn mac(
    secret: &Secret,
    role: Role,
    initiator_challenge: &[u8],
    listener_challenge: &[u8],
    initiator: &PeerId,
    listener: &PeerId,
) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(&secret.0).expect("HMAC takes any key length");
    m.update(match role {
        Role::Initiator => b"kvbridge/1 initiator proof",
        Role::Listener => b"kvbridge/1 listener proof\0",
        Role::DataKey => b"kvbridge/1 data-conn key\0\0",
    });
    for part in [
        initiator_challenge,
        listener_challenge,
        initiator.as_str().as_bytes(),
        listener.as_str().as_bytes(),
    ] {
        m.update(&(part.len() as u32).to_le_bytes());
        m.update(part);
    }
    m
}

/// The proof `role` sends.
pub(crate) fn prove(
    secret: &Secret,
    role: Role,
    ci: &[u8],
    cl: &[u8],
    initiator: &PeerId,
    listener: &PeerId,
) -> Vec<u8> {
    mac(secret, role, ci, cl, initiator, listener)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Checks a proof from `role`, in constant time.
pub(crate) fn verify(
    secret: &Secret,
    role: Role,
    ci: &[u8],
    cl: &[u8],
    initiator: &PeerId,
    listener: &PeerId,
    proof: &[u8],
) -> bool {
    mac(secret, role, ci, cl, initiator, listener)
        .verify_slice(proof)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_role_challenges_ids_and_secret() {
        let s = Secret::new(b"k".to_vec()).unwrap();
        let (i, l) = (PeerId::new("p").unwrap(), PeerId::new("d").unwrap());
        let p = prove(&s, Role::Listener, b"ci", b"cl", &i, &l);
        assert!(verify(&s, Role::Listener, b"ci", b"cl", &i, &l, &p));
        assert!(!verify(&s, Role::Initiator, b"ci", b"cl", &i, &l, &p));
        assert!(!verify(&s, Role::Listener, b"cx", b"cl", &i, &l, &p));
        assert!(!verify(&s, Role::Listener, b"ci", b"cl", &l, &i, &p));
        let other = Secret::new(b"j".to_vec()).unwrap();
        assert!(!verify(&other, Role::Listener, b"ci", b"cl", &i, &l, &p));
        assert!(!verify(&s, Role::Listener, b"ci", b"cl", &i, &l, &p[..31]));
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }

    /// A data-connection proof answers one challenge, for one session token and stream,
    /// under one session's key: replaying it for another stream, another challenge or under
    /// another session's key fails, and the key differs from both role proofs.
    #[test]
    fn data_proofs_bind_nonce_token_stream_and_session() {
        let s = Secret::new(b"k".to_vec()).unwrap();
        let (i, l) = (PeerId::new("p").unwrap(), PeerId::new("d").unwrap());
        let k = data_key(&s, b"ci", b"cl", &i, &l);
        assert_ne!(
            k.0.to_vec(),
            prove(&s, Role::Initiator, b"ci", b"cl", &i, &l)
        );
        assert_ne!(
            k.0.to_vec(),
            prove(&s, Role::Listener, b"ci", b"cl", &i, &l)
        );
        let t = SessionToken([5; 16]);
        let p = k.prove(b"n1", &t, 1);
        assert!(k.verify(b"n1", &t, 1, &p));
        assert!(!k.verify(b"n1", &t, 2, &p));
        assert!(!k.verify(b"n2", &t, 1, &p));
        assert!(!k.verify(b"n1", &SessionToken([6; 16]), 1, &p));
        let other = data_key(&s, b"ci", b"cx", &i, &l);
        assert!(!other.verify(b"n1", &t, 1, &p));
        assert_eq!(format!("{k:?}"), "DataKey(<redacted>)");
    }
}
