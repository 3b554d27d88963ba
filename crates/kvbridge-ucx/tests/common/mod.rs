//! A target peer for the UCX tests: a worker with one registered region that serves puts and
//! gets (UCX's tcp transport needs the target to progress) and answers the test's questions
//! about its memory. It runs as a thread of the test process or as a child process (the test
//! binary itself, re-run with `KVB_UCX_CHILD` set), driven by text lines.

#![allow(dead_code)]

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use kvbridge_ucx::{Context, ContextConfig, MemRegion, Worker};

/// The target's region: 16 MiB plus 8 KiB, so a 16 MiB transfer at offset 4096 fits.
pub const REGION_LEN: usize = (16 << 20) + (8 << 10);
/// The length and contents of the target's unregistered buffer (`SECRET`).
pub const SECRET_LEN: usize = 64 << 10;
pub const SECRET_SEED: u64 = 0x5EC2E7;
/// How long the test waits for any answer of the target before failing.
const ANSWER_DEADLINE: Duration = Duration::from_secs(30);
const PREFIX: &str = "KVBX ";

/// UCX's transports for the tests: its tcp transport and its shared-memory ones.
pub const TLS_VARIANTS: [&str; 2] = ["sm,self", "tcp"];

/// Deterministic, non-periodic bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The target's loop: announce address and region, then serve commands until `EXIT` or the
/// command source closes.
fn serve(config: ContextConfig, rx: Receiver<String>, out: &mut dyn FnMut(String)) {
    let ctx = Context::new(&config).expect("target context");
    let mut worker = Worker::new(&ctx).expect("target worker");
    let mut region = Some(MemRegion::alloc(&ctx, REGION_LEN).expect("target region"));
    out(format!("ADDR {}", hex(worker.address())));
    out(format!(
        "REGION {}",
        hex(&region.as_ref().unwrap().descriptor().expect("descriptor"))
    ));
    // (flag offset, checked offset, checked length) of a pending WATCH.
    let mut watch: Option<(usize, usize, usize)> = None;
    // A region allocated after the first was unmapped (`ALLOC2`).
    let mut second: Option<MemRegion> = None;
    // Memory of the target that no key names: never registered, never announced (`SECRET`).
    let secret = pattern(SECRET_SEED, SECRET_LEN);
    // Read afresh each time: UCX writes it behind the compiler's back.
    let secret_sum = || {
        let p = std::hint::black_box(secret.as_ptr());
        // SAFETY: `secret` is alive and `SECRET_LEN` long. The test reads it only through
        // this pointer, which the compiler cannot see through: an attacker's put changes it
        // from outside Rust, and no Rust reference to it is held across that.
        fnv(unsafe { std::slice::from_raw_parts(p, SECRET_LEN) })
    };
    loop {
        worker
            .wait_events(Duration::from_millis(10))
            .expect("target wait");
        if let (Some((flag, off, len)), Some(r)) = (watch, region.as_ref()) {
            let mut f = [0u8; 8];
            r.read(flag, &mut f).unwrap();
            if f != [0; 8] {
                // The notification landed: what came before it must be complete now.
                let mut body = vec![0u8; len];
                r.read(off, &mut body).unwrap();
                out(format!("WATCHED {}", fnv(&body)));
                watch = None;
            }
        }
        let line = match rx.try_recv() {
            Ok(l) => l,
            Err(mpsc::TryRecvError::Empty) => continue,
            Err(mpsc::TryRecvError::Disconnected) => break,
        };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w[i].parse::<usize>().expect("number");
        match w[0] {
            "SUM" => {
                let mut body = vec![0u8; num(2)];
                region.as_ref().unwrap().read(num(1), &mut body).unwrap();
                out(format!("SUM {}", fnv(&body)));
            }
            "FILL" => {
                region
                    .as_ref()
                    .unwrap()
                    .write(num(1), &pattern(num(3) as u64, num(2)))
                    .unwrap();
                out("OK".into());
            }
            "ZERO" => {
                region
                    .as_ref()
                    .unwrap()
                    .write(num(1), &vec![0u8; num(2)])
                    .unwrap();
                out("OK".into());
            }
            "WATCH" => {
                watch = Some((num(1), num(2), num(3)));
                out("OK".into());
            }
            "UNMAP" => {
                region = None;
                out("OK".into());
            }
            "ALLOC2" => {
                let r = MemRegion::alloc(&ctx, REGION_LEN).expect("second region");
                r.write(0, &pattern(num(1) as u64, REGION_LEN)).unwrap();
                second = Some(r);
                out("OK".into());
            }
            "SUM2" => {
                let mut body = vec![0u8; num(2)];
                second.as_ref().unwrap().read(num(1), &mut body).unwrap();
                out(format!("SUM {}", fnv(&body)));
            }
            "SECRET" => out(format!(
                "SECRET {} {}",
                secret.as_ptr() as u64,
                secret_sum()
            )),
            "EXIT" => break,
            other => panic!("target: unknown command {other}"),
        }
    }
}

/// The test's handle on a target.
pub struct Target {
    cmds: Option<Sender<String>>,
    stdin: Option<ChildStdin>,
    answers: Receiver<String>,
    pub child: Option<Child>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The target worker's address (envelope).
    pub address: Vec<u8>,
    /// The target region's descriptor (envelope).
    pub region: Vec<u8>,
}

impl Target {
    /// A target on a thread of this process.
    pub fn thread(tls: &str) -> Target {
        Self::thread_with(ContextConfig::with_tls(tls))
    }

    /// A target on a thread of this process, its context made from `config`.
    pub fn thread_with(config: ContextConfig) -> Target {
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (ans_tx, ans_rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            serve(config, cmd_rx, &mut |l| {
                let _ = ans_tx.send(l);
            })
        });
        Self::announced(Target {
            cmds: Some(cmd_tx),
            stdin: None,
            answers: ans_rx,
            child: None,
            thread: Some(thread),
            address: vec![],
            region: vec![],
        })
    }

    /// A target in a child process: this test binary, running only `child_test`, with
    /// `UCX_TLS=tls` in its environment.
    pub fn process(tls: &str, child_test: &str) -> Target {
        let exe = std::env::current_exe().expect("test binary path");
        let mut child = Command::new(exe)
            .args([child_test, "--exact", "--nocapture", "--test-threads", "1"])
            // The child takes its transports from UCX's own environment, as a user sets them.
            .env("KVB_UCX_CHILD", "1")
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the target process");
        let stdout = child.stdout.take().unwrap();
        let (ans_tx, ans_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest's own "test NAME ... " may start the line of the first answer.
                if let Some(at) = line.find(PREFIX) {
                    if ans_tx.send(line[at + PREFIX.len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let stdin = child.stdin.take();
        Self::announced(Target {
            cmds: None,
            stdin,
            answers: ans_rx,
            child: Some(child),
            thread: None,
            address: vec![],
            region: vec![],
        })
    }

    fn announced(mut t: Target) -> Target {
        let a = t.answer();
        t.address = unhex(a.strip_prefix("ADDR ").expect("ADDR first"));
        let r = t.answer();
        t.region = unhex(r.strip_prefix("REGION ").expect("REGION second"));
        t
    }

    pub fn answer(&mut self) -> String {
        self.answers
            .recv_timeout(ANSWER_DEADLINE)
            .expect("the target answers within 30 s")
    }

    pub fn send(&mut self, line: &str) {
        if let Some(tx) = &self.cmds {
            tx.send(line.to_string()).expect("target thread alive");
        } else if let Some(stdin) = &mut self.stdin {
            writeln!(stdin, "{line}").expect("target process alive");
            stdin.flush().unwrap();
        }
    }

    pub fn ask(&mut self, line: &str) -> String {
        self.send(line);
        self.answer()
    }

    /// SIGKILL the child process and reap it.
    pub fn kill(&mut self) {
        let child = self.child.as_mut().expect("a process target");
        child.kill().expect("kill the target");
        child.wait().expect("reap the target");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.send_exit();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Target {
    fn send_exit(&mut self) {
        if let Some(tx) = self.cmds.take() {
            let _ = tx.send("EXIT".into());
        }
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "EXIT");
        }
    }
}

/// The body of the child-process test: serves when this binary was started as a target,
/// returns at once otherwise.
pub fn child_entry() {
    if std::env::var_os("KVB_UCX_CHILD").is_none() {
        return;
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stdout = std::io::stdout();
    serve(ContextConfig::default(), rx, &mut |l| {
        let mut o = stdout.lock();
        let _ = writeln!(o, "{PREFIX}{l}");
        let _ = o.flush();
    });
}

/// An initiator: context, worker, a local region of `REGION_LEN`, an endpoint to `target` and
/// its region's remote key.
pub struct Initiator {
    pub worker: Worker,
    pub local: MemRegion,
    pub ep: kvbridge_ucx::EpId,
    pub rkey: kvbridge_ucx::RkeyId,
    pub ctx: Context,
}

impl Initiator {
    pub fn to(tls: &str, target: &Target) -> Initiator {
        let ctx = Context::new(&ContextConfig::with_tls(tls)).expect("context");
        let mut worker = Worker::new(&ctx).expect("worker");
        let local = MemRegion::alloc(&ctx, REGION_LEN).expect("local region");
        let ep = worker
            .connect("target", &target.address)
            .expect("ep_create");
        let rkey = worker.unpack_rkey(ep, &target.region).expect("rkey_unpack");
        Initiator {
            worker,
            local,
            ep,
            rkey,
            ctx,
        }
    }
}

pub fn deadline(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

/// The ports of this process's sockets listening on 127.0.0.1 (`/proc/net/tcp`, matched to
/// this process's descriptors by inode).
pub fn listening_ports() -> HashSet<u16> {
    let ours: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (ip, port) = f.get(1)?.split_once(':')?;
            (ip == "0100007F" && f.get(3) == Some(&"0A") && ours.contains(*f.get(9)?))
                .then(|| u16::from_str_radix(port, 16).ok())?
        })
        .collect()
}
