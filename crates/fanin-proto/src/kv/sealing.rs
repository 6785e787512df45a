//! Sealed key-value datagrams (docs/security.md, docs/kv.md §2.1): a keyed
//! task's member keys and replay windows on the switch, and the seal of a
//! sender or receiver machine. The trailer, the tag and the replay window
//! are `fanin_wire::auth` and [`crate::auth`], shared with value jobs; this
//! module only decides *whose* key a key-value datagram takes.
//!
//! Members of a task: each sender channel `c` has the member key
//! `derive_member_key(task_key, task_id, c)`; the receiver has the one of
//! [`RECEIVER_MEMBER`] (0xffff, a channel id no sender can use: a task has
//! at most 0xffff channels, numbered from 0). A datagram takes the key of
//! the host it is to or from:
//!
//! * Data, LongData, Fin: the sender's channel (what the switch forwards to
//!   the receiver is resealed under the receiver's key);
//! * Ack, FinAck, Swap, Fetch, Clear, Release (sent by the receiver): the
//!   receiver's (relayed Ack / FinAck are resealed under the channel's);
//! * everything the switch sends: the key of the host it goes to.

use std::collections::HashMap;

use fanin_wire::auth::{self, Key};
use fanin_wire::kv::{Nack, NackReason, Packet, HEADER_LEN};
use fanin_wire::{MessageType, Preamble};

use super::switch::KvCounters;
use crate::auth::{derive_member_key, open_and_accept, push_sealed, LaneWindows, Refusal, Sealer};
use crate::transmit::Transmit;

/// The member id of a task's receiver in the key derivation.
pub const RECEIVER_MEMBER: u16 = 0xffff;

/// The member key of sender channel `channel` of task `task_id`.
pub fn channel_key(task_key: &Key, task_id: u32, channel: u16) -> Key {
    derive_member_key(task_key, task_id, channel)
}

/// The member key of the receiver of task `task_id`.
pub fn receiver_key(task_key: &Key, task_id: u32) -> Key {
    derive_member_key(task_key, task_id, RECEIVER_MEMBER)
}

/// True for the types a sender sends (sealed under its channel's key);
/// every other type a host sends is the receiver's.
fn from_sender(msg_type: Result<MessageType, fanin_wire::WireError>) -> bool {
    matches!(msg_type, Ok(MessageType::KvData | MessageType::KvLongData | MessageType::KvFin))
}

/// Where the switch sends a datagram of a task (whose key seals it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Peer {
    Receiver,
    Channel(u16),
}

impl Peer {
    /// The host that sent `p` (and gets the switch's answer to it).
    pub(super) fn sender_of(p: &fanin_wire::kv::Packet<&[u8]>) -> Self {
        if from_sender(Ok(p.msg_type())) {
            Peer::Channel(p.channel())
        } else {
            Peer::Receiver
        }
    }
}

struct ChannelAuth {
    key: Key,
    windows: LaneWindows,
}

/// A keyed task's authentication state on the switch.
pub(super) struct TaskAuth {
    task_key: Key,
    task_id: u32,
    receiver_key: Key,
    receiver_windows: LaneWindows,
    /// Channels heard from with a valid tag (a forgery creates nothing).
    channels: HashMap<u16, ChannelAuth>,
    /// The next sequence number the switch seals this task's datagrams with
    /// (one counter for all destinations: receivers tolerate gaps).
    next_seq: u64,
}

impl TaskAuth {
    pub(super) fn new(task_key: Key, task_id: u32, first_seq: u64) -> Self {
        Self {
            receiver_key: receiver_key(&task_key, task_id),
            task_key,
            task_id,
            receiver_windows: LaneWindows::default(),
            channels: HashMap::new(),
            next_seq: first_seq,
        }
    }

    /// The sequence number after the last one used (the next task's start).
    pub(super) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Key and sequence number of the next datagram to `to`.
    pub(super) fn seal_for(&mut self, to: Peer) -> (Key, u64) {
        let key = match to {
            Peer::Receiver => self.receiver_key,
            Peer::Channel(c) => match self.channels.get(&c) {
                Some(ch) => ch.key,
                None => channel_key(&self.task_key, self.task_id, c),
            },
        };
        let seq = self.next_seq;
        self.next_seq = auth::next_seq(seq);
        (key, seq)
    }

    /// Verify a datagram of this task under its member's key and pass its
    /// sequence number through that member's replay window. Returns the
    /// datagram without its trailer, or `None` after counting the refusal.
    /// Only the type and the channel are read before the tag verified.
    pub(super) fn admit<'a>(&mut self, bytes: &'a [u8], c: &mut KvCounters) -> Option<&'a [u8]> {
        if !auth::is_sealed(bytes) {
            c.auth_unsealed += 1;
            return None;
        }
        let result = if from_sender(MessageType::from_u8(bytes[3] & !auth::SEALED)) {
            let channel = u16::from_be_bytes([bytes[6], bytes[7]]);
            match self.channels.get_mut(&channel) {
                Some(ch) => open_and_accept(&ch.key, &mut ch.windows, bytes),
                // The receiver's member id is no sender's channel.
                None if channel == RECEIVER_MEMBER => Err(Refusal::NoKey),
                None => {
                    let key = channel_key(&self.task_key, self.task_id, channel);
                    let mut windows = LaneWindows::default();
                    let inner = open_and_accept(&key, &mut windows, bytes);
                    if inner.is_ok() {
                        self.channels.insert(channel, ChannelAuth { key, windows });
                    }
                    inner
                }
            }
        } else {
            open_and_accept(&self.receiver_key, &mut self.receiver_windows, bytes)
        };
        match result {
            Ok(inner) => Some(inner),
            Err(refusal) if refusal.is_replay() => {
                c.auth_replayed += 1;
                None
            }
            Err(_) => {
                c.auth_bad_tag += 1;
                None
            }
        }
    }
}

/// The task id of a key-value datagram that is long enough to name one,
/// read before anything is verified (to find the key).
pub(super) fn task_of(bytes: &[u8]) -> Option<u32> {
    let preamble = Preamble::parse(bytes).ok()?;
    if !preamble.msg_type.is_kv() || bytes.len() < HEADER_LEN {
        return None;
    }
    Some(u32::from_be_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]))
}

/// A sender's or receiver's authentication: its member key seals what it
/// sends, and verifies what the switch sends it (every lane of the switch
/// has its own replay window).
#[derive(Debug, Clone)]
pub struct HostAuth {
    sealer: Sealer,
    windows: LaneWindows,
}

/// Datagrams a keyed sender or receiver refused (never acted on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthStats {
    pub bad_tag: u64,
    pub replayed: u64,
    pub unsealed: u64,
}

impl HostAuth {
    /// `clock_us`: the wall clock in microseconds, where the sequence
    /// numbers start (a restarted host continues above its old ones).
    pub fn new(member_key: Key, clock_us: u64) -> Self {
        Self { sealer: Sealer::new(member_key, 0, clock_us), windows: LaneWindows::default() }
    }

    /// The datagram without its trailer, or `None` (counted in `stats`).
    pub fn open<'a>(&mut self, bytes: &'a [u8], stats: &mut AuthStats) -> Option<&'a [u8]> {
        if !auth::is_sealed(bytes) {
            stats.unsealed += 1;
            return None;
        }
        match open_and_accept(&self.sealer.key, &mut self.windows, bytes) {
            Ok(inner) => Some(inner),
            Err(r) if r.is_replay() => {
                stats.replayed += 1;
                None
            }
            Err(_) => {
                stats.bad_tag += 1;
                None
            }
        }
    }
}

/// Queue a datagram of `len` unsealed bytes written by `fill`, sealed when
/// the host is keyed.
pub(super) fn host_send(auth: Option<&mut HostAuth>, out: &mut impl Transmit<()>, len: usize, fill: impl FnOnce(&mut [u8])) {
    match auth {
        None => push_sealed(out, (), len, None, fill),
        Some(a) => a.sealer.push(out, (), len, fill),
    }
}

/// Queue a copy of an unsealed datagram (see [`host_send`]).
pub(super) fn host_send_copy(auth: Option<&mut HostAuth>, out: &mut impl Transmit<()>, bytes: &[u8]) {
    host_send(auth, out, bytes.len(), |buf| buf.copy_from_slice(bytes));
}

/// An unsealed Nack UnknownTask about `task_id`: the switch's answer for a
/// task it does not hold, which it cannot seal (it has no key for the
/// task). A keyed host can only take it as a hint (a forger could send
/// it): the receiver ends a release on it, a sender's daemon checks with
/// the switch's control API whether the task is really gone.
pub(crate) fn unsealed_unknown_task(bytes: &[u8], task_id: u32) -> bool {
    let Ok(p) = Packet::new_checked(bytes) else { return false };
    !auth::is_sealed(bytes)
        && p.task_id() == task_id
        && p.msg_type() == MessageType::KvNack
        && Nack::parse(p.body()).is_ok_and(|n| n.reason == NackReason::UnknownTask)
}
