//! Asynchronous key-value aggregation (ASK, ASPLOS 2023, §3) as sans-IO
//! machines.
//!
//! * [`KvSwitch`]: the switch program. Memory is organised as aggregator
//!   arrays (AA), one per tuple slot of a packet, allocated per task by the
//!   control plane ([`KvSwitch::add_task`]); per-channel receive windows
//!   with the compact `seen` array, `max_seq` and `PktState` (§3.3); shadow
//!   copies with a copy indicator (§3.4, Algorithm 1).
//! * [`KvSender`]: sender-assisted key-space partition, coalesced medium
//!   keys, long-key bypass (§3.2), sliding window with a fine timeout and
//!   FIN (§3.3); on a rate-limited network its window and timeout adapt
//!   ([`KvCongestion`], docs/kv.md "Congestion").
//! * [`TaskLedger`]: a task's life cycle at the receiver's daemon (joined,
//!   finished and failed sender channels, silence), which the host daemon
//!   drives from its control channel.
//! * [`KvReceiver`]: deduplication, local aggregation of what the switch
//!   could not absorb, swap / fetch / clear of shadow copies, and the final
//!   fetch and merge.
//!
//! Topology as ASK has it: senders and the receiver talk only to the switch.
//! The switch forwards data, FIN and long-key packets to the task's receiver
//! and forwards the receiver's ACKs and FIN-ACKs to the channel's sender, so a
//! host machine has exactly one peer and its `Transmit` destination is `()`.
//!
//! A task may be keyed (docs/security.md): then every datagram is sealed
//! under the member key of the sender channel or the receiver it is from or
//! to ([`channel_key`], [`receiver_key`]), and each machine drops what does
//! not verify before it touches any state.
//!
//! `docs/kv.md` describes the formats and the machines' semantics.

mod aggregators;
mod congestion;
mod layout;
pub mod loopback;
mod receiver;
mod sealing;
mod sender;
mod switch;
mod task;
mod value;
mod window;

/// The hash maps on the per-datagram and per-tuple paths (tasks, channels,
/// a receiver's results): foldhash instead of std's SipHash, which perf put
/// at several percent of the switch and receiver threads for keys of a few
/// bytes. Seeded per process, so an outsider cannot precompute colliding
/// keys; the keys of a task's results come from that task's own senders.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A receiver's results: key bytes to their aggregate.
pub type KvResults = FastMap<Vec<u8>, Aggregate>;

pub use congestion::{KvCongestion, KvCongestionStats, DEFAULT_MIN_RTO, HOST_MIN_RTO, INITIAL_CWND, MIN_CWND};
pub use layout::{aggregator_index, decode_parts, encode_parts, hash_index, hash_partition, receiver_partition, KeyClass, Layout, LayoutError};
pub use receiver::{Aggregate, KvReceiver, ReceiverConfig, ReceiverError, ReceiverEvent, ReceiverStats};
pub use sealing::{channel_key, receiver_key, AuthStats, HostAuth, RECEIVER_MEMBER};
pub use sender::{KvSender, SenderConfig, SenderError, SenderEvent, SenderProgress, SenderStats, MAX_KEY_LEN};
pub use switch::{KvAdmitError, KvCounters, KvSwitch, KvSwitchConfig, KvTaskSpec, TaskStats};
pub use task::{
    check_senders, progress_interval, ChannelReport, ChannelState, JoinRefused, LinkState, ProgressRefused, ProgressReport, SenderLink,
    TaskLedger, MAX_SENDERS,
};
pub use value::{as_float, float_bits, ValueType};
pub use window::{Observation, SeenWindow};

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
