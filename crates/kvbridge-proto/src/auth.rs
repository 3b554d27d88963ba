//! Mutual authentication with a shared secret: HMAC-SHA256 challenge/response.
//!
//! Each side sends a fresh 32-byte challenge and proves it knows the secret by a MAC over
//! both challenges and both peer ids, with the role in the MAC's domain so that one side's
//! proof can never be replayed as the other's. Proofs are compared in constant time.

use crate::ids::PeerId;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// Length of a challenge in bytes.
pub const CHALLENGE_LEN: usize = 32;

/// A shared secret. Its `Debug` never shows the bytes, so it cannot end up in a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret from bytes; `None` when empty.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Self> {
        let b = bytes.into();
        (!b.is_empty()).then_some(Self(b))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Which side a proof is for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    Initiator,
    Listener,
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
}
