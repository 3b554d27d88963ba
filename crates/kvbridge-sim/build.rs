//! Records the git commit this crate is built from (`KVBRIDGE_GIT_COMMIT`), so that soak
//! results name the code they measured: the full hash, `-dirty` when tracked files differed
//! from it at build time, or `unknown` outside a git checkout.

use std::path::PathBuf;
use std::process::Command;

/// The crate's folder, read when the script runs: `env!` would bake in the folder the script
/// was compiled in, and Cargo reuses a compiled build script for another checkout of the same
/// workspace sharing a target folder (`CARGO_TARGET_DIR`), which then recorded that
/// checkout's commit. Cargo still reruns the script only when the git state of the checkout
/// it last read changes: checkouts that should name their own commits take their own
/// target folders.
fn manifest_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("Cargo sets CARGO_MANIFEST_DIR"))
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(manifest_dir())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = match git(&["rev-parse", "HEAD"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=KVBRIDGE_GIT_COMMIT={commit}");
    // Built again when HEAD moves (a commit, a checkout) or the index changes.
    for dir in [
        git(&["rev-parse", "--git-dir"]),
        git(&["rev-parse", "--git-common-dir"]),
    ]
    .into_iter()
    .flatten()
    {
        let dir = manifest_dir().join(dir);
        for f in ["HEAD", "index", "packed-refs", "refs/heads"] {
            if dir.join(f).exists() {
                println!("cargo:rerun-if-changed={}", dir.join(f).display());
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
