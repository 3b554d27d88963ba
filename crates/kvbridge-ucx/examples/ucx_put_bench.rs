//! Put throughput over UCX's tcp and shared-memory transports, next to a memcpy reference
//! measured in the same run.
//!
//! `cargo run --release -p kvbridge-ucx --features ucx --example ucx_put_bench -- [--reps 5]
//! [--mib 256] [--sizes 64K,256K,1M,4M] [--tls 'tcp|sm,self']`
//!
//! `--tls` lists the `UCX_TLS` values to compare, separated by `|`. Each gets a target process (this binary with `--serve TLS`) that registers a
//! 64 MiB region and progresses its worker. For every repetition and size, memcpy, tcp and sm
//! are measured in turn, each moving `--mib` MiB in puts of that size (up to 16 in flight,
//! then a flush). Prints the median of the repetitions and the spread (min-max) in GiB/s. Any
//! failed operation ends the run with an error and no figures.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_ucx::{Context, ContextConfig, EpId, MemRegion, OpId, RkeyId, Worker};

const REGION: usize = 64 << 20;
const WINDOW: usize = 16;
const OP_DEADLINE: Duration = Duration::from_secs(30);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn serve(tls: &str) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::new(&ContextConfig::with_tls(tls))?;
    let mut worker = Worker::new(&ctx)?;
    let region = MemRegion::alloc(&ctx, REGION)?;
    println!("ADDR {}", hex(worker.address()));
    println!("REGION {}", hex(&region.descriptor()?));
    std::io::stdout().flush()?;
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let mut sink = String::new();
        while std::io::stdin()
            .read_line(&mut sink)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
        d.store(true, Ordering::Release);
    });
    while !done.load(Ordering::Acquire) {
        worker.wait_events(Duration::from_millis(50))?;
    }
    Ok(())
}

struct Peer {
    child: Child,
    worker: Worker,
    local: MemRegion,
    ep: EpId,
    rkey: RkeyId,
}

fn start(tls: &str) -> Result<Peer, Box<dyn std::error::Error>> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve", tls])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |tag: &str| -> Result<Vec<u8>, Box<dyn std::error::Error>> {
        let line = lines.next().ok_or("target closed its output")??;
        Ok(unhex(
            line.strip_prefix(tag).ok_or("unexpected target output")?,
        ))
    };
    let address = next("ADDR ")?;
    let region = next("REGION ")?;
    let ctx = Context::new(&ContextConfig::with_tls(tls))?;
    let mut worker = Worker::new(&ctx)?;
    let local = MemRegion::alloc(&ctx, REGION)?;
    local.write(0, &vec![0x5a; REGION])?;
    let ep = worker.connect(tls, &address)?;
    let rkey = worker.unpack_rkey(ep, &region)?;
    Ok(Peer {
        child,
        worker,
        local,
        ep,
        rkey,
    })
}

/// Moves `total` bytes in puts of `size`, at most `WINDOW` in flight, then flushes. GiB/s.
fn put_run(
    p: &mut Peer,
    size: usize,
    total: usize,
    spin: bool,
) -> Result<f64, kvbridge_ucx::Error> {
    let n = total / size;
    let slots = REGION / size;
    let mut inflight: std::collections::VecDeque<OpId> = Default::default();
    let t0 = Instant::now();
    for i in 0..n {
        if inflight.len() == WINDOW {
            let op = inflight.pop_front().unwrap();
            if spin {
                let deadline = Instant::now() + OP_DEADLINE;
                while !p.worker.test(op)? {
                    p.worker.progress();
                    if Instant::now() > deadline {
                        return p.worker.wait(op, deadline).map(|_| 0.0);
                    }
                }
            } else {
                p.worker.wait(op, Instant::now() + OP_DEADLINE)?;
            }
        }
        let off = (i % slots) * size;
        inflight.push_back(p.worker.post_put(p.rkey, off as u64, &p.local, off, size)?);
    }
    for op in inflight {
        p.worker.wait(op, Instant::now() + OP_DEADLINE)?;
    }
    p.worker.flush(p.ep, Instant::now() + OP_DEADLINE)?;
    Ok((n * size) as f64 / t0.elapsed().as_secs_f64() / (1u64 << 30) as f64)
}

fn memcpy_run(src: &[u8], dst: &mut [u8], size: usize, total: usize) -> f64 {
    let n = total / size;
    let slots = REGION / size;
    let t0 = Instant::now();
    for i in 0..n {
        let off = (i % slots) * size;
        dst[off..off + size].copy_from_slice(&src[off..off + size]);
        std::hint::black_box(&dst[off]);
    }
    (n * size) as f64 / t0.elapsed().as_secs_f64() / (1u64 << 30) as f64
}

fn parse_size(s: &str) -> usize {
    let (num, mul) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("size") * mul
}

/// Median [min-max].
fn stats(v: &[f64]) -> String {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    format!("{:.2} [{:.2}-{:.2}]", v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--serve" {
        return serve(&args[2]);
    }
    let mut reps = 5;
    let mut mib = 256;
    let mut sizes: Vec<usize> = ["64K", "256K", "1M", "4M"]
        .iter()
        .map(|s| parse_size(s))
        .collect();
    let mut transports: Vec<String> = vec!["tcp".into(), "sm,self".into()];
    let mut spin = false;
    let mut i = 1;
    while i < args.len() {
        if args[i] == "--spin" {
            spin = true;
            i += 1;
            continue;
        }
        if i + 1 == args.len() {
            return Err(format!("{} needs a value", args[i]).into());
        }
        match args[i].as_str() {
            "--reps" => reps = args[i + 1].parse()?,
            "--mib" => mib = args[i + 1].parse()?,
            "--sizes" => sizes = args[i + 1].split(',').map(parse_size).collect(),
            "--tls" => transports = args[i + 1].split('|').map(String::from).collect(),
            other => return Err(format!("unknown argument {other}").into()),
        }
        i += 2;
    }
    let total = mib << 20;
    let mut peers = Vec::new();
    for tls in &transports {
        peers.push(start(tls)?);
    }
    let src = vec![0x5au8; REGION];
    let mut dst = vec![0u8; REGION];
    // [size][0 = memcpy, 1.. = transports][rep]
    let mut results = vec![vec![Vec::new(); 1 + transports.len()]; sizes.len()];
    // Warm-up: connects the endpoints and faults in both sides' pages.
    for p in peers.iter_mut() {
        put_run(p, 1 << 20, REGION, spin).map_err(|e| format!("warm-up failed: {e}"))?;
    }
    memcpy_run(&src, &mut dst, 1 << 20, REGION);
    for _ in 0..reps {
        for (si, &size) in sizes.iter().enumerate() {
            results[si][0].push(memcpy_run(&src, &mut dst, size, total));
            for (ti, p) in peers.iter_mut().enumerate() {
                let gib = put_run(p, size, total, spin)
                    .map_err(|e| format!("FAILED, no figures: {e}"))?;
                results[si][1 + ti].push(gib);
            }
        }
    }
    println!(
        "put throughput, GiB/s: median of {reps} [min-max], {mib} MiB per run, {WINDOW} puts in flight, target in another process"
    );
    let mut header = format!("{:>6} | {:>20}", "size", "memcpy");
    for tls in &transports {
        header += &format!(" | {:>20}", format!("ucx {tls}"));
    }
    for tls in &transports {
        header += &format!(" | {tls}/memcpy");
    }
    println!("{header}");
    for (si, &size) in sizes.iter().enumerate() {
        let median = |v: &[f64]| {
            let mut c = v.to_vec();
            c.sort_by(|a, b| a.total_cmp(b));
            c[c.len() / 2]
        };
        let m = median(&results[si][0]);
        let label = if size >= 1 << 20 {
            format!("{}M", size >> 20)
        } else {
            format!("{}K", size >> 10)
        };
        let mut row = format!("{label:>6} | {:>20}", stats(&results[si][0]));
        for r in &results[si][1..] {
            row += &format!(" | {:>20}", stats(r));
        }
        for (ti, tls) in transports.iter().enumerate() {
            let w = tls.len() + 7;
            row += &format!(" | {:>w$.3}", median(&results[si][1 + ti]) / m);
        }
        println!("{row}");
    }
    for mut p in peers {
        drop(p.child.stdin.take());
        let _ = p.child.wait();
        drop(p.worker);
    }
    Ok(())
}
