//! The listener half of the benchmarks, run as a second process (`kvbridge bench peer`).
//!
//! It listens with a kvbridge channel and a plain TCP sink on loopback, prints one line
//! `READY <channel addr> <region id> <sink addr>`, and serves until its stdin closes (so it
//! never outlives the benchmark that started it). With `echo` it sends every notification
//! back to its sender, except those of peers whose id starts with `flood`, which it takes
//! and drops (`kvbridge bench notify-flood`), and the sink echoes what it reads (`kvbridge
//! bench notify`). With `grant_windows` it also registers a second region of the same size
//! and contents whose reads are confined to windows, opens one window per `grant_windows`
//! bytes of it for a fresh grant token, and adds `<region id> <token hex>` to the line
//! (`kvbridge bench grant`).

use anyhow::{Context, Result};
use kvbridge::{Channel, ChannelConfig, Grant, Region};
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};

/// How to run the peer.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Size of the registered region.
    pub region_bytes: usize,
    /// Its page size.
    pub page: usize,
    /// Listen address.
    pub listen: String,
    /// Test hook: delay before answering a Hello.
    pub welcome_delay: Option<std::time::Duration>,
    /// Echo notifications and sink bytes back.
    pub echo: bool,
    /// With `echo`: the application's work per notification it takes (a busy wait), so
    /// that it, not the network, bounds how fast notifications are taken.
    pub work: std::time::Duration,
    /// Spend `work` asleep instead of busy: an application held up by something other
    /// than this host's CPU (a GPU, a lock).
    pub work_sleeps: bool,
    /// Also a windowed region, one token window per this many bytes.
    pub grant_windows: Option<usize>,
}

/// Runs the peer (the child side).
pub async fn run(opts: PeerOptions) -> Result<()> {
    let PeerOptions {
        region_bytes,
        page,
        listen,
        welcome_delay,
        echo,
        work,
        work_sleeps,
        grant_windows,
    } = opts;
    let mut cfg = ChannelConfig::new("bench-listener", Some(&listen));
    cfg.hooks.listener_welcome_delay = welcome_delay;
    let ch = Channel::new(cfg).await?;
    let region = Region::alloc(region_bytes, page)?;
    ch.register(&region, Grant::AllPeers)?;
    let granted = match grant_windows {
        Some(w) => Some(windowed_twin(&ch, &region, w)?),
        None => None,
    };
    let sink = std::net::TcpListener::bind("127.0.0.1:0")?;
    let sink_addr = sink.local_addr()?;
    // The ceiling lands in memory of the same size and kind as the channel's region, so
    // both pay the same cache and TLB misses.
    // One region per connection: each sink thread writes into its own.
    std::thread::spawn(move || {
        for s in sink.incoming().flatten() {
            std::thread::spawn(move || match echo {
                true => serve_echo(s),
                false => match Region::alloc(region_bytes, page) {
                    Ok(r) => serve_sink(s, r),
                    Err(e) => eprintln!("bench peer: no sink region: {e}"),
                },
            });
        }
    });
    if echo {
        tokio::spawn(echo_notifications(ch.clone(), work, work_sleeps));
    }
    let grant = granted
        .as_ref()
        .map(|(r, t)| {
            let hex: String = t.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
            format!(" {} {hex}", r.id())
        })
        .unwrap_or_default();
    println!(
        "READY {} {} {}{grant}",
        ch.local_addr().context("no listen address")?,
        region.id(),
        sink_addr
    );
    std::io::stdout().flush()?;
    if let Some(delay) = welcome_delay {
        tokio::spawn(say_hello_received(ch.clone(), delay));
    }
    // Serve until the parent closes our stdin (or dies).
    tokio::task::spawn_blocking(|| {
        let mut b = [0u8; 64];
        while matches!(std::io::stdin().read(&mut b), Ok(n) if n > 0) {}
    })
    .await?;
    ch.close().await;
    Ok(())
}

/// Fills `region` with a pattern, registers a region of the same size and contents whose
/// reads are confined to windows (otherwise granted as `region` is), and opens a window of
/// every `window` bytes of it for one fresh grant token.
fn windowed_twin(
    ch: &Channel,
    region: &Region,
    window: usize,
) -> Result<(Region, kvbridge::GrantToken)> {
    anyhow::ensure!(
        window > 0 && region.len().is_multiple_of(window),
        "--grant-windows {window} must divide the region's {} bytes",
        region.len()
    );
    let twin = Region::alloc(region.len(), region.page_size())?;
    let pattern: Vec<u8> = (0..region.len()).map(|i| (i * 7 + 3) as u8).collect();
    region.write_at(0, &pattern)?;
    twin.write_at(0, &pattern)?;
    ch.register(
        &twin,
        kvbridge::Permission::from(Grant::AllPeers).reads_in_windows(),
    )?;
    let token = kvbridge::new_grant_token();
    for at in (0..region.len()).step_by(window) {
        ch.open_token_window(
            twin.id(),
            &token,
            at as u64,
            window as u64,
            kvbridge::Access::ReadOnly,
        )?;
    }
    Ok((twin, token))
}

/// The ceiling's receiver: a plain socket read loop, block by block, cycling through a
/// buffer as large as the channel's region.
/// Protocol: 16-byte header (block size, total; little endian), then `total` bytes; one byte
/// back when all arrived.
fn serve_sink(mut s: std::net::TcpStream, region: Region) {
    let _ = s.set_nodelay(true);
    // SAFETY: the region is this connection's own (allocated for it, registered nowhere):
    // this thread is the only user of its bytes.
    let buf = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    let mut h = [0u8; 16];
    while s.read_exact(&mut h).is_ok() {
        let block = (u64::from_le_bytes(h[..8].try_into().unwrap()) as usize).clamp(1, buf.len());
        let total = u64::from_le_bytes(h[8..].try_into().unwrap());
        let (mut got, mut off) = (0u64, 0usize);
        while got < total {
            if off + block > buf.len() {
                off = 0;
            }
            let want = block.min((total - got) as usize);
            if s.read_exact(&mut buf[off..off + want]).is_err() {
                return;
            }
            off += want;
            got += want as u64;
        }
        if s.write_all(&[1]).is_err() {
            return;
        }
    }
}

/// With a Welcome delay (a listener stalled mid-handshake), prints `HELLO` once a `Hello`
/// has arrived: a test that kills this process then knows the initiator is past its TCP
/// connect and waiting for `Welcome`. A listener's session exists from its `Hello` on, so
/// the channel's stats show it; they are polled for no longer than the delay itself.
async fn say_hello_received(ch: Channel, delay: std::time::Duration) {
    let until = tokio::time::Instant::now() + delay;
    while tokio::time::Instant::now() < until {
        match ch.stats().await {
            Ok(s) if s.sessions > 0 => {
                println!("HELLO");
                let _ = std::io::stdout().flush();
                return;
            }
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
            Err(_) => return,
        }
    }
}

/// Sends every notification back to its sender, on that sender's session, after `work`
/// spent on it (busy, or asleep: `sleeps`); a flooder's (`bench flooder`, ids `flood…`)
/// are worked on and dropped.
async fn echo_notifications(ch: Channel, work: std::time::Duration, sleeps: bool) {
    let mut links = std::collections::HashMap::new();
    while let Some(n) = ch.recv_notification().await {
        if sleeps && !work.is_zero() {
            // Blocks this worker thread, as the application's own work would.
            std::thread::sleep(work);
        }
        let t = std::time::Instant::now();
        while !sleeps && t.elapsed() < work {
            std::hint::spin_loop();
        }
        if n.peer.as_str().starts_with("flood") {
            continue;
        }
        let link = match links.get(&n.peer) {
            Some(l) => l,
            None => match ch.link(&n.peer).await {
                Ok(l) => links.entry(n.peer.clone()).or_insert(l),
                Err(_) => continue,
            },
        };
        if link.notify_queued(&n.data).await.is_err() {
            links.remove(&n.peer);
        }
    }
}

/// The raw socket's reference for `bench notify`: echoes what it reads.
fn serve_echo(mut s: std::net::TcpStream) {
    let _ = s.set_nodelay(true);
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if s.write_all(&b[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

/// A started peer process.
pub struct PeerProcess {
    child: Child,
    /// The channel's listen address.
    pub addr: String,
    /// The registered region's id (hex).
    pub region: kvbridge::RegionId,
    /// The plain TCP sink's address.
    pub sink: String,
    /// With `--grant-windows`: the windowed region and the token its windows are open to.
    pub grant: Option<(kvbridge::RegionId, kvbridge::GrantToken)>,
}

impl PeerProcess {
    /// A peer that echoes notifications and sink bytes (`kvbridge bench notify`).
    pub fn start_echo() -> Result<Self> {
        Self::spawn(1 << 20, 4096, &[], &[], &["--echo"])
    }

    /// [`PeerProcess::start_echo`] whose application spends `work` on each notification
    /// (asleep with `sleeps`, else busy).
    pub fn start_echo_working(work: std::time::Duration, sleeps: bool) -> Result<Self> {
        let us = work.as_micros().to_string();
        let mut extra = vec!["--echo", "--work-us", &us];
        if sleeps {
            extra.push("--work-sleeps");
        }
        Self::spawn(1 << 20, 4096, &[], &[], &extra)
    }

    /// Starts `kvbridge bench peer` with environment variables set (`env`) and removed
    /// (`unset`) for the child (e.g. `KVBRIDGE_TLS_*`), and waits for its READY line.
    pub fn start_with(
        region_bytes: usize,
        page: usize,
        env: &[(&str, &std::ffi::OsStr)],
        unset: &[&str],
    ) -> Result<Self> {
        Self::spawn(region_bytes, page, env, unset, &[])
    }

    /// A peer with a windowed twin of its region, one token window per `window` bytes
    /// (`kvbridge bench grant`), over TCP only.
    pub fn start_granting(region_bytes: usize, page: usize, window: usize) -> Result<Self> {
        let tcp = [("KVBRIDGE_TRANSPORT", std::ffi::OsStr::new("tcp"))];
        let w = window.to_string();
        Self::spawn(region_bytes, page, &tcp, &[], &["--grant-windows", &w])
    }

    fn spawn(
        region_bytes: usize,
        page: usize,
        env: &[(&str, &std::ffi::OsStr)],
        unset: &[&str],
        extra: &[&str],
    ) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        for k in unset {
            cmd.env_remove(k);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .args(["bench", "peer", "--region-bytes", &region_bytes.to_string()])
            .args(["--page", &page.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the benchmark peer process")?;
        let mut out = child.stdout.take().context("no stdout")?;
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while out.read(&mut b)? == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        let line = String::from_utf8(line)?;
        let parts: Vec<&str> = line.split_whitespace().collect();
        anyhow::ensure!(
            (parts.len() == 4 || parts.len() == 6) && parts[0] == "READY",
            "benchmark peer said {line:?}"
        );
        let grant = match parts.get(4..6) {
            Some([r, t]) => Some((
                kvbridge::RegionId(hex16(r)?),
                kvbridge::GrantToken::from_bytes(hex16(t)?),
            )),
            _ => None,
        };
        Ok(Self {
            child,
            addr: parts[1].to_string(),
            region: kvbridge::RegionId(hex16(parts[2])?),
            sink: parts[3].to_string(),
            grant,
        })
    }
}

/// 16 bytes from 32 hex digits.
fn hex16(hex: &str) -> Result<[u8; 16]> {
    anyhow::ensure!(hex.len() == 32, "bad 16-byte hex {hex}");
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)?;
    }
    Ok(id)
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
