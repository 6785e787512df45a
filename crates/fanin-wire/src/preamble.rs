//! The common preamble every fanin datagram starts with.
//!
//! ```text
//!  0               1               2               3
//!  +---------------+---------------+---------------+---------------+
//!  |          magic 0xFA17         |    version    |   msg_type    |
//!  +---------------+---------------+---------------+---------------+
//! ```

use crate::WireError;

pub const MAGIC: u16 = 0xFA17;
pub const VERSION: u8 = 1;
pub const PREAMBLE_LEN: usize = 4;

/// Message types of all services share one number space so a receiver can
/// route a datagram from the preamble alone. 0x01–0x1f: value-stream
/// aggregation; 0x20–0x3f are reserved for key-value aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageType {
    /// Worker → switch: a block of this worker's values (or exponent only).
    Contribution = 0x01,
    /// Worker → switch: the same contribution again after a timeout.
    Retransmission = 0x02,
    /// Switch → worker: the aggregated block (or the negotiated exponent).
    Result = 0x03,
    /// Worker → switch: announce membership, ask for the job's parameters.
    Join = 0x04,
    /// Switch → worker: job parameters and the current block offset.
    JoinAck = 0x05,
    /// Switch → worker: the request was refused, with a reason.
    Nack = 0x06,
    /// Switch → members: a source's straggler status changed (declared
    /// permanently slow, or re-admitted). Header only: `src_id` names the
    /// source, `age_op` the new status, `src_cnt` the sources the job now
    /// waits for, `block_id` the block at which it took effect.
    Membership = 0x07,
    /// Switch → parent switch: a worker below asks the tree's root for the
    /// current block offset (the SwitchML++ sync message). `src_id` is the
    /// forwarding switch's rank at its parent; the body names the worker
    /// that asked. The root answers with a `JoinAck` whose `src_id` is that
    /// worker, relayed down hop by hop.
    Sync = 0x08,
    /// Worker → switch shard: the results this worker holds, sent when the
    /// shard refused a block for want of memory (a `Trimmed` nack, cause
    /// `MemoryExhausted`). `block_id` is the worker's lowest block without
    /// a result: it holds every result before it, and bit `j` of body word
    /// `k` (`grad_cnt` 64-bit words, least significant bit first) says it
    /// holds block `block_id + 64k + j`. The shard frees the done blocks
    /// every member holds (pooled memory, docs/memory.md).
    ResultAck = 0x09,
    /// Key-value sender → switch → receiver: bitmap + tuple slots (ASK).
    KvData = 0x20,
    /// Key-value sender → switch → receiver: tuples whose keys bypass the
    /// switch's aggregators (long keys).
    KvLongData = 0x21,
    /// Switch or receiver → sender: packet `seq` of a channel is consumed.
    KvAck = 0x22,
    /// Sender → receiver: every packet of this channel was acknowledged.
    KvFin = 0x23,
    /// Receiver → sender: the FIN was received.
    KvFinAck = 0x24,
    /// Receiver → switch: flip the copy indicator (or freeze, if final).
    KvSwap = 0x25,
    /// Switch → receiver: the swap (or freeze) took effect.
    KvSwapAck = 0x26,
    /// Receiver → switch: read aggregators of an inactive copy.
    KvFetch = 0x27,
    /// Switch → receiver: aggregators read by a fetch.
    KvFetchReply = 0x28,
    /// Receiver → switch: reset an inactive copy after reading it.
    KvClear = 0x29,
    /// Switch → receiver: the copy was reset.
    KvClearAck = 0x2A,
    /// Receiver → switch: the task is over, free its memory region.
    KvRelease = 0x2B,
    /// Switch → sender or receiver: the message was refused, with a reason.
    KvNack = 0x2C,
    /// Switch → receiver: the task's region was freed.
    KvReleaseAck = 0x2D,
}

impl MessageType {
    pub fn from_u8(code: u8) -> Result<Self, WireError> {
        Ok(match code {
            0x01 => Self::Contribution,
            0x02 => Self::Retransmission,
            0x03 => Self::Result,
            0x04 => Self::Join,
            0x05 => Self::JoinAck,
            0x06 => Self::Nack,
            0x07 => Self::Membership,
            0x08 => Self::Sync,
            0x09 => Self::ResultAck,
            0x20 => Self::KvData,
            0x21 => Self::KvLongData,
            0x22 => Self::KvAck,
            0x23 => Self::KvFin,
            0x24 => Self::KvFinAck,
            0x25 => Self::KvSwap,
            0x26 => Self::KvSwapAck,
            0x27 => Self::KvFetch,
            0x28 => Self::KvFetchReply,
            0x29 => Self::KvClear,
            0x2A => Self::KvClearAck,
            0x2B => Self::KvRelease,
            0x2C => Self::KvNack,
            0x2D => Self::KvReleaseAck,
            other => return Err(WireError::UnknownMessageType(other)),
        })
    }

    /// True for the key-value aggregation service (0x20–0x3f).
    pub fn is_kv(self) -> bool {
        (self as u8) >= 0x20 && (self as u8) < 0x40
    }

    /// True for the messages that carry a block of values.
    pub fn carries_block(self) -> bool {
        matches!(self, Self::Contribution | Self::Retransmission | Self::Result)
    }
}

/// The checked preamble of a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub version: u8,
    pub msg_type: MessageType,
    /// The datagram ends with an authentication trailer ([`crate::auth`]):
    /// bit 0x80 of the `msg_type` byte.
    pub sealed: bool,
}

impl Preamble {
    /// Validate magic, version and message type of an untrusted datagram.
    pub fn parse(bytes: &[u8]) -> Result<Self, WireError> {
        if bytes.len() < PREAMBLE_LEN {
            return Err(WireError::Truncated { needed: PREAMBLE_LEN, got: bytes.len() });
        }
        let magic = u16::from_be_bytes([bytes[0], bytes[1]]);
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic, expected: MAGIC });
        }
        if bytes[2] != VERSION {
            return Err(WireError::UnsupportedVersion { found: bytes[2], supported: VERSION });
        }
        let sealed = bytes[3] & crate::auth::SEALED != 0;
        Ok(Self { version: bytes[2], msg_type: MessageType::from_u8(bytes[3] & !crate::auth::SEALED)?, sealed })
    }

    /// Write the preamble into the first [`PREAMBLE_LEN`] bytes of `buf`.
    ///
    /// # Panics
    /// If `buf` is shorter than [`PREAMBLE_LEN`]; emitters size buffers from
    /// `buffer_len()` so this never happens for them.
    pub fn emit(msg_type: MessageType, buf: &mut [u8]) {
        buf[0..2].copy_from_slice(&MAGIC.to_be_bytes());
        buf[2] = VERSION;
        buf[3] = msg_type as u8;
    }
}
