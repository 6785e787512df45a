//! Sealed datagrams: a keyed tag and a sequence number appended to any
//! fanin datagram, so a receiver can tell a member's packet from a forgery
//! or a replay (docs/security.md).
//!
//! A datagram is *sealed* when bit 0x80 of its preamble's `msg_type` is set
//! (message types 0x40–0xff are unassigned, so the bit never collides with a
//! real type of either service; parsers look at `msg_type & 0x7f`). A sealed
//! datagram ends with a 16-byte trailer:
//!
//! ```text
//!  +---------------------------------------------------------------+
//!  |  ... the unsealed datagram (preamble, header, body), with      |
//!  |      msg_type | 0x80 ...                                       |
//!  +---------------------------------------------------------------+
//!  |                     seq (u64, big endian)                     |  len-16
//!  +---------------------------------------------------------------+
//!  |                     tag (u64, big endian)                     |  len-8
//!  +---------------------------------------------------------------+
//! ```
//!
//! `tag` = [`mac`]`(key, seq, inner)`, where `inner` is every byte before
//! the trailer: a Wegman–Carter style MAC (UMAC/VMAC, RFC 4418) — the NH
//! universal hash (two Toeplitz-shifted passes) compresses `inner` 1 KiB
//! chunk by chunk into 16 bytes per chunk, and SipHash-2-4 under the member
//! key, over `seq ‖ len ‖ digests`, makes the tag. NH runs at many GB/s, so
//! the tag costs a fraction of a pass of SipHash over the datagram
//! (docs/security.md has the bound and the cost). `seq` is unique per key and
//! *lane*: its top 16 bits name the sending lane (a switch shard; 0 for a
//! worker), the low 48 bits count up from a clock-derived start, so a
//! restarted sender continues above what it sent before. Receivers keep one
//! replay window per (key, lane).
//!
//! Checking a tag costs one pass over the datagram; it happens before the
//! receiver looks at anything else, so a forged packet touches no state.

use crate::preamble::PREAMBLE_LEN;
use crate::WireError;

/// The `msg_type` bit that marks a sealed datagram.
pub const SEALED: u8 = 0x80;
/// Bytes the seal appends: `seq` and `tag`.
pub const TRAILER_LEN: usize = 16;
/// Bits of `seq` that count; the bits above name the lane.
pub const LANE_SHIFT: u32 = 48;
const COUNTER_MASK: u64 = (1 << LANE_SHIFT) - 1;

/// A 128-bit SipHash key (a job key, or a member key derived from one).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key(pub [u8; 16]);

impl core::fmt::Debug for Key {
    // Keys never end up in logs or error messages.
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// Parse 32 hex digits (the config file and CLI form).
    pub fn from_hex(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("a key is 32 hex digits (128 bits), got {} characters", s.len()));
        }
        let mut key = [0u8; 16];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(Self(key))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_slice(bytes: &[u8]) -> Result<Self, String> {
        let key: [u8; 16] = bytes.try_into().map_err(|_| format!("a key is 16 bytes, got {}", bytes.len()))?;
        Ok(Self(key))
    }
}

/// Why a sealed datagram was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("datagram is not sealed (msg_type bit 0x80 clear) but the job requires a tag")]
    Unsealed,
    #[error("sealed datagram of {0} bytes is too short for a preamble and the 16-byte trailer")]
    Truncated(usize),
    #[error("tag does not verify (forged, corrupted, or sealed with another key)")]
    BadTag,
}

/// The member key of `src_id` in job `job_id`: the one derivation the
/// controller, the switch and the Python bindings share. SipHash is a PRF,
/// so two outputs under the job key with distinct inputs are independent;
/// `job_id` is an input so one job key reused for two jobs still gives
/// unrelated member keys (no cross-job replay).
pub fn derive_member_key(job_key: &Key, job_id: u32, src_id: u16) -> Key {
    Key(prf128(job_key, b"fanin-member-k\0\0", 14, job_id, &src_id.to_be_bytes()))
}

/// 128 bits of SipHash-2-4 under `key`: `SipHash(key, input) ‖
/// SipHash(key, input')` (each big endian), where `input` = `label` ‖
/// `job_id` (u32 BE) ‖ `tail` and `input'` is `input` with byte `half_at`
/// (inside the label's zero padding) set to 1.
fn prf128(key: &Key, label: &[u8; 16], half_at: usize, job_id: u32, tail: &[u8]) -> [u8; 16] {
    let mut input = [0u8; 28];
    let len = 20 + tail.len();
    input[..16].copy_from_slice(label);
    input[16..20].copy_from_slice(&job_id.to_be_bytes());
    input[20..len].copy_from_slice(tail);
    let lo = siphash24(key, &input[..len]);
    input[half_at] = 1;
    let hi = siphash24(key, &input[..len]);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&lo.to_be_bytes());
    out[8..].copy_from_slice(&hi.to_be_bytes());
    out
}

/// `incarnation` (u32 BE) ‖ `epoch` (u32 BE): what a result key and its
/// wrapping pad are bound to besides the job.
fn key_epoch_tail(incarnation: u32, epoch: u32) -> [u8; 8] {
    let mut tail = [0u8; 8];
    tail[..4].copy_from_slice(&incarnation.to_be_bytes());
    tail[4..].copy_from_slice(&epoch.to_be_bytes());
    tail
}

/// The job's *result key* on the switch of `incarnation`, in its `epoch`:
/// what that switch seals a result sent once to the job's result group
/// with (one tag every listening member checks, where unicast results carry
/// one tag per member). Under its own label (and 28 bytes of input, a
/// member key's 22) it is independent of every member key; bound to the
/// switch's incarnation, it differs between the switches of one tree
/// (which share the job key) and across restarts, so one switch's group
/// results never verify at another's listeners. The switch starts a new
/// epoch whenever a member leaves the job, so a member that left (which
/// held the key) can neither check nor forge the group results after it.
/// A member learns it only from its JoinAck, wrapped ([`wrap_result_key`]).
/// Every listening member holds it: docs/security.md says what that gives
/// a malicious member.
pub fn derive_result_key(job_key: &Key, job_id: u32, incarnation: u32, epoch: u32) -> Key {
    Key(prf128(job_key, b"fanin-result-k\0\0", 14, job_id, &key_epoch_tail(incarnation, epoch)))
}

/// The result key of the switch of `incarnation` in `epoch` as carried in
/// a JoinAck to the member holding `member_key`: XORed with a pad that is
/// SipHash under the member key (a PRF) of a label, the job id, the
/// incarnation and the epoch. Each pad hides one value only (the result
/// key is a function of the same job, job id, incarnation and epoch), so a
/// fixed pad reveals nothing: in particular a member that left, which knew
/// the old epoch's key, learns nothing from another member's JoinAck of
/// the new epoch (it is under a pad it never saw). The JoinAck's tag
/// authenticates it. Under the member key the input (28 bytes) differs in
/// length from NH's key expansion (16) and from every tag's (32 or more).
/// The same call unwraps.
pub fn wrap_result_key(member_key: &Key, job_id: u32, incarnation: u32, epoch: u32, key: &Key) -> [u8; 16] {
    let pad = prf128(member_key, b"fanin-rkey-wrap\0", 15, job_id, &key_epoch_tail(incarnation, epoch));
    let mut out = key.0;
    for (b, p) in out.iter_mut().zip(pad) {
        *b ^= p;
    }
    out
}

/// Lane bit of a sequence number sealed under the job's result key (a
/// result sent to the result group): the receiver checks it with the
/// result key instead of its member key, and keeps a window apart for it.
/// Bound by the tag like every bit of `seq`, so flipping it only fails
/// the check.
pub const GROUP_LANE: u16 = 0x8000;

/// `seq` moved to the group lanes (the same counter, so still unique).
pub fn group_seq(seq: u64) -> u64 {
    seq | (GROUP_LANE as u64) << LANE_SHIFT
}

/// True when `seq` was sealed under the result key.
pub fn is_group_seq(seq: u64) -> bool {
    lane_of(seq) & GROUP_LANE != 0
}

/// True when the preamble marks the datagram sealed.
pub fn is_sealed(bytes: &[u8]) -> bool {
    bytes.len() >= PREAMBLE_LEN && bytes[3] & SEALED != 0
}

/// The lane a sequence number belongs to.
pub fn lane_of(seq: u64) -> u16 {
    (seq >> LANE_SHIFT) as u16
}

/// The first sequence number of `lane` for a sender started at `clock_us`
/// (microseconds of wall-clock time): counting up from the clock keeps a
/// restarted sender above the numbers it used before, as long as it sent
/// fewer than one datagram per microsecond per key on average.
pub fn first_seq(lane: u16, clock_us: u64) -> u64 {
    ((lane as u64) << LANE_SHIFT) | (clock_us & COUNTER_MASK).max(1)
}

/// The sequence number after `seq`, staying in its lane (the 48-bit counter
/// wraps to 1 after 2^48 datagrams: 8.9 years at one per microsecond).
pub fn next_seq(seq: u64) -> u64 {
    let counter = (seq & COUNTER_MASK) + 1;
    (seq & !COUNTER_MASK) | if counter > COUNTER_MASK { 1 } else { counter }
}

/// The unsealed part and the trailer of a sealed datagram, not yet verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealed<'a> {
    /// The datagram without its trailer (msg_type still has bit 0x80 set;
    /// the service parsers ignore it).
    pub inner: &'a [u8],
    pub seq: u64,
    pub tag: u64,
}

impl<'a> Sealed<'a> {
    /// Split a sealed datagram. Checks lengths only: call
    /// [`verify`](Self::verify) before trusting `inner` or `seq`.
    pub fn split(bytes: &'a [u8]) -> Result<Self, AuthError> {
        if !is_sealed(bytes) {
            return Err(AuthError::Unsealed);
        }
        if bytes.len() < PREAMBLE_LEN + TRAILER_LEN {
            return Err(AuthError::Truncated(bytes.len()));
        }
        let at = bytes.len() - TRAILER_LEN;
        let seq = u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let tag = u64::from_be_bytes(bytes[at + 8..].try_into().expect("8 bytes"));
        Ok(Self { inner: &bytes[..at], seq, tag })
    }

    /// Check the tag under `key`. The comparison is of two u64 values, so its
    /// time does not depend on where they differ.
    pub fn verify(&self, key: &Key) -> Result<(), AuthError> {
        if mac(key, self.seq, self.inner) == self.tag {
            Ok(())
        } else {
            Err(AuthError::BadTag)
        }
    }
}

/// Split and verify in one step: the unsealed bytes and the sequence number.
pub fn open<'a>(key: &Key, bytes: &'a [u8]) -> Result<(&'a [u8], u64), AuthError> {
    let sealed = Sealed::split(bytes)?;
    sealed.verify(key)?;
    Ok((sealed.inner, sealed.seq))
}

/// Seal a datagram in place. `buf` holds the unsealed datagram in its first
/// `buf.len() - TRAILER_LEN` bytes; the trailer is written after it and the
/// sealed bit is set.
pub fn seal(key: &Key, seq: u64, buf: &mut [u8]) -> Result<(), WireError> {
    if buf.len() < PREAMBLE_LEN + TRAILER_LEN {
        return Err(WireError::Truncated { needed: PREAMBLE_LEN + TRAILER_LEN, got: buf.len() });
    }
    buf[3] |= SEALED;
    let at = buf.len() - TRAILER_LEN;
    buf[at..at + 8].copy_from_slice(&seq.to_be_bytes());
    let tag = mac(key, seq, &buf[..at]);
    buf[at + 8..].copy_from_slice(&tag.to_be_bytes());
    Ok(())
}

/// Clear the sealed bit (a datagram relayed unsealed, e.g. to an unkeyed peer).
pub fn clear_sealed_bit(buf: &mut [u8]) {
    if buf.len() >= PREAMBLE_LEN {
        buf[3] &= !SEALED;
    }
}

/// SipHash-2-4 of `data` under `key` (Aumasson & Bernstein; k0, k1 are the
/// key's two little-endian halves, as in the reference implementation).
pub fn siphash24(key: &Key, data: &[u8]) -> u64 {
    let mut h = SipHasher24::new(key);
    h.write(data);
    h.finish()
}

/// Incremental SipHash-2-4 (so a tag covers non-contiguous parts without a copy).
#[derive(Clone)]
pub struct SipHasher24 {
    v: [u64; 4],
    tail: u64,
    ntail: usize,
    length: usize,
}

impl SipHasher24 {
    pub fn new(key: &Key) -> Self {
        let k0 = u64::from_le_bytes(key.0[..8].try_into().expect("8 bytes"));
        let k1 = u64::from_le_bytes(key.0[8..].try_into().expect("8 bytes"));
        Self {
            v: [k0 ^ 0x736f6d6570736575, k1 ^ 0x646f72616e646f6d, k0 ^ 0x6c7967656e657261, k1 ^ 0x7465646279746573],
            tail: 0,
            ntail: 0,
            length: 0,
        }
    }

    #[inline(always)]
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }

    #[inline(always)]
    fn compress(v: &mut [u64; 4], m: u64) {
        v[3] ^= m;
        Self::round(v);
        Self::round(v);
        v[0] ^= m;
    }

    pub fn write(&mut self, mut data: &[u8]) {
        self.length += data.len();
        if self.ntail > 0 {
            while self.ntail < 8 {
                let Some((&b, rest)) = data.split_first() else { return };
                self.tail |= (b as u64) << (8 * self.ntail);
                self.ntail += 1;
                data = rest;
            }
            Self::compress(&mut self.v, self.tail);
            self.tail = 0;
            self.ntail = 0;
        }
        let mut v = self.v;
        let mut words = data.chunks_exact(8);
        for w in &mut words {
            Self::compress(&mut v, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        self.v = v;
        for (i, &b) in words.remainder().iter().enumerate() {
            self.tail |= (b as u64) << (8 * i);
        }
        self.ntail = words.remainder().len();
    }

    /// Feed eight bytes, `word`'s little-endian encoding: the same as
    /// `write(&word.to_le_bytes())`, without the byte-wise tail handling
    /// when the input so far is a whole number of words (as every tag input
    /// is: it is made of 8-byte fields).
    #[inline]
    pub fn write_u64_le(&mut self, word: u64) {
        if self.ntail == 0 {
            self.length += 8;
            Self::compress(&mut self.v, word);
        } else {
            self.write(&word.to_le_bytes());
        }
    }

    pub fn finish(&self) -> u64 {
        let mut v = self.v;
        let b = ((self.length as u64 & 0xff) << 56) | self.tail;
        Self::compress(&mut v, b);
        v[2] ^= 0xff;
        for _ in 0..4 {
            Self::round(&mut v);
        }
        v[0] ^ v[1] ^ v[2] ^ v[3]
    }
}

mod nh;
pub use nh::{mac, mac_expanded, nh_digest, NhKey, NH_CHUNK};

#[cfg(test)]
mod tests;
