//! Bodies of kvbridge's fuzz targets (`fuzz_targets/*.rs` call them). Each takes the raw
//! bytes libFuzzer hands over and panics only when it finds a bug: bad input must end in a
//! clear error, never a panic, and whatever is accepted must be within bounds.
//!
//! The bodies live in a library so that `cargo test` replays every committed seed
//! (`fuzz/seeds/<target>/`) and every minimized crasher (`fuzz/regressions/<target>/`)
//! through exactly the code the fuzzer runs. See `fuzz/README.md`.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod frame_decoder;
pub mod handshake;
pub mod op_validation;
pub mod proxy_http;
pub mod proxy_request;
pub mod zmtp_pull;

#[cfg(test)]
mod replay {
    use std::path::PathBuf;

    /// Feeds every file of `seeds/<target>` and `regressions/<target>` to `run`; returns how
    /// many it fed.
    fn replay(target: &str, run: fn(&[u8])) -> usize {
        replay_corpus(target, target, run)
    }

    /// [`replay`] of `corpus`'s files through `target`'s body (targets that share seeds).
    fn replay_corpus(target: &str, corpus: &str, run: fn(&[u8])) -> usize {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for dir in ["seeds", "regressions"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir).join(corpus)) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
            files.sort();
            for f in files {
                let data = std::fs::read(&f).unwrap();
                eprintln!("{target}: {}", f.display());
                run(&data);
                n += 1;
            }
        }
        n
    }

    #[test]
    fn frame_decoder_seeds() {
        assert!(replay("frame_decoder", crate::frame_decoder::run) > 0);
    }

    #[test]
    fn handshake_seeds() {
        assert!(replay("handshake", crate::handshake::run) > 0);
    }

    #[test]
    fn op_validation_seeds() {
        assert!(replay("op_validation", crate::op_validation::run) > 0);
    }

    #[test]
    fn proxy_request_seeds() {
        assert!(replay("proxy_request", crate::proxy_request::run) > 0);
    }

    /// `proxy_http` takes the same inputs as `proxy_request` and shares its seeds and
    /// regressions (the request-id regressions are about HTTP).
    #[test]
    fn proxy_http_seeds() {
        assert!(replay_corpus("proxy_http", "proxy_request", crate::proxy_http::run) > 0);
    }

    #[test]
    fn zmtp_pull_seeds() {
        assert!(replay("zmtp_pull", crate::zmtp_pull::run) > 0);
    }
}
