//! TLS on the control connection, and optionally on the TCP data connections: rustls (TLS
//! 1.3 only, ring provider) below the sans-IO protocol. The listener's acceptor and the
//! initiator's connector are built once, when the channel starts, so that a missing file or
//! a bad PEM is a typed error at [`crate::Channel::new`], not at the first handshake.

use crate::config::{Pem, TlsConfig};
use crate::error::{Error, Result};
use crate::net::Stream;
use kvbridge_proto::handshake::Step;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The first byte of a TLS handshake record (a ClientHello); a kvbridge frame starts with
/// `K`. A listener tells the two apart by peeking at it.
pub(crate) const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// What a channel with TLS on holds: the acceptor when it listens, the connector when it
/// was given certificates to trust.
pub(crate) struct Tls {
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    connector: Option<tokio_rustls::TlsConnector>,
    server_name: Option<ServerName<'static>>,
    /// TLS on the data connections too ([`TlsConfig::data`]).
    data: bool,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_pem(what: &str, p: &Pem) -> Result<Vec<u8>> {
    match p {
        Pem::File(path) => std::fs::read(path)
            .map_err(|e| Error::Local(format!("TLS {what}: cannot read {}: {e}", path.display()))),
        Pem::Text(t) => Ok(t.clone().into_bytes()),
    }
}

fn certs(what: &str, p: &Pem) -> Result<Vec<CertificateDer<'static>>> {
    let bytes = read_pem(what, p)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Local(format!("TLS {what}: {p} is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::Local(format!("TLS {what}: no certificate in {p}")));
    }
    Ok(certs)
}

impl Tls {
    /// Builds what `config` asks for. A listening channel needs a certificate chain and its
    /// key; every error names the setting and the file, never a key's bytes.
    pub(crate) fn new(config: &TlsConfig, listens: bool) -> Result<Tls> {
        let versions = &[&rustls::version::TLS13];
        let acceptor = match (&config.cert_chain, &config.private_key) {
            (Some(chain), Some(key)) => {
                let chain = certs("certificate chain", chain)?;
                let key_bytes = read_pem("private key", key)?;
                let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|e| {
                    Error::Local(format!("TLS private key: no usable key in {key}: {e}"))
                })?;
                let server = rustls::ServerConfig::builder_with_provider(provider())
                    .with_protocol_versions(versions)
                    .map_err(|e| Error::Local(format!("TLS: {e}")))?
                    .with_no_client_auth()
                    .with_single_cert(chain, key)
                    .map_err(|e| {
                        Error::Local(format!(
                            "TLS: the certificate chain and key do not fit: {e}"
                        ))
                    })?;
                Some(tokio_rustls::TlsAcceptor::from(Arc::new(server)))
            }
            (None, None) if !listens => None,
            (None, None) => {
                return Err(Error::Local(
                    "TLS is on and this channel listens: set a certificate chain and a \
                     private key (KVBRIDGE_TLS_CERT, KVBRIDGE_TLS_KEY)"
                        .into(),
                ))
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(Error::Local(
                    "TLS: a certificate chain needs its private key and the other way round \
                     (KVBRIDGE_TLS_CERT, KVBRIDGE_TLS_KEY)"
                        .into(),
                ))
            }
        };
        let connector = match &config.trusted {
            Some(t) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs("trusted certificates", t)? {
                    roots
                        .add(c)
                        .map_err(|e| Error::Local(format!("TLS trusted certificates: {t}: {e}")))?;
                }
                let client = rustls::ClientConfig::builder_with_provider(provider())
                    .with_protocol_versions(versions)
                    .map_err(|e| Error::Local(format!("TLS: {e}")))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                Some(tokio_rustls::TlsConnector::from(Arc::new(client)))
            }
            None => None,
        };
        let server_name = match &config.server_name {
            Some(n) => Some(ServerName::try_from(n.clone()).map_err(|e| {
                Error::Local(format!(
                    "TLS server name {n:?} is not a DNS name or an IP: {e}"
                ))
            })?),
            None => None,
        };
        Ok(Tls {
            acceptor,
            connector,
            server_name,
            data: config.data,
        })
    }

    /// Whether this channel requires TLS on the control connections it accepts.
    pub(crate) fn accepts(&self) -> bool {
        self.acceptor.is_some()
    }

    /// Whether data connections run over TLS too: an initiator dials them over TLS, a
    /// listener refuses them in plaintext.
    pub(crate) fn on_data(&self) -> bool {
        self.data
    }

    /// Runs the initiator's TLS handshake on a fresh control connection to `addr`, within
    /// `limit`. Every failure is typed and names the peer (its address) and [`Step::Tls`].
    pub(crate) async fn connect(&self, s: Stream, addr: &str, limit: Duration) -> Result<Stream> {
        self.connect_at(s, addr, addr, limit, Step::Tls).await
    }

    /// [`Tls::connect`] for a data connection: failures name `peer` and [`Step::DataBind`].
    pub(crate) async fn connect_data(
        &self,
        s: Stream,
        addr: &str,
        peer: &str,
        limit: Duration,
    ) -> Result<Stream> {
        self.connect_at(s, addr, peer, limit, Step::DataBind).await
    }

    async fn connect_at(
        &self,
        s: Stream,
        addr: &str,
        peer: &str,
        limit: Duration,
        step: Step,
    ) -> Result<Stream> {
        let Some(connector) = &self.connector else {
            return Err(Error::Local(format!(
                "TLS is on but no certificate to trust is set (KVBRIDGE_TLS_CA): cannot dial {addr}"
            )));
        };
        let Stream::Tokio(tcp) = s else {
            return Err(Error::Local("TLS needs a real socket".into()));
        };
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => host_name(addr)?,
        };
        match tokio::time::timeout(limit, connector.connect(name, tcp)).await {
            Ok(Ok(s)) => Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(s)))),
            Ok(Err(e)) => Err(tls_error(peer, step, e)),
            Err(_) => Err(Error::Timeout {
                peer: peer.to_string(),
                step,
                after: limit,
            }),
        }
    }

    /// Runs the listener's TLS handshake on an accepted connection whose first byte is a TLS
    /// record, by `deadline`.
    pub(crate) async fn accept(&self, s: Stream, from: &str, deadline: Instant) -> Result<Stream> {
        let (Some(acceptor), Stream::Tokio(tcp)) = (&self.acceptor, s) else {
            return Err(Error::Local("TLS accept without an acceptor".into()));
        };
        match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
            Ok(Ok(s)) => Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(s)))),
            Ok(Err(e)) => Err(tls_error(from, Step::Tls, e)),
            Err(_) => Err(Error::Timeout {
                peer: from.to_string(),
                step: Step::Tls,
                after: deadline.saturating_duration_since(Instant::now()),
            }),
        }
    }
}

/// The host part of `host:port` (`[v6]:port` too) as the name the listener's certificate
/// must carry.
fn host_name(addr: &str) -> Result<ServerName<'static>> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|e| {
        Error::Local(format!(
            "TLS: {host:?} (from {addr}) is not a DNS name or an IP to check the certificate \
             against ({e}); set a server name (KVBRIDGE_TLS_SERVER_NAME)"
        ))
    })
}

/// Sorts a failed TLS handshake by cause, like the rest of [`Error`]: the peer's
/// certificate was not acceptable (`Unauthenticated`), the peer does not speak TLS or not
/// our TLS (`Incompatible`), it broke TLS (`PeerMisbehaved`), or the connection broke.
/// `step` is [`Step::Tls`] on a control connection, [`Step::DataBind`] on a data one.
pub(crate) fn tls_error(peer: &str, step: Step, e: std::io::Error) -> Error {
    use rustls::Error as R;
    let peer_s = peer.to_string();
    let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<R>()) else {
        return Error::lost(peer, step, e);
    };
    let ours = match step {
        Step::Tls => "TLS 1.3 on the control connection",
        _ => "TLS 1.3 on the data connection",
    }
    .to_string();
    match r {
        R::InvalidCertificate(c) => Error::Unauthenticated {
            peer: peer_s,
            step,
            detail: format!("its TLS certificate is not acceptable: {c}"),
        },
        R::NoCertificatesPresented => Error::Unauthenticated {
            peer: peer_s,
            step,
            detail: "it presented no TLS certificate".into(),
        },
        R::AlertReceived(a) => {
            use rustls::AlertDescription as A;
            match a {
                A::BadCertificate
                | A::UnknownCA
                | A::CertificateUnknown
                | A::CertificateExpired
                | A::CertificateRevoked
                | A::UnsupportedCertificate
                | A::AccessDenied => Error::Unauthenticated {
                    peer: peer_s,
                    step,
                    detail: format!("it refused our TLS certificate (alert {a:?})"),
                },
                _ => Error::Incompatible {
                    peer: peer_s,
                    step,
                    ours,
                    theirs: format!("refused the TLS handshake (alert {a:?})"),
                },
            }
        }
        R::InvalidMessage(_)
        | R::InappropriateMessage { .. }
        | R::InappropriateHandshakeMessage { .. } => Error::Incompatible {
            peer: peer_s,
            step,
            ours,
            theirs: format!("not TLS ({r}): a plaintext kvbridge peer?"),
        },
        R::PeerIncompatible(x) => Error::Incompatible {
            peer: peer_s,
            step,
            ours,
            theirs: format!("{x:?}"),
        },
        other => Error::PeerMisbehaved {
            peer: peer_s,
            step,
            detail: format!("TLS: {other}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_name_is_the_host_part_of_the_address() {
        assert_eq!(
            host_name("127.0.0.1:8300").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        assert_eq!(
            host_name("[::1]:8300").unwrap(),
            ServerName::try_from("::1").unwrap()
        );
        assert_eq!(
            host_name("decode-0.pool:8300").unwrap(),
            ServerName::try_from("decode-0.pool").unwrap()
        );
        assert!(matches!(host_name("bad name:1"), Err(Error::Local(_))));
    }

    #[test]
    fn a_listening_channel_needs_a_certificate_and_its_key() {
        let none = TlsConfig::default();
        assert!(matches!(Tls::new(&none, true), Err(Error::Local(_))));
        assert!(Tls::new(&none, false).is_ok());
        let half = TlsConfig {
            cert_chain: Some(Pem::Text(String::new())),
            ..TlsConfig::default()
        };
        assert!(matches!(Tls::new(&half, false), Err(Error::Local(_))));
        let missing = TlsConfig {
            trusted: Some(Pem::File("/nonexistent/ca.pem".into())),
            ..TlsConfig::default()
        };
        match Tls::new(&missing, false) {
            Err(Error::Local(m)) => assert!(m.contains("/nonexistent/ca.pem"), "{m}"),
            other => panic!(
                "expected a local error naming the file, got {:?}",
                other.err()
            ),
        }
        let garbage = TlsConfig {
            trusted: Some(Pem::Text("not pem".into())),
            ..TlsConfig::default()
        };
        assert!(matches!(Tls::new(&garbage, false), Err(Error::Local(_))));
    }
}
