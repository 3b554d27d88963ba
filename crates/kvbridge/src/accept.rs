//! The acceptor: accepts connections on the channel's listeners (TCP, and the unix socket of
//! its shared-memory offer), reads and classifies each one's first frame (a `Hello`, a data
//! connection's `DataHello`, a TLS ClientHello) within its deadline, refuses what does not
//! fit, and hands the rest to the core task ([`CoreCmd`]).

use crate::cmd::CoreCmd;
use crate::config::ChannelConfig;
use crate::net::{Listener, Stream};
use crate::session::{refuse, refuse_lingering};
use crate::tls::Tls;
use crate::wire::{read_frame, ReadError};
use kvbridge_proto::msg::{ErrorCode, Message};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::mpsc;

pub(crate) async fn accept_loop(
    l: Listener,
    config: Arc<ChannelConfig>,
    core: mpsc::UnboundedSender<CoreCmd>,
    tls: Option<Arc<Tls>>,
) {
    let unidentified = Arc::new(tokio::sync::Semaphore::new(
        config.limits.max_unidentified_connections.max(1),
    ));
    loop {
        match l.accept().await {
            Ok((stream, from)) => {
                // Each connection's first frame is read in its own task: a silent or slow
                // client delays only itself. Their number is bounded: past the limit a new
                // connection is closed at once.
                let Ok(permit) = unidentified.clone().try_acquire_owned() else {
                    if let Some(suppressed) = crate::refusals::UNIDENTIFIED_LIMIT.allow() {
                        tracing::warn!(
                            %from,
                            limit = config.limits.max_unidentified_connections,
                            suppressed,
                            "too many connections without a first frame; closing this one"
                        );
                    }
                    drop(stream);
                    continue;
                };
                let core = core.clone();
                let config = config.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    classify(stream, from, config, core, tls).await;
                    drop(permit);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                // Out of file descriptors and similar: back off instead of spinning.
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

pub(crate) async fn shm_accept_loop(
    l: tokio::net::UnixListener,
    config: Arc<ChannelConfig>,
    core: mpsc::UnboundedSender<CoreCmd>,
) {
    // As on TCP: connections that have not presented a token yet are bounded.
    let unidentified = Arc::new(tokio::sync::Semaphore::new(
        config.limits.max_unidentified_connections.max(1),
    ));
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    loop {
        match l.accept().await {
            Ok((stream, _)) => {
                // The abstract socket is reachable by every user of the network namespace;
                // only our own user's processes may map our memory.
                let uid = crate::transport::shm::peer_uid(&stream);
                if uid != Some(me) {
                    if let Some(suppressed) = crate::refusals::UNIX_REFUSED.allow() {
                        tracing::warn!(
                            ?uid,
                            ours = me,
                            suppressed,
                            "unix-socket connection from another user; closed"
                        );
                    }
                    continue;
                }
                let Ok(permit) = unidentified.clone().try_acquire_owned() else {
                    if let Some(suppressed) = crate::refusals::UNIX_REFUSED.allow() {
                        tracing::warn!(
                            limit = config.limits.max_unidentified_connections,
                            suppressed,
                            "too many unix-socket connections without a token; closing this one"
                        );
                    }
                    continue;
                };
                let core = core.clone();
                let limit = config.deadlines.first_frame;
                let max = config.limits.first_frame_limit();
                tokio::spawn(async move {
                    // No descriptor is expected: one closes the connection.
                    let mut fr = crate::transport::shm::FdReader::new(max, 0);
                    // Anything but a DataHello in time gets nothing: the connection drops.
                    if let Ok(Ok(Some(Message::DataHello(hello)))) =
                        tokio::time::timeout(limit, fr.next(&stream)).await
                    {
                        let _ = core.send(CoreCmd::ShmIncoming { stream, hello });
                    }
                    drop(permit);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "unix accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

async fn classify(
    stream: Stream,
    from: SocketAddr,
    config: Arc<ChannelConfig>,
    core: mpsc::UnboundedSender<CoreCmd>,
    tls: Option<Arc<Tls>>,
) {
    // One deadline for everything before the first frame: the TLS handshake included.
    let limit = config.deadlines.first_frame;
    let deadline = tokio::time::Instant::now() + limit;
    let mut stream = stream;
    let tls = tls.filter(|t| t.accepts());
    let mut over_tls = false;
    if let (Some(tls), Stream::Tokio(s)) = (&tls, &stream) {
        let mut first = [0u8; 1];
        match tokio::time::timeout_at(deadline, s.peek(&mut first)).await {
            Ok(Ok(1)) if first[0] == crate::tls::TLS_HANDSHAKE_RECORD => {
                match tls.accept(stream, &from.to_string(), deadline).await {
                    Ok(s) => {
                        stream = s;
                        over_tls = true;
                    }
                    Err(e) => {
                        // The peer learns of it from its own TLS stack (an alert, or the
                        // close); we count and log it.
                        if let Some(suppressed) = crate::refusals::TLS_REFUSED.allow() {
                            tracing::warn!(%from, error = %e, suppressed, "TLS handshake failed");
                        }
                        let _ = core.send(CoreCmd::TlsRefused);
                        return;
                    }
                }
            }
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                let msg = format!("no first frame within {limit:?}");
                return refuse(stream, ErrorCode::Timeout, &msg).await;
            }
        }
    }
    let mut buf = Vec::new();
    let read = read_frame(&mut stream, config.limits.first_frame_limit(), &mut buf);
    let first = tokio::time::timeout_at(deadline, read).await;
    match first {
        Ok(Ok(Message::Hello(_))) if tls.is_some() && !over_tls => {
            // Counted before the refusal goes out: a peer that saw it finds it counted.
            let _ = core.send(CoreCmd::TlsRefused);
            if let Some(suppressed) = crate::refusals::TLS_REFUSED.allow() {
                tracing::warn!(
                    %from,
                    suppressed,
                    "plaintext Hello on a listener that requires TLS; refused"
                );
            }
            let msg = "this listener requires TLS on the control connection \
                       (KVBRIDGE_TLS_CA on the initiator); the Hello came in plaintext";
            refuse(stream, ErrorCode::Incompatible, msg).await
        }
        Ok(Ok(Message::DataHello(_))) if tls.as_ref().is_some_and(|t| t.on_data()) && !over_tls => {
            // Refused before its token is looked at: a token seen on the path opens nothing,
            // and the refusal says nothing about the sessions here.
            let _ = core.send(CoreCmd::TlsRefused);
            if let Some(suppressed) = crate::refusals::TLS_REFUSED.allow() {
                tracing::warn!(
                    %from,
                    suppressed,
                    "plaintext DataHello on a listener that requires TLS on data connections; refused"
                );
            }
            let msg = "this listener requires TLS on data connections \
                       (KVBRIDGE_TLS_DATA=1 on the initiator); the DataHello came in plaintext";
            refuse(stream, ErrorCode::Incompatible, msg).await
        }
        Ok(Ok(m @ (Message::Hello(_) | Message::DataHello(_)))) => {
            let _ = core.send(CoreCmd::Incoming {
                stream,
                first: Box::new(m),
                from,
            });
        }
        Ok(Ok(m)) => {
            let msg = format!("{} cannot open a connection", m.name());
            refuse(stream, ErrorCode::UnexpectedMessage, &msg).await
        }
        Ok(Err(ReadError::Frame(e))) => {
            let code = match e {
                kvbridge_proto::FrameError::UnsupportedVersion { .. } => {
                    ErrorCode::UnsupportedVersion
                }
                kvbridge_proto::FrameError::TooLarge { .. } => ErrorCode::LimitExceeded,
                _ => ErrorCode::Malformed,
            };
            let tls_record = kvbridge_proto::FrameError::BadMagic {
                got: [crate::tls::TLS_HANDSHAKE_RECORD, 0x03],
            };
            if tls.is_none() && e == tls_record {
                // A TLS ClientHello on a plaintext listener. The refusal is not TLS, so the
                // peer's TLS stack reports a non-TLS answer; read the rest of its
                // ClientHello first, or closing with unread bytes would reset the
                // connection before the refusal reaches it.
                if let Some(suppressed) = crate::refusals::TLS_REFUSED.allow() {
                    tracing::warn!(
                        %from,
                        suppressed,
                        "a TLS ClientHello on a plaintext listener; refused"
                    );
                }
                let _ = core.send(CoreCmd::TlsRefused);
                return refuse_lingering(stream, code, "this listener does not speak TLS").await;
            }
            refuse(stream, code, &e.to_string()).await
        }
        Ok(Err(_)) => {}
        Err(_) => {
            let msg = format!("no first frame within {limit:?}");
            refuse(stream, ErrorCode::Timeout, &msg).await
        }
    }
}
