//! Slot layout of a task and key placement (ASK §3.2).
//!
//! A packet has `slot_count` tuple slots, slot i goes to aggregator array i.
//! The first `short_slots` slots take short keys; then come `medium_groups`
//! groups of `medium_parts` adjacent slots, each group coalescing its AAs
//! under one unified index for medium keys (§3.2.3). Longer keys bypass the
//! switch.
//!
//! Key encoding (beyond the paper, which pads keys): a key placed in a slot
//! or group of width `w = 8 * parts` bytes is written as its bytes, zero
//! padding, and a last byte holding the key length. The length byte makes
//! the encoding injective ("a" and "a\0" differ), so the switch can compare
//! key parts as opaque 64-bit words and the receiver can decode them.

use fanin_wire::kv::{KEY_PART_LEN, MAX_SLOTS};

/// How a task's packets are laid out. Shared by the control plane (which
/// sizes the switch region), senders and the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    pub short_slots: u8,
    pub medium_groups: u8,
    /// ASK's m: AAs coalesced per medium key (2 in ASK's implementation).
    pub medium_parts: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("layout has no slots: short_slots + medium_groups * medium_parts must be 1..=64")]
    Empty,
    #[error("layout needs {0} slots; a packet's bitmap has 64")]
    TooManySlots(usize),
    #[error("medium_groups > 0 needs medium_parts >= 2 (got {0})")]
    BadParts(u8),
}

/// Where a key goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClass {
    /// Short slot `slot`, one key part.
    Short { slot: u8, part: u64 },
    /// Medium group `group` (slots `first_slot..first_slot + medium_parts`;
    /// the parts are [`encode_parts`] / [`encode_parts_into`] of the key).
    Medium { group: u8, first_slot: u8 },
    /// Too long for the switch: goes straight to the receiver.
    Long,
}

impl Layout {
    /// ASK's implementation: 32 AAs of 8-byte keys... here `short` short
    /// slots and no medium groups.
    pub fn short_only(short_slots: u8) -> Self {
        Self { short_slots, medium_groups: 0, medium_parts: 0 }
    }

    pub fn slot_count(&self) -> usize {
        self.short_slots as usize + self.medium_groups as usize * self.medium_parts as usize
    }

    pub fn validate(&self) -> Result<(), LayoutError> {
        let n = self.slot_count();
        if n == 0 {
            return Err(LayoutError::Empty);
        }
        if n > MAX_SLOTS {
            return Err(LayoutError::TooManySlots(n));
        }
        if self.medium_groups > 0 && self.medium_parts < 2 {
            return Err(LayoutError::BadParts(self.medium_parts));
        }
        Ok(())
    }

    /// Longest key that a short slot holds (7 bytes + the length byte).
    pub fn max_short_key(&self) -> usize {
        if self.short_slots == 0 {
            0
        } else {
            KEY_PART_LEN - 1
        }
    }

    /// Longest key a medium group holds.
    pub fn max_medium_key(&self) -> usize {
        if self.medium_groups == 0 {
            0
        } else {
            // the length travels in one byte: longer keys go long
            (KEY_PART_LEN * self.medium_parts as usize - 1).min(u8::MAX as usize)
        }
    }

    /// First slot of medium group `g`.
    pub fn group_first_slot(&self, g: u8) -> u8 {
        self.short_slots + g * self.medium_parts
    }

    /// Bits of medium group `g` in a bitmap.
    pub fn group_mask(&self, g: u8) -> u64 {
        fanin_wire::kv::slot_mask(self.medium_parts as usize) << self.group_first_slot(g)
    }

    /// Sender-assisted key-space partition (§3.2.2): hash(key) mod N picks
    /// the slot, so a key always uses the same AA.
    ///
    /// Allocation-free: a sender classifies every tuple it sends.
    pub fn classify(&self, key: &[u8]) -> KeyClass {
        if self.short_slots > 0 && key.len() <= self.max_short_key() {
            // One load serves both the hash and the key part.
            let word = load_be_padded(key);
            let part = word | key.len() as u64;
            let slot = (hash_words(key.len(), (!key.is_empty()).then_some(word)) % self.short_slots as u64) as u8;
            KeyClass::Short { slot, part }
        } else if self.medium_groups > 0 && key.len() <= self.max_medium_key() {
            let group = (hash_partition(key) % self.medium_groups as u64) as u8;
            KeyClass::Medium { group, first_slot: self.group_first_slot(group) }
        } else {
            KeyClass::Long
        }
    }
}

/// Encode `key` into `parts` 8-byte words: bytes, zero padding, length byte.
/// `key.len()` must be below `8 * parts`.
pub fn encode_parts(key: &[u8], parts: usize) -> Vec<u64> {
    let mut words = Vec::with_capacity(parts);
    encode_parts_into(key, parts, &mut words);
    words
}

/// [`encode_parts`] appending to `out`, without allocating.
pub fn encode_parts_into(key: &[u8], parts: usize, out: &mut impl Extend<u64>) {
    debug_assert!(key.len() < KEY_PART_LEN * parts && key.len() < 256);
    let mut chunks = key.chunks(KEY_PART_LEN);
    for i in 0..parts {
        let mut word = chunks.next().map_or(0, load_be_padded);
        if i + 1 == parts {
            word |= key.len() as u64;
        }
        out.extend(Some(word));
    }
}

/// Up to 8 bytes as a big-endian word, zero-padded on the right; without a
/// variable-length copy (a call to memcpy per key was a tenth of a sender's
/// time): two overlapping fixed-size loads.
fn load_be_padded(b: &[u8]) -> u64 {
    let n = b.len();
    debug_assert!(n <= KEY_PART_LEN);
    if n >= 4 {
        let head = u32::from_be_bytes(b[..4].try_into().expect("4 bytes")) as u64;
        let tail = u32::from_be_bytes(b[n - 4..n].try_into().expect("4 bytes")) as u64;
        (head << 32) | (tail << (8 * (8 - n)))
    } else if n > 0 {
        // bytes 0, n/2 and n-1 cover every byte of a 1-3 byte key
        ((b[0] as u64) << 56) | ((b[n / 2] as u64) << (56 - 8 * (n / 2))) | ((b[n - 1] as u64) << (56 - 8 * (n - 1)))
    } else {
        0
    }
}

/// Inverse of a short key's part (`encode_parts(key, 1)`): the key bytes
/// live in the returned array's first `len` bytes.
pub fn decode_short(part: u64) -> Option<([u8; KEY_PART_LEN], usize)> {
    let bytes = part.to_be_bytes();
    let len = bytes[KEY_PART_LEN - 1] as usize;
    if len >= KEY_PART_LEN || bytes[len..KEY_PART_LEN - 1].iter().any(|&b| b != 0) {
        return None;
    }
    Some((bytes, len))
}

/// Inverse of [`encode_parts`]; `None` if the length byte does not fit.
pub fn decode_parts(parts: &[u64]) -> Option<Vec<u8>> {
    let mut bytes = Vec::with_capacity(parts.len() * KEY_PART_LEN);
    for p in parts {
        bytes.extend_from_slice(&p.to_be_bytes());
    }
    let len = *bytes.last()? as usize;
    if len >= bytes.len() || bytes[len..bytes.len() - 1].iter().any(|&b| b != 0) {
        return None;
    }
    bytes.truncate(len);
    Some(bytes)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The host's partition hash F(key) of §3.2.2 (over the raw key bytes).
pub fn hash_partition(key: &[u8]) -> u64 {
    hash_words(key.len(), key.chunks(8).map(load_be_padded))
}

/// The receiver (reduce partition) of a key when a task's key space is
/// split over `partitions` receivers: ASK's sender-assisted partition
/// (§3.2.2) one level up, as its evaluation's many reducers need. Every
/// sender must agree, so this is the one definition. Not `hash_partition
/// mod P`: a receiver's keys would then share their residue mod P, and with
/// `short_slots` a multiple of P they would use only 1/P of the slots; the
/// hash is re-mixed and scaled by its high bits (Lemire's range reduction),
/// independent of the low bits that pick the slot.
pub fn receiver_partition(key: &[u8], partitions: u32) -> u32 {
    let h = mix(hash_partition(key) ^ 0x5851_F42D_4C95_7F2D);
    ((h as u128 * partitions as u128) >> 64) as u32
}

/// [`hash_partition`] over a key's length and its padded 8-byte words (a
/// caller that loaded the word of a short key already passes it).
fn hash_words(len: usize, words: impl IntoIterator<Item = u64>) -> u64 {
    let h = words
        .into_iter()
        .fold(0x243F_6A88_85A3_08D3u64 ^ len as u64, |h, w| mix(h ^ w).wrapping_add(0x9E37_79B9_7F4A_7C15));
    mix(h)
}

/// The switch's aggregator index hash over a tuple's key parts: one unified
/// index for all parts of a coalesced key (§3.2.3). Independent of
/// [`hash_partition`] (other constants, other input), so the keys of one slot
/// spread over the whole AA.
pub fn hash_index(parts: &[u64]) -> u64 {
    hash_index_of(parts.len(), |j| parts[j])
}

/// [`hash_index`] over `n` parts read by `part(j)` (the switch reads them
/// straight from the packet instead of copying them out first).
fn hash_index_of(n: usize, part: impl Fn(usize) -> u64) -> u64 {
    let mut h = 0x1319_8A2E_0370_7344u64;
    for j in 0..n {
        h = mix(h ^ part(j)).wrapping_add(0xD1B5_4A32_D192_ED03);
    }
    mix(h)
}

/// The aggregator of an AA of `aa_size` that a tuple with these key parts
/// uses: [`hash_index`] scaled to `0..aa_size` by a multiply and a shift
/// (Lemire's fast range reduction) rather than `mod`: perf annotate put a
/// third of the switch's per-tuple samples just after that 64-bit division
/// (a few percent of the thread, measured end to end). Uniform because the
/// hash is.
pub fn aggregator_index(parts: &[u64], aa_size: u32) -> usize {
    aggregator_index_of(parts.len(), |j| parts[j], aa_size)
}

/// [`aggregator_index`] over `n` parts read by `part(j)`.
pub(super) fn aggregator_index_of(n: usize, part: impl Fn(usize) -> u64, aa_size: u32) -> usize {
    ((hash_index_of(n, part) as u128 * aa_size as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receiver_partitions_are_balanced_and_use_every_slot() {
        // 4 receivers, 16 short slots: a receiver's keys must not share a
        // residue of the slot hash (they would with hash_partition mod 4).
        let layout = Layout::short_only(16);
        let mut per_receiver = [0u32; 4];
        let mut slots = [[0u32; 16]; 4];
        for i in 0..40_000u32 {
            let key = format!("w{i}");
            let r = receiver_partition(key.as_bytes(), 4) as usize;
            per_receiver[r] += 1;
            if let KeyClass::Short { slot, .. } = layout.classify(key.as_bytes()) {
                slots[r][slot as usize] += 1;
            }
        }
        for (r, n) in per_receiver.iter().enumerate() {
            assert!((9_000..11_000).contains(n), "receiver {r} got {n} of 40000 keys");
            assert!(slots[r].iter().all(|&c| c > 300), "receiver {r} slots {:?}", slots[r]);
        }
        // One partition: everything to receiver 0; the definition is frozen
        // (senders of different builds must agree).
        assert_eq!(receiver_partition(b"anything", 1), 0);
        assert_eq!((0..8).map(|p| receiver_partition(format!("k{p}").as_bytes(), 7)).collect::<Vec<_>>(), GOLDEN);
    }
    const GOLDEN: [u32; 8] = [2, 0, 5, 2, 2, 6, 4, 2];

    /// The plain definitions the fast paths must equal.
    fn padded_reference(b: &[u8]) -> u64 {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        u64::from_be_bytes(w)
    }

    #[test]
    fn fast_key_words_equal_the_plain_definition_for_every_length() {
        let bytes: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37).wrapping_add(1)).collect();
        for len in 0..=8 {
            for start in 0..8 {
                let key = &bytes[start..start + len];
                assert_eq!(load_be_padded(key), padded_reference(key), "{key:?}");
                let word = (!key.is_empty()).then(|| padded_reference(key));
                assert_eq!(hash_words(len, word), hash_partition(key), "{key:?}");
            }
        }
        for len in 0..24 {
            let key = &bytes[..len];
            let parts = len / KEY_PART_LEN + 1;
            let mut want = vec![0u8; parts * KEY_PART_LEN];
            want[..len].copy_from_slice(key);
            want[parts * KEY_PART_LEN - 1] = len as u8;
            let want: Vec<u64> = want.chunks(8).map(padded_reference).collect();
            assert_eq!(encode_parts(key, parts), want, "{key:?}");
            assert_eq!(decode_parts(&want).as_deref(), Some(key));
        }
    }

    #[test]
    fn a_short_key_is_placed_by_its_partition_hash() {
        let layout = Layout { short_slots: 16, medium_groups: 8, medium_parts: 2 };
        for key in [&b""[..], b"a", b"of", b"the", b"word", b"seven77"] {
            let KeyClass::Short { slot, part } = layout.classify(key) else { panic!("{key:?} is short") };
            assert_eq!(slot as u64, hash_partition(key) % 16);
            assert_eq!(part, encode_parts(key, 1)[0]);
        }
        let KeyClass::Medium { group, first_slot } = layout.classify(b"eightchr") else { panic!("medium") };
        assert_eq!(group as u64, hash_partition(b"eightchr") % 8);
        assert_eq!(first_slot, 16 + 2 * group);
    }
}
