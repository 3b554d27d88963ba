//! Records the git commit this crate is built from (`KVBRIDGE_GIT_COMMIT`), so that soak
//! results name the code they measured: the full hash, `-dirty` when tracked files differed
//! from it at build time, or `unknown` outside a git checkout.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
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
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        for f in ["HEAD", "index", "packed-refs", "refs/heads"] {
            if dir.join(f).exists() {
                println!("cargo:rerun-if-changed={}", dir.join(f).display());
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
