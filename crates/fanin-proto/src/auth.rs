//! Authenticated membership, the state half (the wire half is
//! `fanin_wire::auth`): replay windows, a job's member keys on a switch,
//! and sealing what a machine sends. See docs/security.md.

use fanin_wire::auth::{self, AuthError, Sealed};
pub use fanin_wire::auth::{derive_member_key, Key};
use serde::{Deserialize, Deserializer, Serializer};

use crate::transmit::Transmit;

/// Sequence numbers a replay window remembers behind the highest one seen.
/// A legitimate datagram reordered further than this is refused as too old:
/// a worker has at most `block_cnt_max` (≤ a few hundred in practice)
/// blocks in flight per switch, so 1024 covers any reordering the protocol
/// itself can produce, for 136 bytes per (sender, lane).
pub const REPLAY_WINDOW: u64 = 1024;
const WORDS: usize = (REPLAY_WINDOW / 64) as usize;
/// Most lanes (sending threads: switch shards) one receiver tracks per key.
pub const MAX_LANES: usize = 1024;

/// Why a datagram with a valid tag was still refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Replay {
    #[error("sequence number already seen")]
    Duplicate,
    #[error("sequence number more than {REPLAY_WINDOW} behind the highest seen")]
    TooOld,
    #[error("lane beyond the {MAX_LANES} a receiver tracks")]
    BadLane,
}

/// An anti-replay window over one sender's sequence numbers (RFC 4303
/// §3.4.3): the highest number seen and a bitmap of the `REPLAY_WINDOW`
/// numbers up to it. A number above the highest slides the window; one
/// inside it is accepted once; one below it is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWindow {
    /// Highest sequence number accepted; 0 = none yet (0 is never valid).
    top: u64,
    /// Bit `s % REPLAY_WINDOW` set: `s` (within the window) was accepted.
    seen: [u64; WORDS],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        Self { top: 0, seen: [0; WORDS] }
    }
}

impl ReplayWindow {
    pub fn top(&self) -> u64 {
        self.top
    }

    fn bit(seq: u64) -> (usize, u64) {
        let i = seq % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    /// Accept `seq` once, or say why not. Call only after the tag verified,
    /// so a forgery cannot move the window.
    pub fn accept(&mut self, seq: u64) -> Result<(), Replay> {
        if seq == 0 {
            return Err(Replay::TooOld);
        }
        if seq > self.top {
            let gap = seq - self.top;
            if gap >= REPLAY_WINDOW || self.top == 0 {
                self.seen = [0; WORDS];
            } else {
                // Forget the numbers that slide out (they share bits with
                // the ones that slide in).
                for s in self.top + 1..seq {
                    let (w, b) = Self::bit(s);
                    self.seen[w] &= !b;
                }
            }
            let (w, b) = Self::bit(seq);
            self.seen[w] |= b;
            self.top = seq;
            return Ok(());
        }
        if self.top - seq >= REPLAY_WINDOW {
            return Err(Replay::TooOld);
        }
        let (w, b) = Self::bit(seq);
        if self.seen[w] & b != 0 {
            return Err(Replay::Duplicate);
        }
        self.seen[w] |= b;
        Ok(())
    }
}

/// One replay window per lane of a sender (created when a lane is first
/// heard from with a valid tag).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneWindows {
    lanes: Vec<ReplayWindow>,
}

impl LaneWindows {
    /// Heap bytes its windows take (switch memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.lanes.capacity() * std::mem::size_of::<ReplayWindow>()
    }

    pub fn accept(&mut self, seq: u64) -> Result<(), Replay> {
        let lane = auth::lane_of(seq) as usize;
        if lane >= MAX_LANES {
            return Err(Replay::BadLane);
        }
        if self.lanes.len() <= lane {
            self.lanes.resize(lane + 1, ReplayWindow::default());
        }
        self.lanes[lane].accept(seq)
    }
}

/// Why a datagram of a keyed job was dropped before the program saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Replay(#[from] Replay),
    /// The source is not a member, so it has no key to check against.
    #[error("source has no key in this job")]
    NoKey,
}

impl Refusal {
    /// A valid tag on a sequence number already used (`auth_replayed`), as
    /// opposed to a tag that does not verify (`auth_bad_tag`).
    pub fn is_replay(&self) -> bool {
        matches!(self, Refusal::Replay(_))
    }
}

/// Verify a sealed datagram under `key` and pass it through `window`:
/// the unsealed bytes, or why it was refused. The window moves only for a
/// datagram whose tag verified.
pub fn open_and_accept<'a>(key: &Key, window: &mut LaneWindows, bytes: &'a [u8]) -> Result<&'a [u8], Refusal> {
    let sealed = Sealed::split(bytes)?;
    sealed.verify(key)?;
    window.accept(sealed.seq)?;
    Ok(sealed.inner)
}

/// [`open_and_accept`] for a result sent to a job's result group: sealed
/// under the job's result key on a group lane (`fanin_wire::auth::GROUP_LANE`
/// set) and a Result, the one message a switch sends to a group; anything
/// else sealed under that key (which every listening member holds) is
/// refused before `window` moves. `window` holds the group lanes' numbers
/// apart from the member key's, indexed by the lane without the group bit.
pub fn open_group_and_accept<'a>(key: &Key, window: &mut LaneWindows, bytes: &'a [u8]) -> Result<&'a [u8], Refusal> {
    let sealed = Sealed::split(bytes)?;
    let result = bytes[3] & !auth::SEALED == fanin_wire::MessageType::Result as u8;
    if !auth::is_group_seq(sealed.seq) || !result {
        return Err(Refusal::Auth(AuthError::BadTag));
    }
    sealed.verify(key)?;
    window.accept(sealed.seq & !((auth::GROUP_LANE as u64) << auth::LANE_SHIFT))?;
    Ok(sealed.inner)
}

/// A sender's key and its next sequence number.
#[derive(Debug, Clone)]
pub struct Sealer {
    pub key: Key,
    next: u64,
}

impl Sealer {
    /// Sequence numbers start at [`auth::first_seq`] of `lane` and `clock_us`.
    pub fn new(key: Key, lane: u16, clock_us: u64) -> Self {
        Self { key, next: auth::first_seq(lane, clock_us) }
    }

    /// Take the next sequence number.
    pub fn take_seq(&mut self) -> u64 {
        let seq = self.next;
        self.next = auth::next_seq(seq);
        seq
    }

    /// Queue a sealed datagram of `len` unsealed bytes that `fill` writes.
    pub fn push<A>(&mut self, out: &mut impl Transmit<A>, dest: A, len: usize, fill: impl FnOnce(&mut [u8])) {
        let seq = self.take_seq();
        push_sealed(out, dest, len, Some((&self.key, seq)), fill);
    }
}

/// Queue a datagram of `len` unsealed bytes that `fill` writes, sealed
/// with `seal` (key, seq) when given, plain otherwise.
pub fn push_sealed<A>(
    out: &mut impl Transmit<A>,
    dest: A,
    len: usize,
    seal: Option<(&Key, u64)>,
    fill: impl FnOnce(&mut [u8]),
) {
    match seal {
        None => {
            let buf = out.push(dest, len);
            fill(buf);
            auth::clear_sealed_bit(buf);
        }
        Some((key, seq)) => {
            let buf = out.push(dest, len + auth::TRAILER_LEN);
            fill(&mut buf[..len]);
            auth::seal(key, seq, buf).expect("sized for the trailer");
        }
    }
}

/// Serde form of a job key: 32 hex digits.
pub mod hex_key {
    use super::*;

    pub fn serialize<S: Serializer>(key: &Option<Key>, s: S) -> Result<S::Ok, S::Error> {
        match key {
            Some(k) => s.serialize_some(&k.to_hex()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Key>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| Key::from_hex(&t).map_err(serde::de::Error::custom)).transpose()
    }
}

#[cfg(test)]
mod tests;
