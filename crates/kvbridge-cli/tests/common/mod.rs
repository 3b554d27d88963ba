//! Helpers for the tests that run `kvbridge` as a separate process.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, ChildStdout, Command, Stdio};

/// A `kvbridge bench peer` process: its channel address and registered region. Killed on
/// drop.
pub struct Peer {
    pub child: Child,
    pub addr: String,
    pub region: kvbridge::RegionId,
    /// The rest of its stdout (kept open: a peer that prints after `READY` must not meet a
    /// closed pipe).
    pub stdout: ChildStdout,
}

impl Peer {
    /// Reads the peer's next stdout line (blocking; the peer prints nothing else unasked).
    pub fn next_line(&mut self) -> String {
        read_line(&mut self.stdout)
    }
}

fn read_line(out: &mut ChildStdout) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).expect("read a line of the peer's stdout") == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line).expect("utf8")
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` (a `kvbridge bench peer` command line, possibly behind `ip netns exec`) and
/// reads its `READY <addr> <region id> <sink addr>` line.
pub fn spawn_peer(mut cmd: Command) -> Peer {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvbridge bench peer");
    let mut out = child.stdout.take().expect("stdout piped");
    let line = read_line(&mut out);
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(parts.first(), Some(&"READY"), "{line}");
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&parts[2][2 * i..2 * i + 2], 16).expect("hex region id");
    }
    Peer {
        child,
        addr: parts[1].to_string(),
        region: kvbridge::RegionId(id),
        stdout: out,
    }
}

/// Runs `cmd` (a `kvbridge ... --json` command line), asserts it succeeded, and parses the
/// one JSON object it printed.
pub fn run_json(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}
