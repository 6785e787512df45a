//! The tag of a sealed datagram: NH, then SipHash-2-4 (UMAC/VMAC style,
//! RFC 4418's NH). SipHash alone runs at about 0.7 GB/s, too slow to pass
//! every aggregated block through it several times; NH is a universal hash
//! made of 32-bit adds and 32×32→64-bit multiplies that the compiler
//! vectorises, so it runs at many GB/s, and SipHash (a PRF) then only sees
//! 16 bytes per KiB of datagram.
//!
//! ```text
//! tag = SipHash-2-4(member key, be64(seq) ‖ be64(len) ‖ D_0 ‖ D_1 ‖ ...)
//! D_c = le64(NH(K[0..256],  chunk_c)) ‖ le64(NH(K[4..260], chunk_c))
//! NH(K, M) = Σ_g Σ_{j<4} (M[8g+j] + K[8g+j] mod 2^32) · (M[8g+j+4] + K[8g+j+4] mod 2^32)  mod 2^64
//! ```
//!
//! `inner` (the datagram before its trailer, `len` bytes) is cut into
//! 1024-byte chunks, the last one zero-padded to a multiple of 32 bytes;
//! `M[i]` are its little-endian u32 words. `K` is 260 u32 words: word pair
//! `i` (`K[2i]`, `K[2i+1]`) is the little-endian u64
//! `SipHash-2-4(member key, "fanin-nh" ‖ be64(i))`. The second pass uses the
//! key shifted by four words (UMAC's Toeplitz construction), so the two
//! 64-bit digests of a chunk collide for two distinct equal-length chunks
//! with probability at most 2^-64. Why this is a MAC: docs/security.md.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::{Key, SipHasher24};

/// Bytes of `inner` per NH chunk.
pub const NH_CHUNK: usize = 1024;
const CHUNK_WORDS: usize = NH_CHUNK / 4;
/// The Toeplitz shift between the two passes, in u32 words.
const SHIFT: usize = 4;
const KEY_WORDS: usize = CHUNK_WORDS + SHIFT;
/// Expanded keys a thread keeps (1 KiB each); past that the cache starts over.
const CACHE_KEYS: usize = 4096;

/// The NH key material of one member key (260 u32 words).
#[derive(Clone)]
pub struct NhKey(Box<[u32; KEY_WORDS]>);

impl NhKey {
    /// Expand `key` with SipHash-2-4 in counter mode. The inputs are 16
    /// bytes and every tag input is at least 32, so the two uses of the
    /// member key never share an input.
    pub fn new(key: &Key) -> Self {
        let mut words = Box::new([0u32; KEY_WORDS]);
        for (i, pair) in words.chunks_exact_mut(2).enumerate() {
            let mut input = [0u8; 16];
            input[..8].copy_from_slice(b"fanin-nh");
            input[8..].copy_from_slice(&(i as u64).to_be_bytes());
            let w = super::siphash24(key, &input);
            pair[0] = w as u32;
            pair[1] = (w >> 32) as u32;
        }
        Self(words)
    }
}

/// Hashes a cached key by its bytes: member keys are SipHash outputs and
/// come from the configuration, not from the network, so they need no
/// DoS-resistant hash (the default one costs as much as a short tag).
#[derive(Default)]
struct KeyBytesHasher(u64);

impl Hasher for KeyBytesHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(w);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyCache = HashMap<[u8; 16], NhKey, BuildHasherDefault<KeyBytesHasher>>;

thread_local! {
    // Member keys are long-lived and a thread (a switch shard, a worker)
    // uses few of them, so each is expanded once per thread.
    static EXPANDED: RefCell<KeyCache> = RefCell::new(KeyCache::default());
}

/// The two NH digests of one chunk of at most 1024 bytes whose length is a
/// multiple of 32: one loop over 8-word groups zipped with the two key
/// windows (no bounds checks), 8 independent 32×32→64 multiply-adds per
/// group, which the CPU overlaps (and LLVM vectorises where the target
/// has cheap vector multiplies).
fn nh_pair(k: &[u32; KEY_WORDS], chunk: &[u8]) -> (u64, u64) {
    debug_assert!(chunk.len().is_multiple_of(32) && chunk.len() <= NH_CHUNK);
    let mut a = [0u64; 4];
    let mut b = [0u64; 4];
    let groups = chunk.chunks_exact(32);
    for ((group, k1), k2) in groups.zip(k[..CHUNK_WORDS].chunks_exact(8)).zip(k[SHIFT..].chunks_exact(8)) {
        let mut m = [0u32; 8];
        for (pair, bytes) in m.chunks_exact_mut(2).zip(group.chunks_exact(8)) {
            let w = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
            pair[0] = w as u32;
            pair[1] = (w >> 32) as u32;
        }
        for j in 0..4 {
            let x = m[j].wrapping_add(k1[j]) as u64 * m[j + 4].wrapping_add(k1[j + 4]) as u64;
            let y = m[j].wrapping_add(k2[j]) as u64 * m[j + 4].wrapping_add(k2[j + 4]) as u64;
            a[j] = a[j].wrapping_add(x);
            b[j] = b[j].wrapping_add(y);
        }
    }
    let sum = |v: [u64; 4]| v[0].wrapping_add(v[1]).wrapping_add(v[2]).wrapping_add(v[3]);
    (sum(a), sum(b))
}

/// Feed the NH digests of `inner` to `h` (the part of the tag that reads
/// the datagram).
fn nh_digests(k: &NhKey, inner: &[u8], h: &mut SipHasher24) {
    let mut chunks = inner.chunks_exact(NH_CHUNK);
    for chunk in &mut chunks {
        let (a, b) = nh_pair(&k.0, chunk);
        h.write(&a.to_le_bytes());
        h.write(&b.to_le_bytes());
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut padded = [0u8; NH_CHUNK];
        padded[..rest.len()].copy_from_slice(rest);
        let (a, b) = nh_pair(&k.0, &padded[..rest.len().div_ceil(32) * 32]);
        h.write(&a.to_le_bytes());
        h.write(&b.to_le_bytes());
    }
}

/// The NH digests alone, concatenated (for tests and the micro-benchmark).
pub fn nh_digest(k: &NhKey, inner: &[u8]) -> Vec<u64> {
    let mut out = Vec::with_capacity(2 * inner.len().div_ceil(NH_CHUNK));
    for chunk in inner.chunks(NH_CHUNK) {
        let (a, b) = if chunk.len() == NH_CHUNK {
            nh_pair(&k.0, chunk)
        } else {
            let mut padded = [0u8; NH_CHUNK];
            padded[..chunk.len()].copy_from_slice(chunk);
            nh_pair(&k.0, &padded[..chunk.len().div_ceil(32) * 32])
        };
        out.extend([a, b]);
    }
    out
}

/// The tag of the datagram `inner` sealed with `seq` under `key` (the one
/// definition; `seal` writes it, `verify` compares with it).
pub fn mac(key: &Key, seq: u64, inner: &[u8]) -> u64 {
    let mut h = SipHasher24::new(key);
    h.write(&seq.to_be_bytes());
    h.write(&(inner.len() as u64).to_be_bytes());
    EXPANDED.with(|cache| {
        let mut cache = cache.borrow_mut();
        if !cache.contains_key(&key.0) && cache.len() >= CACHE_KEYS {
            cache.clear();
        }
        let nh = cache.entry(key.0).or_insert_with(|| NhKey::new(key));
        nh_digests(nh, inner, &mut h);
    });
    h.finish()
}
