//! Per-reason packet counters of a switch shard. Every datagram the switch
//! does not accept is counted under exactly one reason.

use fanin_wire::WireError;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Datagrams handed to the program.
    pub rx_datagrams: u64,
    /// Contributions (data or exponent) added to a block.
    pub accepted: u64,
    /// Contributions already counted in their block (retransmissions and
    /// network duplicates); never added twice.
    pub duplicate: u64,
    /// `Retransmission` messages received (also counted under their outcome).
    pub retransmissions: u64,
    /// Blocks (phases) this switch marked congested in their result
    /// (`AGE_OP_CONGESTED`, docs/congestion.md): a retransmission filled a
    /// hole while other members' contributions had arrived (a loss on a
    /// member's path), a contribution came CE-marked or echoing a CE mark,
    /// or a child switch's partial carried its subtree's mark.
    pub congestion_marked: u64,
    /// Datagrams that arrived with ECN Congestion Experienced in their IP
    /// header (a queue on the way marked them). A contribution so marked
    /// marks its block's result, as a repaired loss does.
    pub ecn_ce: u64,
    /// Contributions that arrived carrying a worker's echo of a CE mark on
    /// a result's way down; the block's result is marked. (A child switch's
    /// echo of its parent's marks travels as its partial's subtree mark.)
    pub ecn_echoed: u64,
    /// Datagrams the daemon's own receive queue marked (deeper than
    /// `[trim] mark_watermark`; also counted in `ecn_ce`): contributions,
    /// and results from a parent, which a child switch then echoes up.
    pub queue_marked: u64,
    /// Datagrams that failed to parse, by [`WireError::kind`].
    pub malformed: [u64; WireError::KINDS.len()],
    pub unknown_job: u64,
    pub non_member: u64,
    /// grad_cnt above the job's `block_grad_max`.
    pub over_cap: u64,
    /// A new block needs a slot whose current block is still aggregating
    /// (the sender's window exceeds `block_cnt_max`).
    pub slot_busy: u64,
    /// A new block found the shard's pooled memory taken (other jobs' block
    /// records, `MemoryModel::Pooled`): answered with the same back-pressure
    /// trim nack as `slot_busy`; the sender retries.
    pub memory_exhausted: u64,
    /// A new block took the record of its slot's previous block once every
    /// active member had moved past it (pooled memory under pressure).
    pub records_recycled: u64,
    /// `ResultAck`s received: a member said which results it holds, in
    /// answer to a `memory_exhausted` refusal.
    pub result_acks: u64,
    /// Done blocks whose buffers went back to the pool because every
    /// member acknowledged their results.
    pub records_acked: u64,
    /// Blocks still aggregating whose records a lower block of the same
    /// job took (memory short); their contributors were asked to resend.
    pub records_evicted: u64,
    /// Block beyond the job's window.
    pub out_of_window: u64,
    /// Contribution for a block whose result the switch no longer holds (a
    /// straggler behind the job); answered with a `BlockExpired` nack.
    pub expired: u64,
    /// dtype, grad_cnt or exponent inconsistent with the block.
    pub mismatch: u64,
    /// Messages a switch never accepts in that state (data before the
    /// exponent was negotiated, result or ack messages sent to the switch).
    pub protocol_violation: u64,
    /// Contribution to an already emitted block from a source not in it.
    pub late: u64,
    /// Datagram for a block another shard owns (handed over by the runtime).
    pub wrong_shard: u64,
    pub blocks_completed: u64,
    /// Completed blocks whose result summed fewer sources than the job has.
    pub blocks_degraded: u64,
    /// Blocks (exponent rounds included) the scanners aged out.
    pub blocks_aged: u64,
    /// Scanner ticks run (each visits one slice of one job's slots).
    pub scans: u64,
    /// Sources declared permanently slow / re-admitted.
    pub declared_slow: u64,
    pub readmitted: u64,
    /// Membership notices sent (one per member per status change).
    pub notices_sent: u64,
    /// Result datagrams sent to members' own addresses when a block
    /// completed (one per member not listening on the job's result group).
    pub results_sent: u64,
    /// Result datagrams sent once to a job's result group (multicast), for
    /// every member listening there.
    pub results_to_group: u64,
    /// Results sent again in answer to a retransmission.
    pub results_resent: u64,
    /// Owner-only results (reduce-scatter): header-only results without the
    /// sum, sent instead of a result to members whose data contribution
    /// said `no_data` (counted in `results_sent` / `results_resent` too).
    pub results_without_data: u64,
    pub joins: u64,
    pub nacks_sent: u64,
    /// NoAggr jobs: contributions returned to their sender unaggregated.
    pub forwarded: u64,
    /// Aggregation trees: partial results (data or exponent) sent to the parent.
    pub sent_up: u64,
    /// Cached partial results sent to the parent again, because a child
    /// retransmitted while the parent's answer was outstanding.
    pub resent_up: u64,
    /// Results (and notices, join answers) received from the parent.
    pub from_parent: u64,
    /// Results relayed from the parent to the children (one per child).
    pub relayed_down: u64,
    /// Parent datagrams for blocks this switch no longer holds, or refusals
    /// from the parent (dropped: the children's retransmissions retry).
    pub parent_stale: u64,
    /// Trimmed nacks from the parent for overload (its queue or its rate
    /// limit): each marks the next partial up congested, so the root slows
    /// the whole job.
    pub parent_trimmed: u64,
    /// GOAT on-path filtering (docs/goat.md): datagrams of a sub-model this
    /// switch does not aggregate for their sender, relayed unchanged toward
    /// the switch that does.
    pub transit_up: u64,
    /// Datagrams from that switch relayed down: one per distinct address
    /// behind this one (a result or notice), or to the one source it names
    /// (a join answer, a refusal).
    pub transit_down: u64,
    /// Results relayed down once already (same block, same bytes) and not
    /// again: a copy the aggregating switch sent per member behind us.
    pub transit_duplicate: u64,
    /// Transit datagrams dropped: sealed (a keyed job's per-member seals
    /// cannot be fanned out), a source beyond the table, a message that
    /// never travels that way, or a join answer or refusal for a source
    /// this shard never relayed for.
    pub transit_refused: u64,
    /// Upward datagrams dropped because they came around a loop of relays
    /// (transits installed in a cycle): the very datagram this shard last
    /// relayed for that source, now from another address. Nonzero means a
    /// misconfigured plan; without the check such a datagram would circle
    /// for ever.
    pub transit_loops: u64,
    /// Key updates sent unasked to a keyed job's group listeners after a
    /// member left (one per listener; protocol.md §2.4).
    pub result_key_updates: u64,
    /// Sync requests forwarded toward the root.
    pub syncs_forwarded: u64,
    /// Sync requests a root left unanswered because it has not seen the
    /// job's position yet (the worker asks again).
    pub sync_deferred: u64,
    /// Joiners this (non-root) switch admitted later than the root's sync
    /// answer said, because its other members may already have sent blocks
    /// from that start (the answer was lost on the way and came again).
    pub sync_moved: u64,
    /// Daemon, overload: data contributions answered with a Trimmed nack
    /// instead of being aggregated (an unkeyed job's before they reached
    /// the program, so not in `rx_datagrams`; a keyed job's after their tag
    /// verified).
    pub trimmed: u64,
    /// Data messages that arrived cut to their header by a trimming link
    /// (docs/protocol.md §4.14): a contribution is answered with a Trimmed
    /// nack (cause `Network`), a parent's result with the cached partial
    /// resent up, which fetches the result again.
    pub trimmed_in_network: u64,
    /// Daemon: datagrams the kernel dropped on the shard's full receive
    /// queue (never seen by the switch; silent loss).
    pub socket_drops: u64,
    /// Keyed jobs (docs/security.md), dropped before any state was touched:
    /// the tag did not verify (forged, corrupted, another key, a source
    /// with no key in the job, or a sealed datagram for a job without one).
    pub auth_bad_tag: u64,
    /// A valid tag whose sequence number was seen before or is older than
    /// the replay window: a replayed (or network-duplicated) datagram.
    pub auth_replayed: u64,
    /// An unsealed datagram for a job that requires a tag.
    pub auth_unsealed: u64,
    /// Contributions over their source's rate limit, answered with a
    /// Trimmed nack (cause 3) while the source's nack budget lasts.
    pub rate_limited: u64,
    /// Of those, the ones dropped without a nack (past the budget: a flood).
    pub rate_limited_unanswered: u64,
    /// Members found dead by the member timeout.
    pub members_timed_out: u64,
    /// Jobs failed by a dead member (failure policy `fail`).
    pub jobs_failed: u64,
    /// Worker contributions tagged with another incarnation of this switch
    /// (sent before the worker noticed a restart): answered with a
    /// StaleIncarnation nack, never aggregated.
    pub stale_incarnation: u64,
    /// Recovery joins left unanswered while other members had not reported,
    /// and recovering members' blocks held by a shard that had not yet
    /// learnt where the stream resumes (sent again by the member).
    pub recover_waiting: u64,
    /// Recovery floors established (every member reported after a restart).
    pub recoveries: u64,
    /// A child switch's partial refused (StaleIncarnation) while a recovery
    /// here waited for every member's recovery Join: the child restarts its
    /// subtree's stream and reports (docs/restart.md, "Trees").
    pub child_rejoin_asked: u64,
    /// Joins sent to the parent because a member probed this switch: a
    /// probe (plain Join), or `JOIN_DONE` once all its members are done. A
    /// parent's restart reaches a subtree whose workers all finished and
    /// only linger (docs/restart.md, "Idle members").
    pub probes_up: u64,
    /// A child switch's probes received (answered with StaleIncarnation
    /// while a recovery here waits for every member, else not at all).
    pub child_probes: u64,
    /// `JOIN_DONE` Joins: a member (or a child switch for all of its own)
    /// finished its last allreduce and lingers.
    pub done_joins: u64,
    /// The job restarted its stream here because the parent switch
    /// restarted (its StaleIncarnation nack): this switch's members
    /// recover, and it reports their lowest block to the parent.
    pub parent_restarts: u64,
    /// Rounds begun: every member of the job joined the barrier as a new
    /// incarnation (docs/protocol.md §4.12).
    pub rounds_started: u64,
    /// Rounds ended because a member joined again as a new incarnation.
    pub rounds_ended: u64,
    /// Joins held at the barrier (answered with a JOIN_WAIT JoinAck).
    pub barrier_waiting: u64,
    /// Contributions (and probes) of a round that has ended: answered with a
    /// restarted notice, never aggregated.
    pub stale_round: u64,
    /// Plain Joins refused at a tree's switch: a new process of a rank that
    /// already joined it (a tree has no rounds; docs/trees.md).
    pub rerun_in_tree: u64,
    /// Plain Joins refused at a tree's switch that restarted with the job
    /// installed (`Uplink::resumed`) from a rank that has not joined this life
    /// (Nack TreeSwitchRestarted: a running worker recovers on it, a new
    /// process fails).
    pub resumed_refused: u64,
}

impl Counters {
    pub fn count_malformed(&mut self, err: &WireError) {
        let kind = err.kind();
        if let Some(i) = WireError::KINDS.iter().position(|k| *k == kind) {
            self.malformed[i] += 1;
        }
    }

    pub fn malformed_total(&self) -> u64 {
        self.malformed.iter().sum()
    }

    /// Every counter as `(name, reason label, value)`, for metrics export.
    pub fn visit(&self, mut f: impl FnMut(&'static str, Option<&'static str>, u64)) {
        f("rx_datagrams", None, self.rx_datagrams);
        f("accepted", None, self.accepted);
        f("duplicate", None, self.duplicate);
        f("retransmissions", None, self.retransmissions);
        f("congestion_marked", None, self.congestion_marked);
        f("ecn_ce", None, self.ecn_ce);
        f("ecn_echoed", None, self.ecn_echoed);
        f("queue_marked", None, self.queue_marked);
        for (kind, v) in WireError::KINDS.iter().zip(self.malformed) {
            f("malformed", Some(kind), v);
        }
        f("unknown_job", None, self.unknown_job);
        f("non_member", None, self.non_member);
        f("over_cap", None, self.over_cap);
        f("slot_busy", None, self.slot_busy);
        f("memory_exhausted", None, self.memory_exhausted);
        f("records_recycled", None, self.records_recycled);
        f("result_acks", None, self.result_acks);
        f("records_acked", None, self.records_acked);
        f("records_evicted", None, self.records_evicted);
        f("out_of_window", None, self.out_of_window);
        f("expired", None, self.expired);
        f("mismatch", None, self.mismatch);
        f("protocol_violation", None, self.protocol_violation);
        f("late", None, self.late);
        f("wrong_shard", None, self.wrong_shard);
        f("blocks_completed", None, self.blocks_completed);
        f("blocks_degraded", None, self.blocks_degraded);
        f("blocks_aged", None, self.blocks_aged);
        f("scans", None, self.scans);
        f("declared_slow", None, self.declared_slow);
        f("readmitted", None, self.readmitted);
        f("notices_sent", None, self.notices_sent);
        f("transit_up", None, self.transit_up);
        f("transit_down", None, self.transit_down);
        f("transit_duplicate", None, self.transit_duplicate);
        f("transit_refused", None, self.transit_refused);
        f("transit_loops", None, self.transit_loops);
        f("result_key_updates", None, self.result_key_updates);
        f("results_sent", None, self.results_sent);
        f("results_to_group", None, self.results_to_group);
        f("results_resent", None, self.results_resent);
        f("results_without_data", None, self.results_without_data);
        f("joins", None, self.joins);
        f("nacks_sent", None, self.nacks_sent);
        f("forwarded", None, self.forwarded);
        f("sent_up", None, self.sent_up);
        f("resent_up", None, self.resent_up);
        f("from_parent", None, self.from_parent);
        f("relayed_down", None, self.relayed_down);
        f("parent_stale", None, self.parent_stale);
        f("parent_trimmed", None, self.parent_trimmed);
        f("syncs_forwarded", None, self.syncs_forwarded);
        f("sync_deferred", None, self.sync_deferred);
        f("sync_moved", None, self.sync_moved);
        f("trimmed", None, self.trimmed);
        f("trimmed_in_network", None, self.trimmed_in_network);
        f("socket_drops", None, self.socket_drops);
        f("auth_bad_tag", None, self.auth_bad_tag);
        f("auth_replayed", None, self.auth_replayed);
        f("auth_unsealed", None, self.auth_unsealed);
        f("rate_limited", None, self.rate_limited);
        f("rate_limited_unanswered", None, self.rate_limited_unanswered);
        f("members_timed_out", None, self.members_timed_out);
        f("jobs_failed", None, self.jobs_failed);
        f("stale_incarnation", None, self.stale_incarnation);
        f("recover_waiting", None, self.recover_waiting);
        f("recoveries", None, self.recoveries);
        f("child_rejoin_asked", None, self.child_rejoin_asked);
        f("probes_up", None, self.probes_up);
        f("child_probes", None, self.child_probes);
        f("done_joins", None, self.done_joins);
        f("parent_restarts", None, self.parent_restarts);
        f("rounds_started", None, self.rounds_started);
        f("rounds_ended", None, self.rounds_ended);
        f("barrier_waiting", None, self.barrier_waiting);
        f("stale_round", None, self.stale_round);
        f("rerun_in_tree", None, self.rerun_in_tree);
        f("resumed_refused", None, self.resumed_refused);
    }

    /// Add another shard's counters into these.
    pub fn merge(&mut self, other: &Counters) {
        macro_rules! add {
            ($($field:ident),*) => { $( self.$field += other.$field; )* };
        }
        add!(
            rx_datagrams, accepted, duplicate, retransmissions, congestion_marked, ecn_ce, ecn_echoed, queue_marked, unknown_job, non_member, over_cap,
            slot_busy, memory_exhausted, records_recycled, result_acks, records_acked, records_evicted, out_of_window, expired, mismatch, protocol_violation, late, wrong_shard,
            blocks_completed, blocks_degraded, blocks_aged, scans, declared_slow, readmitted, notices_sent, transit_up, transit_down, transit_duplicate, transit_refused, transit_loops, result_key_updates, results_sent, results_to_group, results_resent, results_without_data, joins, nacks_sent, forwarded,
            sent_up, resent_up, from_parent, relayed_down, parent_stale, parent_trimmed, syncs_forwarded, sync_deferred, sync_moved, trimmed, trimmed_in_network, socket_drops,
            auth_bad_tag, auth_replayed, auth_unsealed,
            rate_limited, rate_limited_unanswered, members_timed_out, jobs_failed,
            stale_incarnation, recover_waiting, recoveries, child_rejoin_asked, probes_up, child_probes, done_joins, parent_restarts, rounds_started,
            rounds_ended, barrier_waiting, stale_round, rerun_in_tree, resumed_refused
        );
        for (a, b) in self.malformed.iter_mut().zip(other.malformed) {
            *a += b;
        }
    }
}
