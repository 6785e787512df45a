//! Key-value aggregation messages (ASK, ASPLOS 2023, §3).
//!
//! Every key-value message has the same 16-byte header; what follows depends
//! on the message type.
//!
//! ```text
//!  0               1               2               3
//!  +---------------+---------------+---------------+---------------+
//!  |          magic 0xFA17         |    version    |   msg_type    |  preamble
//!  +---------------+---------------+---------------+---------------+
//!  |     flags     |  slot_count   |            channel            |  4
//!  +---------------+---------------+---------------+---------------+
//!  |                            task_id                            |  8
//!  +---------------------------------------------------------------+
//!  |                              seq                              | 12
//!  +---------------------------------------------------------------+
//!  |                       body (by msg_type)                      | 16
//! ```
//!
//! * `Data`: `bitmap u64`, then `slot_count` tuple slots of 16 bytes
//!   (`key_part [8] | value i64`). Bit i of `bitmap` says slot i holds a
//!   tuple that is not yet aggregated.
//! * `LongData`: `slot_count` variable-length tuples
//!   (`key_len u16 | value i64 | key [key_len]`), for keys that bypass the
//!   switch's aggregators. With flag `KEY_FRAGMENT`: one fragment of a key
//!   too long for one datagram, `key_id u32 | total_len u32 | offset u32`
//!   then one tuple whose key bytes are `key[offset .. offset + key_len]`
//!   (`slot_count` 1).
//! * `Fetch`: `copy u8 | aa u8 | max_entries u16 | start u32`.
//! * `FetchReply`: `copy u8 | aa u8 | entry_count u16 | start u32 | next u32`
//!   then `entry_count` entries of 40 bytes
//!   (`index u32 | count u32 | key_part [8] | sum i64 | min i64 | max i64`).
//! * `Clear`, `ClearAck`: `copy u8 | 3 reserved bytes`.
//! * `Nack`: `reason u16 | reserved u16 | detail u32`.
//! * `Ack`, `Fin`, `FinAck`, `Swap`, `SwapAck`, `Release`, `ReleaseAck`: no body.
//!
//! `docs/kv.md` is the specification, with the meaning of every field per
//! message; the golden vectors in the tests pin the bytes.

use crate::preamble::{MessageType, Preamble};
use crate::WireError;

mod field {
    use core::ops::Range;
    pub const FLAGS: usize = 4;
    pub const SLOT_COUNT: usize = 5;
    pub const CHANNEL: Range<usize> = 6..8;
    pub const TASK_ID: Range<usize> = 8..12;
    pub const SEQ: Range<usize> = 12..16;
    pub const BODY: usize = 16;
}

/// Bytes of the common key-value header (preamble included).
pub const HEADER_LEN: usize = field::BODY;
/// Bytes of the key part one aggregator stores (ASK's kPart).
pub const KEY_PART_LEN: usize = 8;
/// Bytes of one tuple slot of a `Data` packet: key part + value.
pub const SLOT_LEN: usize = KEY_PART_LEN + 8;
/// The bitmap is a u64: at most 64 slots (aggregator arrays) per packet.
pub const MAX_SLOTS: usize = 64;
/// Bytes of the `bitmap` field of a `Data` body.
pub const BITMAP_LEN: usize = 8;
/// Bytes of the fixed part of a `FetchReply` body.
pub const FETCH_REPLY_FIXED: usize = 12;
/// Bytes of one `FetchReply` entry.
pub const FETCH_ENTRY_LEN: usize = 40;
/// Most entries one `FetchReply` carries (keeps it near one MTU).
pub const MAX_FETCH_ENTRIES: usize = 32;
/// Bytes before each key of a `LongData` tuple.
pub const LONG_TUPLE_FIXED: usize = 10;

/// Flag of `Ack`: the switch absorbed every tuple (ASK's switch ACK), as
/// opposed to the receiver acknowledging a forwarded packet.
pub const FLAG_BY_SWITCH: u8 = 0b0000_0001;
/// Flag of `Swap` / `SwapAck`: end of task, freeze the region for reading.
pub const FLAG_FINAL: u8 = 0b0000_0010;
/// Flag of `LongData`: the packet carries one fragment of a key too long
/// for one datagram (docs/kv.md, "Keys of any length").
pub const FLAG_KEY_FRAGMENT: u8 = 0b0000_0100;
const FLAGS_KNOWN: u8 = FLAG_BY_SWITCH | FLAG_FINAL | FLAG_KEY_FRAGMENT;
/// Bytes before the tuple of a key-fragment `LongData` body.
pub const FRAGMENT_FIXED: usize = 12;

/// Length of the body of a message, given its header, or why it is invalid.
/// `LongData` is variable; its length is checked by walking the tuples.
fn expected_body_len(msg_type: MessageType, flags: u8, slot_count: u8, body: &[u8]) -> Result<usize, WireError> {
    Ok(match msg_type {
        MessageType::KvData => BITMAP_LEN + slot_count as usize * SLOT_LEN,
        MessageType::KvLongData if flags & FLAG_KEY_FRAGMENT != 0 => {
            if slot_count != 1 {
                return Err(WireError::TooManyElements { grad_cnt: slot_count as usize, max: 1 });
            }
            let at = FRAGMENT_FIXED;
            if body.len() < at + LONG_TUPLE_FIXED {
                return Err(WireError::Truncated { needed: HEADER_LEN + at + LONG_TUPLE_FIXED, got: HEADER_LEN + body.len() });
            }
            let frag_len = u16::from_be_bytes([body[at], body[at + 1]]) as u64;
            let (total, offset) = (read_u32(&body[4..]) as u64, read_u32(&body[8..]) as u64);
            if frag_len == 0 || offset + frag_len > total {
                return Err(WireError::FragmentOutOfRange { offset, len: frag_len, total });
            }
            at + LONG_TUPLE_FIXED + frag_len as usize
        }
        MessageType::KvLongData => {
            let mut at = 0usize;
            for _ in 0..slot_count {
                if body.len() < at + LONG_TUPLE_FIXED {
                    return Err(WireError::Truncated { needed: HEADER_LEN + at + LONG_TUPLE_FIXED, got: HEADER_LEN + body.len() });
                }
                let key_len = u16::from_be_bytes([body[at], body[at + 1]]) as usize;
                at += LONG_TUPLE_FIXED + key_len;
            }
            at
        }
        MessageType::KvFetch => 8,
        MessageType::KvFetchReply => {
            if body.len() < FETCH_REPLY_FIXED {
                return Err(WireError::Truncated { needed: HEADER_LEN + FETCH_REPLY_FIXED, got: HEADER_LEN + body.len() });
            }
            let entries = u16::from_be_bytes([body[2], body[3]]) as usize;
            if entries > MAX_FETCH_ENTRIES {
                return Err(WireError::TooManyElements { grad_cnt: entries, max: MAX_FETCH_ENTRIES });
            }
            FETCH_REPLY_FIXED + entries * FETCH_ENTRY_LEN
        }
        MessageType::KvClear | MessageType::KvClearAck => 4,
        MessageType::KvNack => 8,
        MessageType::KvAck
        | MessageType::KvFin
        | MessageType::KvFinAck
        | MessageType::KvSwap
        | MessageType::KvSwapAck
        | MessageType::KvRelease
        | MessageType::KvReleaseAck => 0,
        other => return Err(WireError::WrongService(other as u8)),
    })
}

/// Zero-copy view of a key-value datagram.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a buffer without checks, for emission into a buffer the caller
    /// sized with [`Repr::buffer_len`] (plus the body).
    pub fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wrap an untrusted buffer. On success no accessor panics, the datagram
    /// length is exactly what the header implies, and for `Data` no bitmap
    /// bit names a slot beyond `slot_count`.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let packet = Self { buffer };
        packet.check()?;
        Ok(packet)
    }

    fn check(&self) -> Result<(), WireError> {
        let bytes = self.buffer.as_ref();
        let preamble = Preamble::parse(bytes)?;
        if !preamble.msg_type.is_kv() {
            return Err(WireError::WrongService(preamble.msg_type as u8));
        }
        // A sealed datagram (docs/security.md) is parsed after its trailer
        // was verified and stripped: the sealed bit is all that remains of
        // it, and the type is read without it.
        if bytes.len() < HEADER_LEN {
            return Err(WireError::Truncated { needed: HEADER_LEN, got: bytes.len() });
        }
        let flags = bytes[field::FLAGS];
        // KEY_FRAGMENT only means something on LongData (its body then
        // starts with the fragment header): on anything else it is unknown
        if flags & !FLAGS_KNOWN != 0 || (flags & FLAG_KEY_FRAGMENT != 0 && preamble.msg_type != MessageType::KvLongData) {
            return Err(WireError::ReservedBits(flags));
        }
        let slot_count = bytes[field::SLOT_COUNT];
        if preamble.msg_type == MessageType::KvData && slot_count as usize > MAX_SLOTS {
            return Err(WireError::TooManyElements { grad_cnt: slot_count as usize, max: MAX_SLOTS });
        }
        let body = &bytes[HEADER_LEN..];
        let expected = HEADER_LEN + expected_body_len(preamble.msg_type, flags, slot_count, body)?;
        if bytes.len() != expected {
            return Err(WireError::LengthMismatch { expected, got: bytes.len() });
        }
        if preamble.msg_type == MessageType::KvData {
            let bitmap = self.bitmap();
            if bitmap & !slot_mask(slot_count as usize) != 0 {
                return Err(WireError::BitmapBeyondSlots { bitmap, slot_count });
            }
        }
        if preamble.msg_type == MessageType::KvNack {
            NackReason::from_u16(u16::from_be_bytes([body[0], body[1]]))?;
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }
    fn bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// The message type byte without the sealed bit.
    pub fn msg_type_code(&self) -> u8 {
        self.bytes()[3] & !crate::auth::SEALED
    }
    /// The message type (validated by `new_checked`).
    pub fn msg_type(&self) -> MessageType {
        MessageType::from_u8(self.msg_type_code()).unwrap_or(MessageType::KvNack)
    }
    pub fn flags(&self) -> u8 {
        self.bytes()[field::FLAGS]
    }
    pub fn slot_count(&self) -> u8 {
        self.bytes()[field::SLOT_COUNT]
    }
    pub fn channel(&self) -> u16 {
        let b = &self.bytes()[field::CHANNEL];
        u16::from_be_bytes([b[0], b[1]])
    }
    pub fn task_id(&self) -> u32 {
        let b = &self.bytes()[field::TASK_ID];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }
    pub fn seq(&self) -> u32 {
        let b = &self.bytes()[field::SEQ];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }
    pub fn body(&self) -> &[u8] {
        &self.bytes()[field::BODY..]
    }
    /// `Data` only: the bitmap of slots that still carry a tuple.
    pub fn bitmap(&self) -> u64 {
        read_u64(&self.bytes()[field::BODY..])
    }
    /// `Data` only: key part of slot `i` (`i < slot_count`).
    pub fn key_part(&self, i: usize) -> [u8; KEY_PART_LEN] {
        let at = field::BODY + BITMAP_LEN + i * SLOT_LEN;
        let mut k = [0u8; KEY_PART_LEN];
        k.copy_from_slice(&self.bytes()[at..at + KEY_PART_LEN]);
        k
    }
    /// `Data` only: value of slot `i` (`i < slot_count`).
    pub fn value(&self, i: usize) -> i64 {
        let at = field::BODY + BITMAP_LEN + i * SLOT_LEN + KEY_PART_LEN;
        read_u64(&self.bytes()[at..]) as i64
    }
    /// `LongData` only: the tuples, in order (none for a key fragment:
    /// see [`Packet::key_fragment`]).
    pub fn long_tuples(&self) -> LongTuples<'_> {
        let left = if self.flags() & FLAG_KEY_FRAGMENT != 0 { 0 } else { self.slot_count() };
        LongTuples { rest: self.body(), left }
    }
    /// `LongData` with `KEY_FRAGMENT` only: the fragment.
    pub fn key_fragment(&self) -> Option<KeyFragment<'_>> {
        if self.flags() & FLAG_KEY_FRAGMENT == 0 || self.msg_type() != MessageType::KvLongData {
            return None;
        }
        let body = self.body();
        let (key, value) = LongTuples { rest: &body[FRAGMENT_FIXED..], left: 1 }.next()?;
        Some(KeyFragment { key_id: read_u32(body), total_len: read_u32(&body[4..]), offset: read_u32(&body[8..]), bytes: key, value })
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_bitmap(&mut self, bitmap: u64) {
        self.buffer.as_mut()[field::BODY..field::BODY + BITMAP_LEN].copy_from_slice(&bitmap.to_be_bytes());
    }
    /// `Data` only: write slot `i`.
    pub fn set_slot(&mut self, i: usize, key_part: [u8; KEY_PART_LEN], value: i64) {
        let at = field::BODY + BITMAP_LEN + i * SLOT_LEN;
        let b = self.buffer.as_mut();
        b[at..at + KEY_PART_LEN].copy_from_slice(&key_part);
        b[at + KEY_PART_LEN..at + SLOT_LEN].copy_from_slice(&value.to_be_bytes());
    }
    pub fn body_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::BODY..]
    }
}

/// One fragment of a key too long for one datagram (checked: `offset +
/// bytes.len() <= total_len`, `bytes` not empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyFragment<'a> {
    /// Which key of the channel (the sender's push index, mod 2^32).
    pub key_id: u32,
    /// The whole key's length.
    pub total_len: u32,
    /// Where `bytes` start in the key.
    pub offset: u32,
    pub bytes: &'a [u8],
    /// The tuple's value (the same in every fragment of the key).
    pub value: i64,
}

/// Write a key-fragment `LongData` body (`body` sized
/// `FRAGMENT_FIXED + LONG_TUPLE_FIXED + bytes.len()`); returns the bytes used.
pub fn emit_key_fragment(key_id: u32, total_len: u32, offset: u32, bytes: &[u8], value: i64, body: &mut [u8]) -> usize {
    body[0..4].copy_from_slice(&key_id.to_be_bytes());
    body[4..8].copy_from_slice(&total_len.to_be_bytes());
    body[8..12].copy_from_slice(&offset.to_be_bytes());
    FRAGMENT_FIXED + emit_long_tuple(bytes, value, &mut body[FRAGMENT_FIXED..])
}

fn read_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn read_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Bits `0..slot_count` set.
pub fn slot_mask(slot_count: usize) -> u64 {
    if slot_count >= 64 {
        u64::MAX
    } else {
        (1u64 << slot_count) - 1
    }
}

/// Iterator over the tuples of a checked `LongData` packet.
#[derive(Debug, Clone)]
pub struct LongTuples<'a> {
    rest: &'a [u8],
    left: u8,
}

impl<'a> Iterator for LongTuples<'a> {
    /// `(key, value)`
    type Item = (&'a [u8], i64);
    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 || self.rest.len() < LONG_TUPLE_FIXED {
            return None;
        }
        let key_len = u16::from_be_bytes([self.rest[0], self.rest[1]]) as usize;
        let value = read_u64(&self.rest[2..]) as i64;
        let end = (LONG_TUPLE_FIXED + key_len).min(self.rest.len());
        let key = &self.rest[LONG_TUPLE_FIXED..end];
        self.rest = &self.rest[end..];
        self.left -= 1;
        Some((key, value))
    }
}

/// Bytes a `LongData` body needs for these keys.
pub fn long_body_len<'k>(keys: impl IntoIterator<Item = &'k [u8]>) -> usize {
    keys.into_iter().map(|k| LONG_TUPLE_FIXED + k.len()).sum()
}

/// Write one `LongData` tuple at the start of `body`; returns the bytes used.
pub fn emit_long_tuple(key: &[u8], value: i64, body: &mut [u8]) -> usize {
    body[0..2].copy_from_slice(&(key.len() as u16).to_be_bytes());
    body[2..10].copy_from_slice(&value.to_be_bytes());
    body[LONG_TUPLE_FIXED..LONG_TUPLE_FIXED + key.len()].copy_from_slice(key);
    LONG_TUPLE_FIXED + key.len()
}

/// Parsed common header of a key-value message (the body stays in the buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub msg_type: MessageType,
    pub flags: u8,
    /// `Data`: tuple slots (= aggregator arrays); `LongData`: tuple count.
    pub slot_count: u8,
    /// The sender's data channel (ASK: receive windows are per channel).
    pub channel: u16,
    pub task_id: u32,
    /// Data/Ack: packet sequence number of the channel. Fin: packets sent.
    /// Swap/SwapAck/Fetch/FetchReply/Clear/ClearAck: the copy epoch.
    pub seq: u32,
}

impl Repr {
    pub fn new(msg_type: MessageType, task_id: u32, channel: u16, seq: u32) -> Self {
        Self { msg_type, flags: 0, slot_count: 0, channel, task_id, seq }
    }

    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, WireError> {
        packet.check()?;
        Ok(Self {
            msg_type: MessageType::from_u8(packet.msg_type_code())?,
            flags: packet.flags(),
            slot_count: packet.slot_count(),
            channel: packet.channel(),
            task_id: packet.task_id(),
            seq: packet.seq(),
        })
    }

    /// Length of the whole datagram for the fixed-size bodies (every type
    /// but `LongData` and `FetchReply`, whose callers add their body length
    /// to [`HEADER_LEN`]).
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + expected_body_len(self.msg_type, self.flags, self.slot_count, &[]).unwrap_or(0)
    }

    /// Write the header into the first [`HEADER_LEN`] bytes of `packet`.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        let b = packet.buffer.as_mut();
        Preamble::emit(self.msg_type, b);
        b[field::FLAGS] = self.flags;
        b[field::SLOT_COUNT] = self.slot_count;
        b[field::CHANNEL].copy_from_slice(&self.channel.to_be_bytes());
        b[field::TASK_ID].copy_from_slice(&self.task_id.to_be_bytes());
        b[field::SEQ].copy_from_slice(&self.seq.to_be_bytes());
    }
}

/// Body of `Fetch`: read up to `max_entries` non-empty aggregators of one
/// aggregator array of one copy, scanning from index `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchRequest {
    pub copy: u8,
    pub aa: u8,
    pub max_entries: u16,
    pub start: u32,
}

impl FetchRequest {
    pub const LEN: usize = 8;
    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        Ok(Self {
            copy: body[0],
            aa: body[1],
            max_entries: u16::from_be_bytes([body[2], body[3]]),
            start: u32::from_be_bytes([body[4], body[5], body[6], body[7]]),
        })
    }
    pub fn emit(&self, body: &mut [u8]) {
        body[0] = self.copy;
        body[1] = self.aa;
        body[2..4].copy_from_slice(&self.max_entries.to_be_bytes());
        body[4..8].copy_from_slice(&self.start.to_be_bytes());
    }
}

/// One aggregator as read by `Fetch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchEntry {
    pub index: u32,
    pub count: u32,
    pub key_part: [u8; KEY_PART_LEN],
    pub sum: i64,
    pub min: i64,
    pub max: i64,
}

impl FetchEntry {
    pub fn parse(b: &[u8]) -> Self {
        let mut key_part = [0u8; KEY_PART_LEN];
        key_part.copy_from_slice(&b[8..16]);
        Self {
            index: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            count: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            key_part,
            sum: read_u64(&b[16..]) as i64,
            min: read_u64(&b[24..]) as i64,
            max: read_u64(&b[32..]) as i64,
        }
    }
    pub fn emit(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.index.to_be_bytes());
        b[4..8].copy_from_slice(&self.count.to_be_bytes());
        b[8..16].copy_from_slice(&self.key_part);
        b[16..24].copy_from_slice(&self.sum.to_be_bytes());
        b[24..32].copy_from_slice(&self.min.to_be_bytes());
        b[32..40].copy_from_slice(&self.max.to_be_bytes());
    }
}

/// Fixed part of a `FetchReply` body. `next` is the index to resume the scan
/// from; `next` equal to the aggregator array's size means the array is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchReplyHead {
    pub copy: u8,
    pub aa: u8,
    pub entry_count: u16,
    pub start: u32,
    pub next: u32,
}

impl FetchReplyHead {
    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < FETCH_REPLY_FIXED {
            return Err(WireError::Truncated { needed: FETCH_REPLY_FIXED, got: body.len() });
        }
        Ok(Self {
            copy: body[0],
            aa: body[1],
            entry_count: u16::from_be_bytes([body[2], body[3]]),
            start: u32::from_be_bytes([body[4], body[5], body[6], body[7]]),
            next: u32::from_be_bytes([body[8], body[9], body[10], body[11]]),
        })
    }
    pub fn emit(&self, body: &mut [u8]) {
        body[0] = self.copy;
        body[1] = self.aa;
        body[2..4].copy_from_slice(&self.entry_count.to_be_bytes());
        body[4..8].copy_from_slice(&self.start.to_be_bytes());
        body[8..12].copy_from_slice(&self.next.to_be_bytes());
    }
    /// Entries of a checked reply body.
    pub fn entries(body: &[u8]) -> impl Iterator<Item = FetchEntry> + '_ {
        body.get(FETCH_REPLY_FIXED..)
            .unwrap_or(&[])
            .chunks_exact(FETCH_ENTRY_LEN)
            .map(FetchEntry::parse)
    }
}

/// Why the switch refused a key-value message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum NackReason {
    /// No region is allocated for this task id (detail = task id).
    UnknownTask = 1,
    /// slot_count differs from the task's layout (detail = the layout's).
    LayoutMismatch = 2,
    /// The task already has its maximum of channels (detail = the cap).
    TooManyChannels = 3,
    /// Swap/Fetch/Clear names an epoch or copy the switch is not in
    /// (detail = the current epoch).
    StaleEpoch = 4,
    /// Fetch/Clear of the copy being aggregated into (detail = copy).
    CopyActive = 5,
    /// A coalesced (medium-key) group has some but not all bits set
    /// (detail = the group's first slot).
    SplitGroup = 6,
    /// Fetch of an aggregator array the task does not have (detail = aa).
    NoSuchArray = 7,
}

impl NackReason {
    pub fn from_u16(code: u16) -> Result<Self, WireError> {
        Ok(match code {
            1 => Self::UnknownTask,
            2 => Self::LayoutMismatch,
            3 => Self::TooManyChannels,
            4 => Self::StaleEpoch,
            5 => Self::CopyActive,
            6 => Self::SplitGroup,
            7 => Self::NoSuchArray,
            other => return Err(WireError::UnknownNackReason(other)),
        })
    }
    pub fn describe(self) -> &'static str {
        match self {
            Self::UnknownTask => "no switch memory is allocated for this task",
            Self::LayoutMismatch => "packet slot count differs from the task's aggregator arrays",
            Self::TooManyChannels => "the task already has its maximum number of sender channels",
            Self::StaleEpoch => "swap/fetch/clear names another copy epoch than the switch's",
            Self::CopyActive => "cannot read or clear the copy that is being aggregated into",
            Self::SplitGroup => "a coalesced medium-key group is only partly present in the bitmap",
            Self::NoSuchArray => "the task has no aggregator array with that index",
        }
    }
}

/// Body of a `Nack`: `reason u16 | reserved u16 | detail u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nack {
    pub reason: NackReason,
    pub detail: u32,
}

impl Nack {
    pub const LEN: usize = 8;
    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        Ok(Self {
            reason: NackReason::from_u16(u16::from_be_bytes([body[0], body[1]]))?,
            detail: u32::from_be_bytes([body[4], body[5], body[6], body[7]]),
        })
    }
    pub fn emit(&self, body: &mut [u8]) {
        body[0..2].copy_from_slice(&(self.reason as u16).to_be_bytes());
        body[2..4].copy_from_slice(&[0, 0]);
        body[4..8].copy_from_slice(&self.detail.to_be_bytes());
    }
}

#[cfg(test)]
mod tests;
