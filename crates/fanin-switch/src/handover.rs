//! Datagrams one shard passes to the shard that owns them, bounded.
//!
//! A worker sends each block to the port of the shard that owns it, and a
//! key-value host to its task's shard, so in normal operation nothing is
//! handed over; what is arrives misrouted (a host that does not know the
//! shards, or someone sending on purpose). The shards' command channels are
//! unbounded (control commands are few, and must not be lost), so without a
//! bound a flood of misrouted datagrams at one port would grow the owner's
//! channel without limit, and the owner, which empties its channel before
//! reading its own socket, would spend its time on them while its own
//! queue overflowed.
//!
//! So at most [`HANDOVER_CAP`] datagrams are on their way to each shard at
//! once; the shard that received one more drops it and counts it
//! (`fanin_switch_handover_dropped_total`), as a full socket queue would
//! drop it. A dropped datagram is an ordinary loss: its sender resends it.
//! The owner takes at most that many from its channel between two reads of
//! its socket. Handovers stay in the one command channel, so what a shard
//! tells its peers (a round started) still reaches them before the
//! datagrams it handed over after it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;

use crate::shard::{Command, ShardStats};

/// Datagrams on their way to one shard at most (up to ~9 KB each: a
/// shard's channel holds at most ~9 MB of them).
pub(crate) const HANDOVER_CAP: usize = 1024;

/// How many handed-over datagrams each shard has yet to take.
#[derive(Debug)]
pub(crate) struct HandoverGate {
    pending: Vec<AtomicUsize>,
}

impl HandoverGate {
    pub fn new(shards: u16) -> Self {
        Self { pending: (0..shards.max(1)).map(|_| AtomicUsize::new(0)).collect() }
    }

    /// Room for one more datagram to `owner`; false when it already has
    /// [`HANDOVER_CAP`] waiting.
    fn admit(&self, owner: u16) -> bool {
        let Some(pending) = self.pending.get(owner as usize) else { return false };
        if pending.fetch_add(1, Ordering::AcqRel) >= HANDOVER_CAP {
            pending.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// `owner` took one of its datagrams from its channel.
    pub fn taken(&self, owner: u16) {
        if let Some(pending) = self.pending.get(owner as usize) {
            // (never below zero: only what `admit` let through is taken)
            let _ = pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    #[cfg(test)]
    fn pending(&self, owner: u16) -> usize {
        self.pending[owner as usize].load(Ordering::Acquire)
    }
}

/// Pass a datagram (and whether it arrived CE-marked) to the shard `owner`,
/// or drop it and count it when that shard has [`HANDOVER_CAP`] waiting.
pub(crate) fn hand_over(
    peers: &[Sender<Command>],
    gate: &HandoverGate,
    stats: &ShardStats,
    owner: u16,
    from: SocketAddr,
    bytes: &[u8],
    ce: bool,
) {
    let Some(peer) = peers.get(owner as usize) else { return };
    if !gate.admit(owner) {
        stats.handover_dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if peer.send(Command::Handover(from, bytes.to_vec(), ce)).is_err() {
        // (the owner is gone: the daemon is stopping)
        gate.taken(owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_flood_of_misrouted_datagrams_is_bounded_per_owner_and_counted() {
        let (tx0, _rx0) = mpsc::channel::<Command>();
        let (tx1, rx1) = mpsc::channel::<Command>();
        let peers = vec![tx0, tx1];
        let gate = HandoverGate::new(2);
        let stats = ShardStats::default();
        let from: SocketAddr = "10.0.0.9:4000".parse().unwrap();
        let flood = HANDOVER_CAP + 500;
        for i in 0..flood {
            hand_over(&peers, &gate, &stats, 1, from, &(i as u32).to_be_bytes(), false);
        }
        let queued: Vec<Command> = rx1.try_iter().collect();
        assert_eq!(queued.len(), HANDOVER_CAP, "the owner's channel holds at most the cap");
        assert_eq!(stats.handover_dropped.load(Ordering::Relaxed), 500);
        // the first ones went through, in order
        match &queued[0] {
            Command::Handover(f, bytes, false) => assert_eq!((*f, bytes.as_slice()), (from, &0u32.to_be_bytes()[..])),
            _ => panic!("not a handover"),
        }
        // as the owner takes them, room comes back
        for _ in &queued[..10] {
            gate.taken(1);
        }
        assert_eq!(gate.pending(1), HANDOVER_CAP - 10);
        for _ in 0..20 {
            hand_over(&peers, &gate, &stats, 1, from, b"x", true);
        }
        assert_eq!(rx1.try_iter().count(), 10);
        assert_eq!(stats.handover_dropped.load(Ordering::Relaxed), 510);
        // another owner has its own room
        hand_over(&peers, &gate, &stats, 0, from, b"y", false);
        assert_eq!(gate.pending(0), 1);
    }

    #[test]
    fn a_handover_to_a_stopped_shard_or_an_unknown_one_holds_no_room() {
        let (tx0, rx0) = mpsc::channel::<Command>();
        drop(rx0);
        let peers = vec![tx0];
        let gate = HandoverGate::new(1);
        let stats = ShardStats::default();
        let from: SocketAddr = "10.0.0.9:4000".parse().unwrap();
        for _ in 0..HANDOVER_CAP + 1 {
            hand_over(&peers, &gate, &stats, 0, from, b"x", false);
        }
        assert_eq!(gate.pending(0), 0);
        assert_eq!(stats.handover_dropped.load(Ordering::Relaxed), 0);
        hand_over(&peers, &gate, &stats, 7, from, b"x", false);
        gate.taken(7);
        gate.taken(0);
        assert_eq!(gate.pending(0), 0, "never below zero");
    }
}
