//! Authenticated membership on the switch (docs/security.md): a keyed
//! job's member keys and replay windows, the check every datagram passes
//! before the program sees it, and the envelope of every datagram it sends.

use fanin_wire::auth::{self, Key};
use fanin_wire::value::{WrappedResultKey, HEADER_LEN};
use fanin_wire::MessageType;

use super::Counters;
use crate::auth::{derive_member_key, push_sealed, LaneWindows, Refusal, Replay};
use crate::transmit::Transmit;

/// A keyed job's authentication state on one shard.
#[derive(Debug)]
pub(super) struct JobAuth {
    job_key: Key,
    job_id: u32,
    /// Member keys by source id (none for ids that are not members).
    keys: Vec<Option<Key>>,
    /// Replay windows by source id.
    windows: Vec<LaneWindows>,
    /// This switch's key at its parent (a tree child), and the parent's lanes.
    uplink_key: Option<Key>,
    parent_windows: LaneWindows,
    /// The next sequence number this shard seals with (one counter for all
    /// of the job's destinations: receivers tolerate gaps).
    next_seq: u64,
    /// The job's result key on this switch for a job with a result group:
    /// a result sent to the group is sealed once under it (on the group
    /// lanes of the same counter) instead of once per member.
    result_key: Option<ResultKey>,
}

/// The result key of the current epoch, and what it is derived from.
#[derive(Debug, Clone, Copy)]
struct ResultKey {
    key: Key,
    incarnation: u32,
    /// Starts at 0 and goes up by one whenever a member leaves. Every shard
    /// applies the same job updates in the same order, so all shards of a
    /// switch agree on it (a shard a little behind seals with the old key
    /// for that while: its listeners fetch those results by retransmission).
    epoch: u32,
}

impl ResultKey {
    fn new(job_key: &Key, job_id: u32, incarnation: u32, epoch: u32) -> Self {
        Self { key: auth::derive_result_key(job_key, job_id, incarnation, epoch), incarnation, epoch }
    }
}

impl JobAuth {
    /// `group`: the job has a result group, and this switch's incarnation
    /// (what its result key is bound to) and the job's first key epoch.
    pub(super) fn new(job_key: Key, job_id: u32, members: &[u16], first_seq: u64, group: Option<(u32, u32)>) -> Self {
        let mut auth = Self {
            result_key: group.map(|(inc, epoch)| ResultKey::new(&job_key, job_id, inc, epoch)),
            job_key,
            job_id,
            keys: Vec::new(),
            windows: Vec::new(),
            uplink_key: None,
            parent_windows: LaneWindows::default(),
            next_seq: first_seq,
        };
        let _ = auth.set_members(members);
        auth
    }

    /// Derive the keys of the current members; a member that left loses its
    /// key (its datagrams no longer verify), and keeps its window so its old
    /// datagrams stay replays if it comes back. A member leaving also starts
    /// a new result-key epoch: it held the result key, and must not check
    /// or forge the group results sealed from now on. The members that stay
    /// learn the new key from the JoinAck of the probe they send when a
    /// group result fails under the old one (docs/security.md), and from
    /// the key update the switch sends them; returns true when the epoch
    /// moved on.
    pub(super) fn set_members(&mut self, members: &[u16]) -> bool {
        let width = members.iter().map(|&m| m as usize + 1).max().unwrap_or(0).max(self.keys.len());
        let mut staying = vec![false; width];
        for &m in members {
            staying[m as usize] = true;
        }
        let someone_left = self.keys.iter().zip(&staying).any(|(key, &stays)| key.is_some() && !stays);
        let rotated = someone_left && self.result_key.is_some();
        if let Some(rk) = self.result_key.as_mut().filter(|_| someone_left) {
            *rk = ResultKey::new(&self.job_key, self.job_id, rk.incarnation, rk.epoch.wrapping_add(1));
        }
        self.keys.clear();
        self.keys.resize(width, None);
        self.windows.resize_with(width, LaneWindows::default);
        for &m in members {
            self.keys[m as usize] = Some(derive_member_key(&self.job_key, self.job_id, m));
        }
        rotated
    }

    /// The job restarted below a restarted parent under a new incarnation
    /// (parent_restart.rs): its result key is bound to the incarnation the
    /// JoinAcks announce, so it is derived afresh (same epoch), and members
    /// learn it from their recovery's JoinAck.
    pub(super) fn rebind_incarnation(&mut self, incarnation: u32) {
        if let Some(rk) = self.result_key.as_mut() {
            *rk = ResultKey::new(&self.job_key, self.job_id, incarnation, rk.epoch);
        }
    }

    /// Heap bytes of the member keys and replay windows (switch memory
    /// accounting).
    pub(super) fn heap_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<Option<Key>>()
            + self.windows.capacity() * std::mem::size_of::<LaneWindows>()
            + self.windows.iter().chain([&self.parent_windows]).map(LaneWindows::heap_bytes).sum::<usize>()
    }

    /// A tree child is the member `rank` of its parent.
    pub(super) fn set_uplink_rank(&mut self, rank: Option<u16>) {
        self.uplink_key = rank.map(|r| derive_member_key(&self.job_key, self.job_id, r));
    }

    /// The sequence number after the last one used (for the next job's start).
    pub(super) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The key epoch after the current one (for the next job's start).
    pub(super) fn next_result_epoch(&self) -> u32 {
        self.result_key.map_or(0, |rk| rk.epoch.wrapping_add(1))
    }

    /// The result key as the JoinAck to `member` carries it (wrapped under
    /// the member's key), for a job with a result group.
    pub(super) fn wrapped_result_key(&self, member: usize) -> Option<WrappedResultKey> {
        let member_key = self.keys.get(member).copied().flatten()?;
        let rk = self.result_key.as_ref()?;
        let wrapped = auth::wrap_result_key(&member_key, self.job_id, rk.incarnation, rk.epoch, &rk.key);
        Some(WrappedResultKey { epoch: rk.epoch, wrapped })
    }

    /// The key and number to seal a result sent once to the job's result
    /// group with: the result key, on the group lanes; `None` if the job
    /// has no group.
    pub(super) fn group_seal(&mut self) -> Option<(Key, u64)> {
        let key = self.result_key?.key;
        Some((key, auth::group_seq(self.take_seq())))
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq = auth::next_seq(seq);
        seq
    }
}

/// Who a datagram of a job goes to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Peer {
    Member(usize),
    Parent,
}

/// How one datagram goes out.
#[derive(Debug, Clone, Copy)]
pub(super) enum Envelope {
    Plain,
    Sealed(Key, u64),
    /// A keyed job has no key for the destination: send nothing.
    Withhold,
}

/// The envelope of the next datagram of a job (`None`: unkeyed) to `to`.
pub(super) fn envelope(auth: Option<&mut JobAuth>, to: Peer) -> Envelope {
    let Some(auth) = auth else { return Envelope::Plain };
    let key = match to {
        Peer::Member(m) => auth.keys.get(m).copied().flatten(),
        Peer::Parent => auth.uplink_key,
    };
    match key {
        Some(key) => Envelope::Sealed(key, auth.take_seq()),
        None => Envelope::Withhold,
    }
}

/// Queue a datagram of `len` unsealed bytes written by `fill`. Returns
/// false if the envelope withheld it.
pub(super) fn send<A>(out: &mut impl Transmit<A>, dest: A, len: usize, env: Envelope, fill: impl FnOnce(&mut [u8])) -> bool {
    match env {
        Envelope::Plain => push_sealed(out, dest, len, None, fill),
        Envelope::Sealed(key, seq) => push_sealed(out, dest, len, Some((&key, seq)), fill),
        Envelope::Withhold => return false,
    }
    true
}

/// Queue a copy of `bytes` (an unsealed datagram) in `env`.
pub(super) fn send_copy<A>(out: &mut impl Transmit<A>, dest: A, bytes: &[u8], env: Envelope) -> bool {
    send(out, dest, bytes.len(), env, |buf| buf.copy_from_slice(bytes))
}

/// The check before the program: for a keyed job, verify the tag with the
/// sender's key (a source's, or the parent's for what only a parent
/// sends) and pass the sequence number through its replay window. Returns
/// the datagram without its trailer, or `None` when it was counted and
/// must be dropped. Datagrams too short to name a job are returned as they
/// are, for the parser to count.
pub(super) fn admit<'a>(
    auth: Option<&mut JobAuth>,
    job_known: bool,
    bytes: &'a [u8],
    counters: &mut Counters,
) -> Option<&'a [u8]> {
    let sealed = auth::is_sealed(bytes);
    let Some(auth) = auth else {
        if sealed && !job_known {
            // Unverifiable, but harmless: the program counts the unknown job.
            return Some(auth::Sealed::split(bytes).map_or(bytes, |s| s.inner));
        }
        if sealed {
            // Nothing to verify it with: a member configured with a key
            // the switch does not have, or a forgery.
            counters.auth_bad_tag += 1;
            return None;
        }
        return Some(bytes);
    };
    if bytes.len() < HEADER_LEN {
        return Some(bytes);
    }
    if !sealed {
        counters.auth_unsealed += 1;
        return None;
    }
    let from_parent = matches!(
        MessageType::from_u8(bytes[3] & !auth::SEALED),
        Ok(MessageType::Result | MessageType::Nack | MessageType::Membership | MessageType::JoinAck)
    );
    let (key, window) = if from_parent {
        (auth.uplink_key, &mut auth.parent_windows)
    } else {
        let src = u16::from_be_bytes([bytes[6], bytes[7]]) as usize;
        (auth.keys.get(src).copied().flatten(), auth.windows.get_mut(src).unwrap_or(&mut auth.parent_windows))
    };
    let result = match key {
        Some(key) => crate::auth::open_and_accept(&key, window, bytes),
        None => Err(Refusal::NoKey),
    };
    match result {
        Ok(inner) => Some(inner),
        Err(Refusal::Replay(Replay::Duplicate | Replay::TooOld | Replay::BadLane)) => {
            counters.auth_replayed += 1;
            None
        }
        Err(Refusal::Auth(_) | Refusal::NoKey) => {
            counters.auth_bad_tag += 1;
            None
        }
    }
}
