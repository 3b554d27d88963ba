//! `kvbridge bench …`: benchmarks that run initiator and listener in two processes.

pub mod digest;
pub mod grant;
pub mod handshake;
pub mod notify;
pub mod notify_flood;
pub mod peer;
pub mod proxy;
pub mod sample;
pub mod transfer;
