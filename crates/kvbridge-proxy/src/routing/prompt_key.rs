//! A request's prompt as the routing policies match it: its token ids (`kv-events`) and the
//! pieces of its text (`cache-aware`).

use super::prefix_tree::{pieces, CHUNK_BYTES};

/// What a policy needs of a request's prompt.
#[derive(Debug, Clone, Default)]
pub struct PromptKey {
    /// The prompt's token ids, when the request gives them (a completion's `prompt` array)
    /// or a worker's `/tokenize` did (`--kv-events-tokenize http`): what `kv-events`
    /// matches. Without them, `kv-events` ranks by load alone.
    pub tokens: Option<Vec<u32>>,
    /// Pieces of the prompt's text (`messages` or `prompt` as sent): what `cache-aware`
    /// matches.
    pub pieces: Vec<u64>,
}

/// Bytes of prompt text per token, as the proxy estimates a prompt it has no token ids of.
const BYTES_PER_TOKEN: u64 = 4;

impl PromptKey {
    /// The prompt's tokens: exact when the request gives token ids, else estimated from
    /// its text (whole pieces, 4 bytes a token).
    pub fn estimated_tokens(&self) -> u64 {
        match &self.tokens {
            Some(t) => t.len() as u64,
            None => estimated_tokens_of_pieces(self.pieces.len() as u64),
        }
    }

    /// The key of a prompt given as raw JSON (`messages` or `prompt`).
    pub fn from_raw(raw: Option<&str>) -> PromptKey {
        let Some(raw) = raw else {
            return PromptKey::default();
        };
        PromptKey {
            tokens: serde_json::from_str::<Vec<u32>>(raw).ok(),
            pieces: pieces(raw.as_bytes()),
        }
    }
}

/// The tokens of `n` whole pieces of a prompt's text, as estimated (4 bytes a token).
pub fn estimated_tokens_of_pieces(n: u64) -> u64 {
    n * CHUNK_BYTES as u64 / BYTES_PER_TOKEN
}
