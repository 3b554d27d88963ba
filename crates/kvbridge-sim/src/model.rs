//! The reference model: a deterministic stand-in for an LLM whose KV cache and outputs can be
//! checked byte for byte.
//!
//! - **Tokenizer**: whitespace-separated words. The 4900 words of a fixed two-syllable
//!   vocabulary (`baba`, `babe`, ... `zuzu`) get ids `0..4900`; any other word gets an id
//!   above that from a hash of its bytes. Generated tokens are always vocabulary words and
//!   render as `" word"`, so a prompt followed by a generated token's text tokenizes to the
//!   prompt's tokens plus that token (what the proxy relies on when it hands the decoder
//!   "prompt + first token").
//! - **KV**: the KV of position `t` is a deterministic function of a prefix hash over
//!   `tokens[0..=t]`, the layer, K or V, and (for the standard layout) the rank: bytes from a
//!   seeded splitmix64 generator, laid out exactly as the PD layer's layout says
//!   (`(layers, 2, tokens, kv_heads, head_dim)` or MLA `(layers, 1, tokens, latent_dim)`).
//!   MLA KV is the same on every rank.
//! - **Next token**: a hash over *every byte of KV held*, position by position (a digest of
//!   each position's bytes on every rank, chained). A single misplaced or corrupted byte
//!   anywhere in the prompt's KV changes every later token.

use kvbridge_pd::{KvLayout, KvSpec};
use std::collections::HashMap;
use std::sync::OnceLock;

const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
const VOWELS: &[u8] = b"aeiou";

/// Number of words in the fixed vocabulary (ids `0..VOCAB_SIZE`).
pub const VOCAB_SIZE: u32 = 4900;

fn vocab() -> &'static (Vec<String>, HashMap<String, u32>) {
    static V: OnceLock<(Vec<String>, HashMap<String, u32>)> = OnceLock::new();
    V.get_or_init(|| {
        let syll: Vec<[u8; 2]> = CONSONANTS
            .iter()
            .flat_map(|&c| VOWELS.iter().map(move |&v| [c, v]))
            .collect();
        let mut words = Vec::with_capacity(VOCAB_SIZE as usize);
        for a in &syll {
            for b in &syll {
                let w = [a[0], a[1], b[0], b[1]];
                words.push(String::from_utf8_lossy(&w).into_owned());
            }
        }
        let index = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), i as u32))
            .collect();
        (words, index)
    })
}

/// The word of a vocabulary id (`None` for ids outside the vocabulary).
pub fn word(id: u32) -> Option<&'static str> {
    vocab().0.get(id as usize).map(String::as_str)
}

/// Text of a generated token: a space, then its word.
pub fn token_text(id: u32) -> String {
    format!(" {}", word(id).unwrap_or("?"))
}

/// Splits on ASCII whitespace; vocabulary words map to their ids, other words to a hash.
pub fn tokenize(text: &str) -> Vec<u32> {
    let index = &vocab().1;
    text.split_ascii_whitespace()
        .map(|w| match index.get(w) {
            Some(&id) => id,
            None => {
                VOCAB_SIZE + (fnv(FNV_OFFSET, w.as_bytes()) % (u32::MAX - VOCAB_SIZE) as u64) as u32
            }
        })
        .collect()
}

/// The chat template: `<|role|> content` per message, then `<|assistant|>`.
pub fn chat_prompt(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|> ");
        s.push_str(content);
        s.push(' ');
    }
    s.push_str("<|assistant|>");
    s
}

/// A prompt of `n` vocabulary words drawn from a seeded generator (for workloads and tests).
pub fn random_prompt(seed: u64, n: usize) -> String {
    let mut r = SplitMix(seed);
    let mut s = String::with_capacity(n * 5);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        let id = (r.next_u64() % VOCAB_SIZE as u64) as u32;
        s.push_str(word(id).unwrap_or("baba"));
    }
    s
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// murmur3's 64-bit finaliser.
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn mix2(a: u64, b: u64) -> u64 {
    mix(a ^ mix(b.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// A splitmix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A key over a token sequence (the decoder's lookup key for announced transfers).
pub fn tokens_key(tokens: &[u32]) -> u64 {
    let mut h = fnv(FNV_OFFSET, &(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h = fnv(h, &t.to_le_bytes());
    }
    mix(h)
}

/// The model: a name, a KV spec per rank, and the tensor-parallel world size.
#[derive(Debug, Clone)]
pub struct Model {
    /// Model name (served in `/v1/models`, part of PD chunk keys and of the KV seed).
    pub name: String,
    /// Layout, dtype and chunk size of one rank.
    pub spec: KvSpec,
    /// Tensor-parallel world size (ranks).
    pub world_size: u32,
}

/// Where a sequence stands: the prefix hash of its last position and the chained digest of
/// every position's KV on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqState {
    /// Prefix hash over every token so far.
    pub prefix: u64,
    /// Chained digest of the KV bytes of every position so far.
    pub digest: u64,
    /// Positions so far.
    pub len: u64,
}

impl Model {
    /// Planes per token (layers × 2 for standard, layers for MLA) and bytes per row (one
    /// plane of one token).
    pub fn planes_and_row(&self) -> (usize, usize) {
        let d = self.spec.dtype.size() as usize;
        match self.spec.layout {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => (
                layers as usize * 2,
                kv_heads as usize * head_dim as usize * d,
            ),
            KvLayout::Mla { layers, latent_dim } => (layers as usize, latent_dim as usize * d),
        }
    }

    /// The state before any token.
    pub fn start(&self) -> SeqState {
        let mut h = fnv(FNV_OFFSET, b"kvbridge-sim/v1");
        h = fnv(h, self.name.as_bytes());
        h = fnv(h, &self.world_size.to_le_bytes());
        for d in self.spec.layout.shape(0) {
            h = fnv(h, &d.to_le_bytes());
        }
        h = fnv(h, self.spec.dtype.name().as_bytes());
        SeqState {
            prefix: mix(h),
            digest: 0,
            len: 0,
        }
    }

    /// Prefix hashes of positions `0..tokens.len()`, continuing from `from`.
    pub fn prefixes(&self, from: u64, tokens: &[u32]) -> Vec<u64> {
        let mut p = from;
        tokens
            .iter()
            .map(|&t| {
                p = mix2(p, t as u64);
                p
            })
            .collect()
    }

    fn row_seed(&self, prefix: u64, rank: u32, plane: usize) -> u64 {
        let r = if self.spec.layout.is_mla() { 0 } else { rank };
        mix2(mix2(prefix, plane as u64), r as u64)
    }

    /// Fills `out` (exactly one chunk of `prefixes.len()` tokens on `rank`, in the PD layout)
    /// with the KV of those positions.
    pub fn fill_chunk(&self, rank: u32, prefixes: &[u64], out: &mut [u8]) {
        let (planes, row) = self.planes_and_row();
        let t = prefixes.len();
        debug_assert_eq!(out.len(), planes * t * row);
        for plane in 0..planes {
            for (j, &p) in prefixes.iter().enumerate() {
                let off = (plane * t + j) * row;
                fill_row(self.row_seed(p, rank, plane), &mut out[off..off + row]);
            }
        }
    }

    /// [`Model::fill_chunk`] on every rank (`out[rank]`) and [`Model::absorb`] of what was
    /// filled, in one pass: each row is digested while its words are still in registers
    /// instead of read back from memory (the same values; a pass over the chunk less, which
    /// on a small host is memory bandwidth the transfer then has).
    pub fn fill_and_absorb<S: KvSink>(
        &self,
        state: &mut SeqState,
        out: &mut [S],
        prefixes: &[u64],
    ) {
        let (planes, row) = self.planes_and_row();
        let t = prefixes.len();
        let per_rank: Vec<Vec<u64>> = out
            .iter_mut()
            .enumerate()
            .map(|(rank, out)| {
                debug_assert_eq!(out.kv_len(), planes * t * row);
                let mut h = vec![POSITION_SEED; t];
                for plane in 0..planes {
                    for (j, (&p, d)) in prefixes.iter().zip(h.iter_mut()).enumerate() {
                        let off = (plane * t + j) * row;
                        let seed = self.row_seed(p, rank as u32, plane);
                        let h = *d;
                        *d = out.fill_row(off, row, &mut |b| fill_and_digest_row(seed, b, h));
                    }
                }
                h
            })
            .collect();
        Self::chain(state, &per_rank, t);
        if let Some(&p) = prefixes.last() {
            state.prefix = p;
        }
    }

    /// Computes the KV of one chunk on every rank and absorbs it ([`Model::fill_and_absorb`]):
    /// what a colocated engine does with a prefill step. The KV goes to scratch buffers taken
    /// from a small process-wide pool and given back after: a step allocates nothing once
    /// the pool is warm (see [`crate::chunk_memory`] for why that matters). The pool keeps at
    /// most [`SCRATCH_KEPT`] sets, so the memory it holds does not grow with the number of
    /// threads that ever computed a chunk (per-thread buffers did: tokio's blocking pool
    /// alone may run 512 threads).
    pub fn compute_and_absorb(&self, state: &mut SeqState, prefixes: &[u64]) {
        let (planes, row) = self.planes_and_row();
        let len = planes * prefixes.len() * row;
        let ranks = self.world_size as usize;
        let mut bufs = scratch_take();
        if bufs.len() < ranks {
            bufs.resize_with(ranks, Vec::new);
        }
        let mut outs: Vec<&mut [u8]> = bufs
            .iter_mut()
            .take(ranks)
            .map(|b| {
                b.resize(len, 0);
                &mut b[..len]
            })
            .collect();
        self.fill_and_absorb(state, &mut outs, prefixes);
        drop(outs);
        scratch_give_back(bufs);
    }

    /// Whether `got` is exactly the KV of `prefixes` on `rank`: compared as it is generated,
    /// without computing the expected chunk into memory first.
    pub fn chunk_matches(&self, rank: u32, prefixes: &[u64], got: &[u8]) -> bool {
        let (planes, row) = self.planes_and_row();
        let t = prefixes.len();
        if got.len() != planes * t * row {
            return false;
        }
        (0..planes).all(|plane| {
            prefixes.iter().enumerate().all(|(j, &p)| {
                let off = (plane * t + j) * row;
                row_matches(self.row_seed(p, rank, plane), &got[off..off + row])
            })
        })
    }

    /// The KV of one chunk, newly allocated.
    pub fn chunk(&self, rank: u32, prefixes: &[u64]) -> Vec<u8> {
        let (planes, row) = self.planes_and_row();
        let mut v = vec![0u8; planes * prefixes.len() * row];
        self.fill_chunk(rank, prefixes, &mut v);
        v
    }

    /// Digests of positions `range` of a chunk of `t` tokens held in `chunk`: each position's
    /// digest chains its rows plane by plane. Computed in memory order (a plane's rows of
    /// consecutive positions lie next to each other), not position by position: reading the
    /// chunk once front to back keeps the hardware prefetcher and the TLB on our side (a
    /// position's rows lie a plane apart, 16 pages per position in the demo's layout; walking
    /// them position by position ran 2-3x slower on a virtual machine's shared memory).
    fn position_digests(&self, chunk: &[u8], t: usize, range: std::ops::Range<usize>) -> Vec<u64> {
        let (planes, row) = self.planes_and_row();
        let mut h = vec![POSITION_SEED; range.len()];
        for plane in 0..planes {
            for (d, j) in h.iter_mut().zip(range.clone()) {
                let off = (plane * t + j) * row;
                *d = digest_bytes(*d, chunk.get(off..off + row).unwrap_or(&[]));
            }
        }
        h
    }

    /// Advances `state` over the positions held in one chunk per rank (`chunks[rank]`, each
    /// of `t` tokens), whose prefix hashes are `prefixes`. Uses the bytes as they are: a
    /// corrupted byte changes the digest.
    pub fn absorb(&self, state: &mut SeqState, chunks: &[&[u8]], prefixes: &[u64]) {
        let _ = self.absorb_kv(state, chunks, prefixes.len());
        if let Some(&p) = prefixes.last() {
            state.prefix = p;
        }
    }

    /// What [`Model::absorb`] does to the digest and the length, over one chunk per rank of
    /// `t` positions, without the prefix hashes: the digest depends on the KV bytes only, so
    /// a decoder can digest KV as it lands, before it knows the prompt's tokens (it sets
    /// `prefix` once it does).
    ///
    /// Returns the digests it chained, `[rank][position]`: what the decoder held, which
    /// [`Model::digests_match`] later checks against the KV the prompt must have, without
    /// reading the chunk again.
    pub fn absorb_kv(&self, state: &mut SeqState, chunks: &[&[u8]], t: usize) -> Vec<Vec<u64>> {
        let per_rank: Vec<Vec<u64>> = chunks
            .iter()
            .map(|c| self.position_digests(c, t, 0..t))
            .collect();
        Self::chain(state, &per_rank, t);
        per_rank
    }

    /// Advances `state` over `t` positions whose per-rank digests (`per_rank[rank][j]`) were
    /// returned by [`Model::absorb_kv`]: the state after them, without the KV bytes (how a
    /// decoder keeps the state after each chunk it received and verified).
    pub fn chain_digests(&self, state: &mut SeqState, per_rank: &[Vec<u64>], t: usize) {
        Self::chain(state, per_rank, t);
    }

    /// Chains per-rank position digests (`per_rank[rank][j]`) into `state`, position by
    /// position, rank by rank within a position.
    fn chain(state: &mut SeqState, per_rank: &[Vec<u64>], t: usize) {
        for j in 0..t {
            let mut d = state.digest;
            for r in per_rank {
                d = mix2(d, r.get(j).copied().unwrap_or(0));
            }
            state.digest = d;
            state.len += 1;
        }
    }

    /// [`Model::absorb_kv`] with the per-position digests (the bulk of the work) computed on
    /// `threads` threads, each over a range of positions; the result is identical. For the
    /// one chunk left on the path to the first token, when nothing else needs the cores.
    /// Returns the digests it chained, as [`Model::absorb_kv`] does.
    pub fn absorb_kv_par(
        &self,
        state: &mut SeqState,
        chunks: &[&[u8]],
        t: usize,
        threads: usize,
    ) -> Vec<Vec<u64>> {
        let threads = threads.clamp(1, t.max(1));
        if threads == 1 {
            return self.absorb_kv(state, chunks, t);
        }
        let per = t.div_ceil(threads);
        // parts[k][rank]: thread k's positions of that rank.
        let part = |k: usize| {
            let r = (k * per).min(t)..((k + 1) * per).min(t);
            chunks
                .iter()
                .map(|c| self.position_digests(c, t, r.clone()))
                .collect::<Vec<Vec<u64>>>()
        };
        // The first part on this thread: one thread fewer to start (tens of microseconds
        // each on a virtual machine).
        let parts: Vec<Vec<Vec<u64>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (1..threads).map(|k| sc.spawn(move || part(k))).collect();
            let mut parts = vec![part(0)];
            parts.extend(hs.into_iter().map(|h| h.join().unwrap_or_default()));
            parts
        });
        let per_rank: Vec<Vec<u64>> = (0..chunks.len())
            .map(|rank| {
                parts
                    .iter()
                    .flat_map(|p| p.get(rank).cloned().unwrap_or_default())
                    .collect()
            })
            .collect();
        Self::chain(state, &per_rank, t);
        per_rank
    }

    /// The position digests (as [`Model::absorb_kv`] returns them for one rank) of the KV
    /// that positions with prefix hashes `prefixes` must hold on `rank`, computed as the KV
    /// is generated, in registers: nothing is written to memory or read from it. A decoder
    /// that digested the KV it received checks it with this instead of reading it a second
    /// time, which on a small host is memory bandwidth the transfers then have.
    pub fn expected_digests(&self, rank: u32, prefixes: &[u64]) -> Vec<u64> {
        let (planes, row) = self.planes_and_row();
        let mut h = vec![POSITION_SEED; prefixes.len()];
        // Rows that are not whole 32-byte blocks are generated into this one row first.
        let mut odd = vec![0u8; if row % 32 == 0 { 0 } else { row }];
        for plane in 0..planes {
            for (d, &p) in h.iter_mut().zip(prefixes) {
                let seed = self.row_seed(p, rank, plane);
                *d = if odd.is_empty() {
                    generate_and_digest_row(seed, row, *d)
                } else {
                    fill_and_digest_row(seed, &mut odd, *d)
                };
            }
        }
        h
    }

    /// Whether `held` (one rank's position digests of a chunk, from [`Model::absorb_kv`])
    /// is the digest of exactly the KV that positions with prefix hashes `prefixes` must
    /// hold on `rank`: [`Model::chunk_matches`] over what the decoder read when it absorbed
    /// the chunk. A changed byte changes its row's digest for certain (each step of it is a
    /// bijection of the byte's lane), and so its position's digest but for a chance of
    /// about 2^-64.
    pub fn digests_match(&self, rank: u32, prefixes: &[u64], held: &[u64]) -> bool {
        held.len() == prefixes.len() && self.expected_digests(rank, prefixes) == held
    }

    /// Appends one token: computes its KV on every rank and absorbs it.
    pub fn extend(&self, state: &mut SeqState, token: u32) {
        let p = self.prefixes(state.prefix, &[token]);
        self.compute_and_absorb(state, &p);
    }

    /// The next token, from the digest of the KV held.
    pub fn next_token(&self, state: &SeqState) -> u32 {
        (mix2(state.digest, state.len) % VOCAB_SIZE as u64) as u32
    }

    /// Colocated prefill without transfer or cost model: the state after `tokens`.
    pub fn prefill_local(&self, tokens: &[u32]) -> SeqState {
        let mut s = self.start();
        let c = self.spec.chunk_tokens.max(1) as usize;
        for part in tokens.chunks(c) {
            let p = self.prefixes(s.prefix, part);
            self.compute_and_absorb(&mut s, &p);
        }
        s
    }
}

#[inline]
fn fill_row(seed: u64, out: &mut [u8]) {
    let mut r = SplitMix(seed);
    let mut it = out.chunks_exact_mut(8);
    for w in &mut it {
        w.copy_from_slice(&r.next_u64().to_le_bytes());
    }
    let rest = it.into_remainder();
    if !rest.is_empty() {
        let v = r.next_u64().to_le_bytes();
        rest.copy_from_slice(&v[..rest.len()]);
    }
}

/// Where a position's digest starts, before its first row.
const POSITION_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// Multiplier of [`digest_bytes`]'s lanes.
const LANE_MUL: u64 = 0x9fb2_1c65_1e98_df25;

/// [`fill_row`] then `digest_bytes(h, out)`, in one pass when the row is whole 32-byte
/// blocks (every layout the demo uses; others take the two passes).
#[inline]
fn fill_and_digest_row(seed: u64, out: &mut [u8], h: u64) -> u64 {
    if !out.len().is_multiple_of(32) {
        fill_row(seed, out);
        return digest_bytes(h, out);
    }
    let len = out.len();
    digest_generated_row(seed, len, h, |at, w| {
        out[at..at + 8].copy_from_slice(&w.to_le_bytes())
    })
}

/// `digest_bytes(h, row)` of the row [`fill_row`] writes for `seed`, for a row of `len`
/// bytes in whole 32-byte blocks, without the row in memory.
#[inline]
fn generate_and_digest_row(seed: u64, len: usize, h: u64) -> u64 {
    digest_generated_row(seed, len, h, |_, _| {})
}

/// The one pass behind [`fill_and_digest_row`] and [`generate_and_digest_row`]: generates
/// the row of `len` bytes (whole 32-byte blocks) that [`fill_row`] writes for `seed`, hands
/// each word to `store` with its byte offset, and returns `digest_bytes(h, row)`.
#[inline(always)]
fn digest_generated_row(seed: u64, len: usize, h: u64, mut store: impl FnMut(usize, u64)) -> u64 {
    debug_assert!(len.is_multiple_of(32));
    let mut r = SplitMix(seed);
    let mut l = [h, h ^ 1, h ^ 2, h ^ 3];
    for block in 0..len / 32 {
        for (k, lane) in l.iter_mut().enumerate() {
            let w = r.next_u64();
            store(block * 32 + k * 8, w);
            *lane = (*lane ^ w).wrapping_mul(LANE_MUL);
        }
    }
    let mut h = h;
    for lane in l {
        h = mix2(h, lane);
    }
    mix2(h, len as u64)
}

/// Whether `got` is what [`fill_row`] writes for `seed`.
#[inline]
fn row_matches(seed: u64, got: &[u8]) -> bool {
    let mut r = SplitMix(seed);
    let mut it = got.chunks_exact(8);
    let mut same = true;
    for w in &mut it {
        same &= w == r.next_u64().to_le_bytes();
    }
    let rest = it.remainder();
    same && (rest.is_empty() || rest == &r.next_u64().to_le_bytes()[..rest.len()])
}

/// Where [`Model::fill_and_absorb`] computes one rank's chunk to, row by row.
pub trait KvSink {
    /// The chunk's length in bytes.
    fn kv_len(&self) -> usize;
    /// Fills the `len` bytes at `offset` with `fill`, and returns what `fill` returned.
    fn fill_row(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u64,
    ) -> u64;
}

/// A buffer this process owns: filled in place.
impl KvSink for &mut [u8] {
    fn kv_len(&self) -> usize {
        self.len()
    }
    fn fill_row(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u64,
    ) -> u64 {
        fill(&mut self[offset..offset + len])
    }
}

/// Most scratch sets [`Model::compute_and_absorb`] keeps between calls (one set: a chunk per rank).
/// Concurrent calls beyond it allocate their own and drop them after.
pub const SCRATCH_KEPT: usize = 4;

static SCRATCH: std::sync::Mutex<Vec<Vec<Vec<u8>>>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn scratch_take() -> Vec<Vec<u8>> {
    SCRATCH
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop()
        .unwrap_or_default()
}

pub(crate) fn scratch_give_back(bufs: Vec<Vec<u8>>) {
    let mut pool = SCRATCH.lock().unwrap_or_else(|p| p.into_inner());
    if pool.len() < SCRATCH_KEPT {
        pool.push(bufs);
    }
}

#[inline]
fn digest_bytes(mut h: u64, bytes: &[u8]) -> u64 {
    // Four independent lanes keep the multiply latency off the critical path.
    let mut l = [h, h ^ 1, h ^ 2, h ^ 3];
    let mut it = bytes.chunks_exact(32);
    for c in &mut it {
        for (k, lane) in l.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&c[k * 8..k * 8 + 8]);
            *lane = (*lane ^ u64::from_le_bytes(w)).wrapping_mul(LANE_MUL);
        }
    }
    for &b in it.remainder() {
        l[0] = (l[0] ^ b as u64).wrapping_mul(FNV_PRIME);
    }
    for lane in l {
        h = mix2(h, lane);
    }
    mix2(h, bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_pd::Dtype;

    fn model(layout: KvLayout, ws: u32) -> Model {
        Model {
            name: "m".into(),
            spec: KvSpec {
                chunk_tokens: 4,
                ..KvSpec::new(layout, Dtype::Bf16)
            },
            world_size: ws,
        }
    }
    const STD: KvLayout = KvLayout::Standard {
        layers: 2,
        kv_heads: 2,
        head_dim: 8,
    };

    #[test]
    fn tokenizer_round_trips_generated_tokens() {
        let p = random_prompt(1, 10);
        let t = tokenize(&p);
        assert_eq!(t.len(), 10);
        assert!(t.iter().all(|&x| x < VOCAB_SIZE));
        let more = format!("{p}{}", token_text(17));
        let mut expect = t.clone();
        expect.push(17);
        assert_eq!(tokenize(&more), expect);
        assert!(tokenize("hello world")[0] >= VOCAB_SIZE);
    }

    #[test]
    fn chunk_has_the_pd_layout_size() {
        let m = model(STD, 1);
        let p = m.prefixes(m.start().prefix, &[1, 2, 3]);
        assert_eq!(m.chunk(0, &p).len() as u64, m.spec.chunk_bytes(3));
        let mla = model(
            KvLayout::Mla {
                layers: 3,
                latent_dim: 8,
            },
            2,
        );
        assert_eq!(mla.chunk(0, &p).len() as u64, mla.spec.chunk_bytes(3));
        assert_eq!(
            mla.chunk(0, &p),
            mla.chunk(1, &p),
            "MLA KV equal on all ranks"
        );
        assert_ne!(m.chunk(0, &p), model(STD, 2).chunk(1, &p));
    }

    #[test]
    fn kv_of_a_position_depends_on_its_whole_prefix() {
        let m = model(STD, 1);
        let a = m.prefixes(m.start().prefix, &[1, 2, 3]);
        let b = m.prefixes(m.start().prefix, &[9, 2, 3]);
        assert_ne!(m.chunk(0, &a[2..]), m.chunk(0, &b[2..]));
    }

    #[test]
    fn chunked_absorb_equals_token_by_token() {
        let m = model(STD, 2);
        let toks: Vec<u32> = (0..11).collect();
        let a = m.prefill_local(&toks);
        let mut b = m.start();
        for &t in &toks {
            m.extend(&mut b, t);
        }
        assert_eq!(a, b);
    }

    #[test]
    fn one_corrupted_byte_changes_the_next_token_digest() {
        let m = model(STD, 1);
        let toks: Vec<u32> = (0..4).collect();
        let p = m.prefixes(m.start().prefix, &toks);
        let good = m.chunk(0, &p);
        for pos in [0, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[pos] ^= 1;
            let (mut s1, mut s2) = (m.start(), m.start());
            m.absorb(&mut s1, &[&good], &p);
            m.absorb(&mut s2, &[&bad], &p);
            assert_ne!(s1.digest, s2.digest, "byte {pos}");
        }
    }

    #[test]
    fn fused_fill_and_absorb_equals_fill_then_absorb() {
        let mla = KvLayout::Mla {
            layers: 3,
            latent_dim: 5, // rows of 10 bytes: not whole 32-byte blocks
        };
        for (layout, ws) in [(STD, 1), (STD, 2), (mla, 2)] {
            let m = model(layout, ws);
            let p = m.prefixes(m.start().prefix, &[3, 1, 4, 1, 5, 9, 2]);
            let want: Vec<Vec<u8>> = (0..ws).map(|r| m.chunk(r, &p)).collect();
            let refs: Vec<&[u8]> = want.iter().map(Vec::as_slice).collect();
            let mut a = m.start();
            m.absorb(&mut a, &refs, &p);
            let mut got: Vec<Vec<u8>> = want.iter().map(|c| vec![0u8; c.len()]).collect();
            let mut outs: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            let mut b = m.start();
            m.fill_and_absorb(&mut b, &mut outs, &p);
            assert_eq!(a, b, "{layout:?} x{ws}");
            assert_eq!(got, want, "{layout:?} x{ws}");
        }
    }

    #[test]
    fn chunk_matches_only_the_exact_kv() {
        let m = model(STD, 2);
        let p = m.prefixes(m.start().prefix, &[7, 8, 9]);
        let good = m.chunk(1, &p);
        assert!(m.chunk_matches(1, &p, &good));
        assert!(!m.chunk_matches(0, &p, &good), "another rank's KV");
        for pos in [0, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[pos] ^= 0x10;
            assert!(!m.chunk_matches(1, &p, &bad), "byte {pos}");
        }
        assert!(!m.chunk_matches(1, &p, &good[1..]), "short");
    }

    #[test]
    fn digests_match_only_the_exact_kv() {
        let mla = KvLayout::Mla {
            layers: 3,
            latent_dim: 5, // rows of 10 bytes: not whole 32-byte blocks
        };
        for (layout, ws) in [(STD, 2), (mla, 2)] {
            let m = model(layout, ws);
            let p = m.prefixes(m.start().prefix, &[7, 8, 9, 10]);
            let good = m.chunk(1, &p);
            let held = |kv: &[u8]| m.absorb_kv(&mut m.start(), &[kv], p.len()).remove(0);
            assert_eq!(m.expected_digests(1, &p), held(&good), "{layout:?}");
            assert!(m.digests_match(1, &p, &held(&good)), "{layout:?}");
            if !layout.is_mla() {
                assert!(!m.digests_match(0, &p, &held(&good)), "another rank's KV");
            }
            let other = m.prefixes(m.start().prefix, &[7, 8, 9, 11]);
            assert!(
                !m.digests_match(1, &other, &held(&good)),
                "another prompt's KV"
            );
            for pos in [0, good.len() / 3, good.len() - 1] {
                let mut bad = good.clone();
                bad[pos] ^= 0x10;
                assert!(
                    !m.digests_match(1, &p, &held(&bad)),
                    "{layout:?} byte {pos}"
                );
            }
            let short = held(&good)[1..].to_vec();
            assert!(!m.digests_match(1, &p, &short), "a position missing");
        }
    }

    #[test]
    fn parallel_kv_digest_equals_the_serial_one() {
        for ws in [1, 2] {
            let m = model(
                KvLayout::Standard {
                    layers: 2,
                    kv_heads: 2,
                    head_dim: 8,
                },
                ws,
            );
            let p = m.prefixes(m.start().prefix, &[5, 6, 7, 8, 9, 10, 11]);
            let chunks: Vec<Vec<u8>> = (0..ws).map(|r| m.chunk(r, &p)).collect();
            let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
            let mut a = m.start();
            let da = m.absorb_kv(&mut a, &refs, p.len());
            for threads in [1, 2, 3, 16] {
                let mut b = m.start();
                let db = m.absorb_kv_par(&mut b, &refs, p.len(), threads);
                assert_eq!(a, b, "{threads} threads, world size {ws}");
                assert_eq!(da, db, "{threads} threads, world size {ws}");
            }
        }
    }

    #[test]
    fn kv_digest_before_the_tokens_equals_absorb() {
        let m = model(STD, 2);
        let toks: Vec<u32> = (0..11).collect();
        let want = m.prefill_local(&toks);
        // Digest chunk by chunk from the KV alone, then set the prefix from the tokens.
        let mut got = m.start();
        let all = m.prefixes(got.prefix, &toks);
        for p in all.chunks(m.spec.chunk_tokens as usize) {
            let kv: Vec<Vec<u8>> = (0..2).map(|r| m.chunk(r, p)).collect();
            let refs: Vec<&[u8]> = kv.iter().map(Vec::as_slice).collect();
            let _ = m.absorb_kv(&mut got, &refs, p.len());
        }
        got.prefix = *all.last().unwrap();
        assert_eq!(got, want);
    }
}
