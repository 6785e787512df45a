//! GOAT's on-path filtering (Wang et al., "GOAT", ICNP'24, §III-B and §V;
//! docs/goat.md, "On-path filtering"): every switch on a worker's path
//! toward the parameter server sees each sub-model's fragments and
//! aggregates only those it is responsible for, forwarding the rest.
//!
//! fanin's daemons see only what is addressed to them, so a switch on the
//! path is a hop at the transport level. A worker sends every sub-model (a
//! job) to its first-hop switch. A *transit* entry for job `g` on a switch
//! relays `g`'s datagrams toward the switch that aggregates them (the next
//! hop, another transit or the aggregation node itself) unchanged, and
//! relays what comes back down to the sources behind it:
//!
//! * **Up** (contributions, retransmissions, joins, result acknowledgements,
//!   sync requests) from a source that is not a member of this switch's own
//!   job `g`: forwarded unchanged to this shard's next hop. The source's
//!   address is learned as a job learns its members'. No header field names
//!   the aggregation node: the plan gives each (worker, sub-model) one node,
//!   so this switch's filter *is* its job's member list.
//! * **Down** (from the next hop): a result or membership notice goes once
//!   to every distinct address behind this switch (a relay further down
//!   gets one copy for all its sources); a join answer or refusal, whose
//!   `src_id` names the source it answers, goes to that source alone.
//!
//! The aggregation node sends once per distinct address
//! ([`super::aggregate::send_to_members`]), so a relay gets one copy of each
//! result. A result the relay already fanned out (same block, same header)
//! is dropped, so copies sent per member still reach each host once; an
//! upward datagram of that block clears the entry, so the answer to a
//! straggler's retransmission passes. Dropping a copy too many is never
//! wrong: a host that misses a result retransmits, and that resend clears
//! the entry.
//!
//! A transit may name the sources whose path passes it (the plan's
//! workers behind it): then no other source's datagram is relayed, so a
//! forged source id cannot add an address to the fan-out.
//!
//! Shard `k` of a relay forwards to shard `k` of its next hop: a worker
//! picks the shard from the aggregation node's JoinAck (relayed unchanged),
//! so every switch on the path runs the same number of shards
//! ([`AdmitError::BadTransit`]). A keyed job's results are sealed per
//! member, so they cannot be fanned out by a relay that holds no key: a
//! sealed datagram of a job this switch does not aggregate is refused
//! (`transit_refused`), and the GOAT deployment refuses keyed jobs with
//! transit hops. What a relay fans out must be the same for every host
//! behind it: an allreduce's results are. (Owner-only results, different
//! per member, would reach hosts that ignore the copies meant for others:
//! bandwidth, not a wrong sum; a forward-mode job's reflections would not
//! be right for another host, so transits are for aggregating jobs.)
//! Relays carry no hop count (they change no byte, and a keyed job's bytes
//! are sealed): the controller builds them along the tree toward the PS,
//! which has no cycle. Transits installed by hand in a cycle are caught
//! where a datagram comes around: a relay that gets the very upward
//! datagram it last relayed for a source (same header) from an address
//! other than that source's drops it (`transit_loops`) and forgets it, so
//! the loop is cut after one turn, while a source that moved passes with
//! its next datagram. (Down, results already go once per block: a looped
//! result is a `transit_duplicate`.)

use super::*;

/// Results remembered per transit, direct-mapped by block id: enough for
/// the windows in flight (a host's window is at most a few hundred blocks).
const FANNED: usize = 1024;

/// Most sources one transit relays for: a job's most members.
pub const MAX_TRANSIT_SOURCES: usize = 4096;

/// One sub-model relayed by this shard.
#[derive(Debug)]
pub(super) struct Transit<A> {
    /// This shard's hop toward the aggregation node (that switch's shard of
    /// the same index).
    next: A,
    /// The source ids whose path passes this switch (the plan's workers
    /// behind it), or any (None). Anyone else's upward datagram is refused:
    /// a relay never learns an address it was not told to expect, so a
    /// forged source cannot add itself to the fan-out.
    allowed: Option<SourceMask>,
    /// Source id to the address it last sent from.
    sources: BTreeMap<u16, A>,
    /// The distinct addresses of `sources` with how many sources use each,
    /// in first-seen order: sources behind one relay share its address and
    /// get one copy.
    distinct: Vec<(A, u32)>,
    /// `(block, header digest)` of the last result fanned out, by `block % FANNED`.
    fanned: Vec<Option<(u32, u64)>>,
    /// The upward datagrams relayed lately, direct-mapped by (source,
    /// block): `(source, block, digest, the address it came from)`, to know
    /// one that comes back around a cycle of relays, every block in flight
    /// apart.
    recent_up: Vec<Option<(u16, u32, u64, A)>>,
}

/// Entries of a transit's table of recent upward datagrams: more than the
/// blocks a few sources keep in flight.
const RECENT_UP: usize = 4096;

impl<A: Copy + PartialEq> Transit<A> {
    fn new(next: A, allowed: Option<SourceMask>) -> Self {
        Self {
            next,
            allowed,
            sources: BTreeMap::new(),
            distinct: Vec::new(),
            fanned: vec![None; FANNED],
            recent_up: vec![None; RECENT_UP],
        }
    }

    fn allows(&self, src: u16) -> bool {
        self.allowed.as_ref().map_or(true, |a| a.contains(src as usize))
    }

    /// Forget a source (no longer allowed after a re-install).
    fn forget_source(&mut self, src: u16) {
        if let Some(old) = self.sources.remove(&src) {
            if let Some(i) = self.distinct.iter().position(|&(a, _)| a == old) {
                self.distinct[i].1 -= 1;
                if self.distinct[i].1 == 0 {
                    self.distinct.remove(i);
                }
            }
        }
    }

    /// Learn that `src` sends from `from`; false if the table is full. A
    /// new or moved source costs a pass over the distinct addresses.
    fn learn(&mut self, src: u16, from: A) -> bool {
        match self.sources.get(&src) {
            Some(&known) if known == from => return true,
            None if self.sources.len() >= MAX_TRANSIT_SOURCES => return false,
            Some(_) => self.forget_source(src),
            None => {}
        }
        self.sources.insert(src, from);
        match self.distinct.iter_mut().find(|(a, _)| *a == from) {
            Some((_, n)) => *n += 1,
            None => self.distinct.push((from, 1)),
        }
        true
    }

    fn addresses(&self) -> impl Iterator<Item = A> + '_ {
        self.distinct.iter().map(|&(a, _)| a)
    }

    /// Whether this result (block, header digest) goes down: false for a
    /// copy of the one fanned out last for its block.
    fn first_copy(&mut self, block: u32, digest: u64) -> bool {
        let entry = &mut self.fanned[block as usize % FANNED];
        if *entry == Some((block, digest)) {
            return false;
        }
        *entry = Some((block, digest));
        true
    }

    /// A source asked for `block` again: its answer must pass.
    fn forget(&mut self, block: u32) {
        let entry = &mut self.fanned[block as usize % FANNED];
        if entry.is_some_and(|(b, _)| b == block) {
            *entry = None;
        }
    }
}

/// FNV-1a over a result's header: the block, its round and generation,
/// the sources it sums and its flags. Copies of one result agree on it.
fn header_digest(bytes: &[u8]) -> u64 {
    bytes[..HEADER_LEN.min(bytes.len())]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl<A: Copy + PartialEq> ValueSwitch<A> {
    /// Relay `job_id` for sources that are not members of this switch's own
    /// job of that id (if any): up to `next[this shard]`, and back down.
    /// `next` holds the next hop's address of every shard, one per shard of
    /// this switch; `sources` the source ids whose path passes this switch
    /// (empty: any). Installing again changes the next hop and the sources,
    /// and keeps the addresses learnt of sources still allowed.
    pub fn add_transit(&mut self, job_id: u32, next: Vec<A>, sources: &[u16]) -> Result<(), AdmitError> {
        let shards = self.config.shard_count;
        if next.len() != shards as usize {
            return Err(AdmitError::BadTransit { job_id, hops: next.len(), shards });
        }
        let hop = next[self.config.shard as usize];
        let allowed = (!sources.is_empty()).then(|| {
            let mut mask = SourceMask::with_capacity(sources.iter().map(|&s| s as usize + 1).max().unwrap_or(0));
            for &s in sources {
                mask.insert(s as usize);
            }
            mask
        });
        match self.transits.get_mut(&job_id) {
            Some(transit) => {
                transit.next = hop;
                transit.allowed = allowed;
                let gone: Vec<u16> = transit.sources.keys().copied().filter(|&s| !transit.allows(s)).collect();
                for s in gone {
                    transit.forget_source(s);
                }
            }
            None => {
                self.transits.insert(job_id, Transit::new(hop, allowed));
            }
        }
        Ok(())
    }

    /// Stop relaying `job_id`; false if it was not relayed.
    pub fn remove_transit(&mut self, job_id: u32) -> bool {
        self.transits.remove(&job_id).is_some()
    }

    /// The jobs this shard relays.
    pub fn transit_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.transits.keys().copied()
    }

    /// The sources this shard relayed `job_id` for, with their addresses.
    pub fn transit_sources(&self, job_id: u32) -> Vec<(u16, A)> {
        self.transits.get(&job_id).map_or_else(Vec::new, |t| t.sources.iter().map(|(&s, &a)| (s, a)).collect())
    }

    /// The transit's part in a datagram: `Some` when it relayed (or
    /// refused) it, `None` when this switch handles it as usual (its own
    /// job's member, or no transit for the job). Runs before a tag is
    /// checked: a relay holds no key and changes no byte.
    ///
    /// A datagram that arrived CE-marked leaves marked (`set_relaying_ce`):
    /// the queue that marked it was on the path to the switch that acts on
    /// it, past this relay.
    pub(super) fn relay(&mut self, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Option<Verdict> {
        if !self.rx_ce {
            return self.relay_as_is(from, bytes, out);
        }
        out.set_relaying_ce(true);
        let verdict = self.relay_as_is(from, bytes, out);
        out.set_relaying_ce(false);
        verdict
    }

    fn relay_as_is(&mut self, from: A, bytes: &[u8], out: &mut impl Transmit<A>) -> Option<Verdict> {
        let job_id = u32::from_be_bytes(bytes.get(12..16)?.try_into().ok()?);
        let transit = self.transits.get_mut(&job_id)?;
        let job = self.jobs.get(&job_id);
        let counters = &mut self.counters;
        // What this switch would handle itself goes the usual way.
        let own = |counters: &mut Counters| {
            if job.is_some() {
                None
            } else {
                counters.transit_refused += 1;
                Some(Verdict::Consumed)
            }
        };
        if fanin_wire::auth::is_sealed(bytes) {
            return own(counters);
        }
        // a whole datagram, or the header of one trimmed on the way;
        // anything else is malformed and counted as such the usual way
        let packet = Packet::new_checked(bytes).ok().or_else(|| Packet::trimmed_header(bytes))?;
        let msg = MessageType::from_u8(packet.msg_type_code()).ok()?;
        let src = packet.src_id();
        if from == transit.next {
            let ours = job.is_some_and(|j| j.uplink.as_ref().is_some_and(|u| u.parent.contains(&from)));
            match msg {
                MessageType::Result | MessageType::Membership => {
                    if msg == MessageType::Membership || transit.first_copy(packet.block_id(), header_digest(bytes)) {
                        counters.transit_down += out.push_fanout(transit.addresses(), bytes) as u64;
                    } else {
                        counters.transit_duplicate += 1;
                    }
                    // the same switch may also be this switch's parent for
                    // its own job of this id: that job relays it too
                    if ours {
                        None
                    } else {
                        Some(Verdict::Consumed)
                    }
                }
                // a member of this switch's own job (one a plan change moved
                // here) is answered through the job, not the transit
                MessageType::JoinAck | MessageType::Nack if job.is_some_and(|j| j.members.contains(src as usize)) => None,
                MessageType::JoinAck | MessageType::Nack => match transit.sources.get(&src) {
                    Some(&dest) => {
                        out.push_copy(dest, bytes);
                        counters.transit_down += 1;
                        Some(Verdict::Consumed)
                    }
                    // A refusal that names no source behind us: a tree node
                    // below the PS passes its parent's on with its own rank,
                    // to every member it has, so every host behind us gets
                    // it. (From our own parent it is our tree job's.)
                    None if msg == MessageType::Nack && !ours => {
                        counters.transit_down += out.push_fanout(transit.addresses(), bytes) as u64;
                        Some(Verdict::Consumed)
                    }
                    None => own(counters),
                },
                _ => own(counters),
            }
        } else {
            if job.is_some_and(|j| j.members.contains(src as usize)) {
                return None; // aggregated here
            }
            let up = matches!(
                msg,
                MessageType::Contribution
                    | MessageType::Retransmission
                    | MessageType::Join
                    | MessageType::ResultAck
                    | MessageType::Sync
            );
            if !up || !transit.allows(src) {
                return own(counters);
            }
            // a datagram we relayed, back from another address: it went
            // around a cycle of relays
            let (block, digest) = (packet.block_id(), header_digest(bytes) ^ bytes.len() as u64);
            let at = (src as usize).wrapping_mul(0x9E37) ^ block as usize;
            let entry = &mut transit.recent_up[at % RECENT_UP];
            if entry.is_some_and(|(s, b, d, came)| (s, b, d) == (src, block, digest) && came != from) {
                *entry = None;
                counters.transit_loops += 1;
                return Some(Verdict::Consumed);
            }
            *entry = Some((src, block, digest, from));
            if !transit.learn(src, from) {
                return own(counters);
            }
            if msg.carries_block() {
                transit.forget(packet.block_id());
            }
            out.push_copy(transit.next, bytes);
            counters.transit_up += 1;
            Some(Verdict::Consumed)
        }
    }
}
