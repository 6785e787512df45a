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
use std::rc::Rc;
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

/// The NH key material of one member key: the 260 u32 words `K`, and the
/// same words rearranged for the vector loops (see [`WideKey`]).
#[derive(Clone)]
pub struct NhKey {
    words: Box<[u32; KEY_WORDS]>,
    wide: Box<WideKey>,
}

/// Message words a step of the wide loops covers (four 8-word groups).
const STEP_WORDS: usize = 32;
const STEPS: usize = CHUNK_WORDS / STEP_WORDS;

/// `K` laid out as the vector loops add it, so a step loads each key
/// vector with one aligned load instead of gathering it from two 128-bit
/// halves. For step `s` (message words `i = 32s ..`), vector `o` (`o` =
/// 0, 1, 2 for key offsets 0, 4, 8 words) holds in its 128-bit lane `l` the
/// words `K[i + 4o + 8l .. + 4]`: the first pass adds offsets 0 (low
/// halves of the groups) and 4 (high halves), the Toeplitz-shifted second
/// pass 4 and 8. The AVX2 loop reads the two 256-bit halves of a step.
#[derive(Clone)]
#[repr(C, align(64))]
struct WideKey([[[u32; 16]; 3]; STEPS]);

impl WideKey {
    fn new(k: &[u32; KEY_WORDS]) -> Box<Self> {
        let mut wide = Box::new(Self([[[0; 16]; 3]; STEPS]));
        for (s, step) in wide.0.iter_mut().enumerate() {
            for (o, vector) in step.iter_mut().enumerate() {
                for (l, lane) in vector.chunks_exact_mut(4).enumerate() {
                    let at = s * STEP_WORDS + 4 * o + 8 * l;
                    lane.copy_from_slice(&k[at..at + 4]);
                }
            }
        }
        wide
    }
}

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
        Self::from_words(words)
    }

    fn from_words(words: Box<[u32; KEY_WORDS]>) -> Self {
        let wide = WideKey::new(&words);
        Self { words, wide }
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

type KeyCache = HashMap<[u8; 16], Rc<NhKey>, BuildHasherDefault<KeyBytesHasher>>;

/// Entries of the direct-mapped front of the cache.
const RECENT_SLOTS: usize = 64;

/// A thread's expanded keys: a map of every key it used (up to
/// [`CACHE_KEYS`]), and in front of it a small direct-mapped table indexed
/// by the key's first byte (keys are PRF outputs, so that byte is uniform):
/// the map lookup costs as much as the SipHash of a short datagram, and a
/// switch shard or a worker seals and verifies with a handful of keys.
struct Expanded {
    all: KeyCache,
    recent: [Option<([u8; 16], Rc<NhKey>)>; RECENT_SLOTS],
}

impl Default for Expanded {
    fn default() -> Self {
        Self { all: KeyCache::default(), recent: [const { None }; RECENT_SLOTS] }
    }
}

impl Expanded {
    fn get(&mut self, key: &Key) -> Rc<NhKey> {
        let slot = key.0[0] as usize % RECENT_SLOTS;
        if let Some((k, nh)) = &self.recent[slot] {
            if *k == key.0 {
                return nh.clone();
            }
        }
        if !self.all.contains_key(&key.0) && self.all.len() >= CACHE_KEYS {
            self.all.clear();
        }
        let nh = self.all.entry(key.0).or_insert_with(|| Rc::new(NhKey::new(key))).clone();
        self.recent[slot] = Some((key.0, nh.clone()));
        nh
    }
}

thread_local! {
    // Member keys are long-lived and a thread (a switch shard, a worker)
    // uses few of them, so each is expanded once per thread.
    static EXPANDED: RefCell<Expanded> = RefCell::new(Expanded::default());
}

/// The two NH digests of one chunk of at most 1024 bytes whose length is a
/// multiple of 32, portable version: one loop over 8-word groups zipped with the two key
/// windows (no bounds checks), 8 independent 32×32→64 multiply-adds per
/// group, which the CPU overlaps (and LLVM vectorises where the target
/// has cheap vector multiplies).
fn nh_pair_scalar(k: &[u32; KEY_WORDS], chunk: &[u8]) -> (u64, u64) {
    nh_pair_scalar_at(k, chunk, 0)
}

/// [`nh_pair_scalar`] of groups that start at word `offset` of a chunk.
fn nh_pair_scalar_at(k: &[u32; KEY_WORDS], chunk: &[u8], offset: usize) -> (u64, u64) {
    debug_assert!(chunk.len() % 32 == 0 && offset + chunk.len() / 4 <= CHUNK_WORDS);
    let mut a = [0u64; 4];
    let mut b = [0u64; 4];
    let groups = chunk.chunks_exact(32);
    let k1s = k[offset..CHUNK_WORDS].chunks_exact(8);
    let k2s = k[offset + SHIFT..].chunks_exact(8);
    for ((group, k1), k2) in groups.zip(k1s).zip(k2s) {
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

/// The same two digests with AVX2: 16 message words (two 8-word groups) per
/// step. UMAC's pairing (word `j` with `j + 4` of a group) maps onto
/// `vpmuludq`, which multiplies the low u32 of each u64 lane: the
/// low/high halves of two groups are gathered into `lo`/`hi` (one 128-bit
/// lane per group), so `lo * hi` gives words 0·4 and 2·6 of both groups and
/// the same after a 32-bit shift gives 1·5 and 3·7. Every product of the
/// scalar loop is computed once; only the order of the (wrapping,
/// commutative) sums differs, so the digests are identical. The key
/// vectors come ready from the [`WideKey`] layout (the second pass's key is
/// the first one's shifted by four words, so it shares the middle vector).
///
/// # Safety
/// The CPU must support AVX2 (checked by the caller).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nh_pair_avx2(k: &NhKey, chunk: &[u8]) -> (u64, u64) {
    use std::arch::x86_64::*;
    debug_assert!(chunk.len() % 32 == 0 && chunk.len() <= NH_CHUNK);
    let words = chunk.len() / 4;
    let m = chunk.as_ptr();
    // (A macro, not a closure: a closure would not inherit `avx2`.)
    macro_rules! pass {
        ($acc:expr, $kl:expr, $kh:expr, $m_lo:expr, $m_hi:expr) => {{
            let lo = _mm256_add_epi32($m_lo, $kl);
            let hi = _mm256_add_epi32($m_hi, $kh);
            let even = _mm256_mul_epu32(lo, hi);
            let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(lo), _mm256_srli_epi64::<32>(hi));
            _mm256_add_epi64($acc, _mm256_add_epi64(even, odd))
        }};
    }
    let mut acc_a = _mm256_setzero_si256();
    let mut acc_b = _mm256_setzero_si256();
    let mut i = 0;
    while i + 16 <= words {
        let g0 = _mm256_loadu_si256(m.add(4 * i) as *const __m256i);
        let g1 = _mm256_loadu_si256(m.add(4 * i + 32) as *const __m256i);
        // Message words i..i+4 | i+8..i+12 and i+4..i+8 | i+12..i+16.
        let m_lo = _mm256_permute2x128_si256::<0x20>(g0, g1);
        let m_hi = _mm256_permute2x128_si256::<0x31>(g0, g1);
        // The half of the wide step that covers words i..i+16.
        let step = &k.wide.0[i / STEP_WORDS];
        let half = i % STEP_WORDS / 2;
        macro_rules! key {
            ($o:expr) => {
                _mm256_load_si256(step[$o][half..].as_ptr() as *const __m256i)
            };
        }
        let (k_lo, k_hi, k_hi2) = (key!(0), key!(1), key!(2));
        acc_a = pass!(acc_a, k_lo, k_hi, m_lo, m_hi);
        acc_b = pass!(acc_b, k_hi, k_hi2, m_lo, m_hi);
        i += 16;
    }
    let mut lanes_a = [0u64; 4];
    let mut lanes_b = [0u64; 4];
    _mm256_storeu_si256(lanes_a.as_mut_ptr() as *mut __m256i, acc_a);
    _mm256_storeu_si256(lanes_b.as_mut_ptr() as *mut __m256i, acc_b);
    let sum = |v: [u64; 4]| v[0].wrapping_add(v[1]).wrapping_add(v[2]).wrapping_add(v[3]);
    // An odd last group goes to the scalar loop.
    with_scalar_tail(k, chunk, i, (sum(lanes_a), sum(lanes_b)))
}

/// `digests` (of the chunk's first `done` words) plus the scalar loop's
/// digests of the groups after them, on their key offset: the tail a vector
/// loop leaves when the chunk's group count is not a multiple of its step.
fn with_scalar_tail(k: &NhKey, chunk: &[u8], done: usize, digests: (u64, u64)) -> (u64, u64) {
    if 4 * done == chunk.len() {
        return digests;
    }
    let (ta, tb) = nh_pair_scalar_at(&k.words, &chunk[4 * done..], done);
    (digests.0.wrapping_add(ta), digests.1.wrapping_add(tb))
}

/// [`nh_pair_avx2`] with 512-bit vectors: 32 message words (four groups)
/// per step, the four low halves gathered into one vector and the four
/// high halves into another with two 128-bit lane shuffles.
///
/// # Safety
/// The CPU must support AVX-512F (checked by the caller).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nh_pair_avx512(k: &NhKey, chunk: &[u8]) -> (u64, u64) {
    use std::arch::x86_64::*;
    debug_assert!(chunk.len() % 32 == 0 && chunk.len() <= NH_CHUNK);
    let words = chunk.len() / 4;
    let m = chunk.as_ptr();
    // (Macros, not closures: a closure would not inherit `avx512f`.)
    // The two passes' products of one step: message halves `m_lo`/`m_hi`
    // (128-bit lanes 0 and 2 of each 64-byte load are the groups' low
    // halves, lanes 1 and 3 their high halves) and the step's key vectors.
    macro_rules! products {
        ($i:expr, $g0:expr, $g1:expr) => {{
            let m_lo = _mm512_shuffle_i64x2::<0x88>($g0, $g1);
            let m_hi = _mm512_shuffle_i64x2::<0xdd>($g0, $g1);
            let step = &k.wide.0[$i / STEP_WORDS];
            let key = |o: usize| step[o].as_ptr() as *const __m512i;
            let (k_lo, k_hi, k_hi2) = (_mm512_load_si512(key(0)), _mm512_load_si512(key(1)), _mm512_load_si512(key(2)));
            macro_rules! pass {
                ($kl:expr, $kh:expr) => {{
                    let lo = _mm512_add_epi32(m_lo, $kl);
                    let hi = _mm512_add_epi32(m_hi, $kh);
                    let even = _mm512_mul_epu32(lo, hi);
                    let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(lo), _mm512_srli_epi64::<32>(hi));
                    _mm512_add_epi64(even, odd)
                }};
            }
            (pass!(k_lo, k_hi), pass!(k_hi, k_hi2))
        }};
    }
    let mut acc_a = _mm512_setzero_si512();
    let mut acc_b = _mm512_setzero_si512();
    let mut i = 0;
    while i + STEP_WORDS <= words {
        let g0 = _mm512_loadu_si512(m.add(4 * i) as *const __m512i);
        let g1 = _mm512_loadu_si512(m.add(4 * i + 64) as *const __m512i);
        let (a, b) = products!(i, g0, g1);
        acc_a = _mm512_add_epi64(acc_a, a);
        acc_b = _mm512_add_epi64(acc_b, b);
        i += STEP_WORDS;
    }
    // One to three groups left (a datagram is rarely a multiple of 128
    // bytes; a 1500-byte link's sealed datagram leaves one whole group):
    // one more step with the missing groups' words masked off in the loads
    // and their products in the sums (group l is 128-bit lane l, so 64-bit
    // lanes 2l and 2l+1), instead of the scalar loop. Masked-off words are
    // neither read nor faulted on: nothing past the chunk's end is touched.
    // (Masks in every step measured slower: the full steps stay unmasked.)
    let left = words - i;
    if left > 0 {
        let low = |n: usize| ((1u32 << n.min(16)) - 1) as u16;
        let g0 = _mm512_maskz_loadu_epi32(low(left), m.add(4 * i) as *const i32);
        let g1 = _mm512_maskz_loadu_epi32(low(left.saturating_sub(16)), m.add(4 * i + 64) as *const i32);
        let real = ((1u32 << (2 * (left / 8))) - 1) as __mmask8;
        let (a, b) = products!(i, g0, g1);
        acc_a = _mm512_mask_add_epi64(acc_a, real, acc_a, a);
        acc_b = _mm512_mask_add_epi64(acc_b, real, acc_b, b);
    }
    (_mm512_reduce_add_epi64(acc_a) as u64, _mm512_reduce_add_epi64(acc_b) as u64)
}

/// The fastest NH this CPU runs, decided once per process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NhPath {
    Portable,
    Avx2,
    Avx512,
}

fn nh_path() -> NhPath {
    use std::sync::OnceLock;
    static PATH: OnceLock<NhPath> = OnceLock::new();
    *PATH.get_or_init(|| {
        // FANIN_NH=portable|avx2 caps the path (to measure what each vector
        // loop gains); FANIN_SIMD=portable (every vector loop) does the same.
        // AVX-512 is preferred: it halves the vector operations per byte,
        // and the tag of a 4 KiB datagram measured ~1.4x faster here
        // (docs/security.md, "Cost" under the tag).
        let cap = std::env::var("FANIN_NH").unwrap_or_default();
        if cap == "portable" || !crate::simd::avx2() {
            return NhPath::Portable;
        }
        #[cfg(target_arch = "x86_64")]
        if cap != "avx2" && std::is_x86_feature_detected!("avx512f") {
            return NhPath::Avx512;
        }
        NhPath::Avx2
    })
}

/// NH of one chunk, on the fastest path this CPU has.
#[inline]
fn nh_pair(k: &NhKey, chunk: &[u8]) -> (u64, u64) {
    match nh_path() {
        // SAFETY: nh_path() chose a vector path only where CPUID reports it.
        #[cfg(target_arch = "x86_64")]
        NhPath::Avx512 => unsafe { nh_pair_avx512(k, chunk) },
        #[cfg(target_arch = "x86_64")]
        NhPath::Avx2 => unsafe { nh_pair_avx2(k, chunk) },
        _ => nh_pair_scalar(&k.words, chunk),
    }
}

/// The two NH digests of a chunk of at most 1024 bytes, zero-padded to a
/// multiple of 32: the whole 32-byte groups are read in place and only the
/// last partial group is copied (NH is a sum over groups, each with the key
/// words at its own offset, so this equals NH of the padded chunk without
/// zeroing a chunk-sized buffer per datagram).
fn nh_pair_padded(k: &NhKey, chunk: &[u8]) -> (u64, u64) {
    let whole = chunk.len() / 32 * 32;
    let (mut a, mut b) = if whole > 0 { nh_pair(k, &chunk[..whole]) } else { (0, 0) };
    if whole < chunk.len() {
        let mut group = [0u8; 32];
        group[..chunk.len() - whole].copy_from_slice(&chunk[whole..]);
        let (ta, tb) = nh_pair_scalar_at(&k.words, &group, whole / 4);
        a = a.wrapping_add(ta);
        b = b.wrapping_add(tb);
    }
    (a, b)
}

/// Feed the NH digests of `inner` to `h` (the part of the tag that reads
/// the datagram).
fn nh_digests(k: &NhKey, inner: &[u8], h: &mut SipHasher24) {
    for chunk in inner.chunks(NH_CHUNK) {
        let (a, b) = nh_pair_padded(k, chunk);
        h.write_u64_le(a);
        h.write_u64_le(b);
    }
}

/// The NH digests alone, concatenated (for tests and the micro-benchmark).
pub fn nh_digest(k: &NhKey, inner: &[u8]) -> Vec<u64> {
    inner.chunks(NH_CHUNK).flat_map(|chunk| <[u64; 2]>::from(nh_pair_padded(k, chunk))).collect()
}

/// The tag of the datagram `inner` sealed with `seq` under `key` (the one
/// definition; `seal` writes it, `verify` compares with it).
pub fn mac(key: &Key, seq: u64, inner: &[u8]) -> u64 {
    let nh = EXPANDED.with(|cache| cache.borrow_mut().get(key));
    mac_expanded(key, &nh, seq, inner)
}

/// [`mac`] with `key`'s NH key already expanded (`nh` must be
/// `NhKey::new(key)`).
pub fn mac_expanded(key: &Key, nh: &NhKey, seq: u64, inner: &[u8]) -> u64 {
    let mut h = SipHasher24::new(key);
    // be64(seq) ‖ be64(len), fed as the little-endian words of those bytes.
    h.write_u64_le(u64::from_le_bytes(seq.to_be_bytes()));
    h.write_u64_le(u64::from_le_bytes((inner.len() as u64).to_be_bytes()));
    nh_digests(nh, inner, &mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hashing the whole groups in place and padding only the last one
    /// gives the digests of the zero-padded chunk (the definition), for
    /// every length up to past one chunk.
    #[test]
    fn in_place_padding_equals_the_padded_chunk() {
        let k = NhKey::new(&Key([9; 16]));
        let data: Vec<u8> = (0..NH_CHUNK + 100).map(|i| (i * 131 + 7) as u8).collect();
        for len in 0..=data.len() {
            let expected: Vec<u64> = data[..len]
                .chunks(NH_CHUNK)
                .flat_map(|chunk| {
                    let mut padded = vec![0u8; chunk.len().div_ceil(32) * 32];
                    padded[..chunk.len()].copy_from_slice(chunk);
                    <[u64; 2]>::from(nh_pair_scalar(&k.words, &padded))
                })
                .collect();
            assert_eq!(nh_digest(&k, &data[..len]), expected, "{len} bytes");
        }
    }

    /// The vector NH loops must give the portable loop's digests bit for
    /// bit, for every chunk length (every count of groups, so every tail
    /// the wide loops hand to the scalar one), for words that make the
    /// 32-bit key additions wrap and the 64-bit sums overflow, and for keys
    /// whose words are all ones.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_nh_equals_the_portable_loop_on_every_length() {
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2, the portable loop is the only path");
            return;
        }
        let avx512 = std::is_x86_feature_detected!("avx512f");
        if !avx512 {
            eprintln!("AVX-512 part skipped: this CPU has no AVX-512F");
        }
        let mut rand = crate::test_rng(0x9e37_79b9_7f4a_7c15);
        let keys = [NhKey::new(&Key([3; 16])), NhKey::from_words(Box::new([u32::MAX; KEY_WORDS]))];
        for k in &keys {
            for groups in 1..=CHUNK_WORDS / 8 {
                let len = groups * 32;
                let random: Vec<u8> = (0..len).map(|_| rand() as u8).collect();
                for data in [random, vec![0xff; len], vec![0; len]] {
                    let portable = nh_pair_scalar(&k.words, &data);
                    // SAFETY: AVX2 checked above.
                    assert_eq!(unsafe { nh_pair_avx2(k, &data) }, portable, "AVX2, {len} bytes");
                    if avx512 {
                        // SAFETY: AVX-512F checked above.
                        assert_eq!(unsafe { nh_pair_avx512(k, &data) }, portable, "AVX-512, {len} bytes");
                    }
                }
            }
        }
    }
}
