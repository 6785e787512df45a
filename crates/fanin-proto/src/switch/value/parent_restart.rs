//! A tree's switch restarted mid-run, seen from the switches around it
//! (docs/restart.md, "Trees").
//!
//! A restarted switch's recovery floor is the lowest block any member
//! still needs, and every member must report before it is known: a member
//! alone cannot tell which of its retained contributions a peer still
//! needs. A child switch is a member too, and it retains nothing: once it
//! has its parent's result it keeps the sum, not the partial it sent up.
//! So the child takes part for its whole subtree, which does retain:
//!
//! 1. **Down: the restart is told.** Once the restarted switch has a
//!    recovery under way (a member's first recovery Join, passed to its
//!    other shards as [`Verdict::RecoveryBegun`]; or from its admission,
//!    installed again marked `resumed`), it drops what the children sent
//!    before and refuses their partials with StaleIncarnation until the
//!    floor is known.
//! 2. **The child restarts its subtree's stream.** On that nack it moves
//!    the job to a new incarnation ([`next_incarnation`];
//!    [`Verdict::ParentRestarted`] to its other shards), as if it had
//!    restarted itself: its workers recover (their next contribution,
//!    tagged for the old incarnation, is refused) and report their lowest
//!    blocks in recovery Joins, and a child switch of its own is told as it
//!    was. Its blocks stay until the floor, for the earlier parent's last
//!    results only ([`restart_below`]).
//! 3. **The lowest block goes up.** When every member of the child
//!    reported, it sends its own recovery Join to the parent with their
//!    lowest block, again whenever a member's recovery Join comes again
//!    (the members' timers drive it), until the parent answers.
//! 4. **The floor comes down.** The parent's floor (the lowest block over
//!    all its members, the child's subtree included) is answered to the
//!    child's members, the earlier life's blocks go, and the stream
//!    resumes there on every shard ([`Verdict::Recovered`]). The workers resend their retained
//!    contributions from the floor under the recovery gate; the child
//!    aggregates them afresh and sends the partials up.
//!
//! The floor argument of docs/restart.md carries over unchanged: every
//! member of the whole tree below the restarted switch is a worker that
//! reported, so the floor is within a slot-cycle of every worker's lowest
//! block and every worker retained what it must resend.

use super::*;

/// The job's incarnation after it restarted below a parent whose
/// incarnation is `parent`: a function of both, so every shard of the
/// switch moves to the same one, and never one whose tag (the low 16 bits)
/// is the old tag or 0 (untagged).
pub(super) fn next_incarnation(old: u32, parent: u32) -> u32 {
    let mut next = old.wrapping_add(parent.rotate_left(16) | 0x0001_0001);
    while incarnation_tag(next) == 0 || incarnation_tag(next) == incarnation_tag(old) {
        next = next.wrapping_add(1);
    }
    next
}

/// The job restarts its stream on this shard below a parent that restarted
/// as `parent`: a new incarnation, a recovery that waits for every member
/// and then for the parent's floor. Its blocks stay until the floor comes,
/// but only to take the earlier parent's results still on their way (they
/// go down under the earlier tag, to the workers still bound to it, as a
/// restarted switch's last results reach its workers): nothing of the new
/// life reaches them, since the members' contributions are refused (tagged
/// for the earlier life) and the child switches' too (`switches_rejoin`).
/// Dropping them at once lost those results: a subtree that got them
/// elsewhere could finish its last allreduce and never report.
fn restart_below<A>(job: &mut Job<A>, parent: u32) {
    job.earlier_tag = Some(job.earlier_tag.unwrap_or(job.tag));
    job.incarnation = next_incarnation(job.incarnation, parent);
    job.tag = incarnation_tag(job.incarnation);
    if let Some(auth) = job.auth.as_mut() {
        auth.rebind_incarnation(job.incarnation);
    }
    job.parent_restart = Some(parent);
    job.recover_lows.clear();
    job.recover_floor = None;
    job.switches_rejoin = has_child_switches(&job.spec);
    job.pending_sync.clear();
}

/// A recovery begins on a job with child switches: what they sent before
/// is dropped (they send it again from the floor) and their partials are
/// refused until the floor is known.
pub(super) fn begin_switch_recovery<A>(job: &mut Job<A>) -> bool {
    if job.switches_rejoin || !has_child_switches(&job.spec) {
        return false;
    }
    drop_blocks(job);
    job.switches_rejoin = true;
    true
}

/// Between two probes this switch sends its parent: its members probe it
/// every 50 ms (stalled) or 200 ms (lingering), each of them.
pub(super) const PROBE_UP_INTERVAL: Duration = Duration::from_millis(100);

/// A member probed this switch (a plain Join from a bound member: it is
/// stalled, or lingering after its last allreduce): ask the parent too, at
/// most every [`PROBE_UP_INTERVAL`]. A parent that restarted and waits for
/// every member's report answers StaleIncarnation, as to a partial, and
/// this switch restarts its subtree's stream; without this, a subtree whose
/// workers all finished sent nothing up and the parent's floor never came
/// (docs/restart.md, "Idle members"). A parent with nothing to ask answers
/// nothing.
pub(super) fn probe_up<A: Copy + PartialEq>(job: &mut Job<A>, now: Time, counters: &mut Counters, out: &mut impl Transmit<A>) {
    join_up(job, now, 0, 0, counters, out);
}

/// A Join from this switch's tree rank to its parent, `age_op` with
/// `block_id` (a probe, or a `JOIN_DONE` for all of its members, done.rs),
/// at most every [`PROBE_UP_INTERVAL`]; none from a root.
pub(super) fn join_up<A: Copy + PartialEq>(
    job: &mut Job<A>,
    now: Time,
    age_op: u8,
    block_id: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) {
    let Some(up) = job.uplink.as_ref() else { return };
    if job.last_probe_up.is_some_and(|t| now < t + PROBE_UP_INTERVAL) {
        return;
    }
    job.last_probe_up = Some(now);
    let repr = Repr { age_op, block_id, ..Repr::new(MessageType::Join, job.spec.job_id, up.rank) };
    let dest = up.parent[0];
    let env = envelope(job.auth.as_mut(), Peer::Parent);
    send(out, dest, repr.buffer_len(), env, |buf| repr.emit(&mut Packet::new_unchecked(buf)));
    counters.probes_up += 1;
}

/// A child switch's probe ([`probe_up`]): while a recovery here waits for
/// every member's report, it is asked to restart its subtree's stream and
/// report, as its partials are; and this switch asks its own parent in
/// turn (the restarted switch may be further up).
pub(super) fn child_probe<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    now: Time,
    from: A,
    packet: &Packet<&[u8]>,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> Verdict {
    counters.child_probes += 1;
    if job.switches_rejoin {
        counters.child_rejoin_asked += 1;
        let env = envelope(job.auth.as_mut(), Peer::Member(packet.src_id() as usize));
        send_nack(counters, out, from, env, packet, NackReason::StaleIncarnation, job.incarnation);
    } else if packet.age_op() == JOIN_DONE {
        // Its members all finished (done.rs, which probes up from there); a
        // child takes no plain JoinAck, only the word that all are done.
        let (src, block) = (packet.src_id(), packet.block_id());
        if note_done(job, now, src, block, counters, out) {
            answer_all_done(job, config, src, from, block, out);
        }
        return Verdict::Consumed;
    }
    probe_up(job, now, counters, out);
    Verdict::Consumed
}

/// A child whose parent restarted reports its members' lowest block to the
/// parent in a recovery Join of its own (again on every member's repeated
/// recovery Join, until the parent answers).
pub(super) fn report_low_up<A: Copy + PartialEq>(job: &mut Job<A>, low: u32, counters: &mut Counters, out: &mut impl Transmit<A>) {
    let Some(up) = job.uplink.as_ref() else { return };
    let repr = Repr { age_op: JOIN_RECOVER, block_id: low, ..Repr::new(MessageType::Join, job.spec.job_id, up.rank) };
    let anchor = job.anchor;
    let dest = up.parent[0];
    let env = envelope(job.auth.as_mut(), Peer::Parent);
    send(out, dest, repr.buffer_len(), env, |buf| {
        let mut packet = Packet::new_unchecked(buf);
        repr.emit(&mut packet);
        anchor.emit(packet.payload_mut());
    });
    counters.recover_waiting += 1;
}

impl<A: Copy + PartialEq> ValueSwitch<A> {
    /// The parent refused this switch's partial as another incarnation's:
    /// it restarted and recovers. Restart the job's stream here (once per
    /// parent incarnation).
    pub(super) fn parent_restarted(&mut self, job_id: u32, parent: u32) -> Verdict {
        if self.restart_for_parent(job_id, parent) {
            Verdict::ParentRestarted { job_id, parent }
        } else {
            Verdict::Consumed // a late copy: restarted for it already
        }
    }

    /// This shard's part of [`Verdict::ParentRestarted`] (the shard that
    /// got the parent's nack, or another one told of it); false if the job
    /// restarted for that parent incarnation already.
    pub fn restart_for_parent(&mut self, job_id: u32, parent: u32) -> bool {
        let Some(job) = self.jobs.get_mut(&job_id).filter(|j| j.parent_restart != Some(parent)) else { return false };
        restart_below(job, parent);
        self.counters.parent_restarts += 1;
        self.settle_memory(job_id);
        true
    }

    /// Another shard's [`Verdict::RecoveryBegun`].
    pub fn begin_recovery(&mut self, job_id: u32) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            begin_switch_recovery(job);
        }
        self.settle_memory(job_id);
    }

    /// The parent's answer to this switch's recovery Join: the floor, for
    /// this switch's members too.
    pub(super) fn floor_from_parent(&mut self, job_id: u32, floor: u32, out: &mut impl Transmit<A>) -> Verdict {
        let config = &self.config;
        let Some(job) = self.jobs.get_mut(&job_id) else { return Verdict::Consumed };
        if job.parent_restart.is_none() || job.recover_floor.is_some() {
            self.counters.parent_stale += 1; // a repeated answer
            return Verdict::Consumed;
        }
        // (the earlier life's blocks go: resume_at)
        settle_floor(job, config, floor, &mut self.counters, out);
        // (the verdict's member changes nothing: its listening is as it was)
        let member = job.members.iter().next().unwrap_or(0) as u16;
        let listens = job.listens_on_group.contains(member as usize);
        Verdict::Recovered { job_id, floor, member, listens }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_below_a_parent_always_changes_the_tag_and_never_to_untagged() {
        for old in [0u32, 1, 0xffff, 0x1_0000, 0xdead_beef, u32::MAX] {
            for parent in [0u32, 1, 0xffff_0000, 0x1234_5678, u32::MAX] {
                let next = next_incarnation(old, parent);
                assert_ne!(incarnation_tag(next), incarnation_tag(old), "{old:#x} {parent:#x}");
                assert_ne!(incarnation_tag(next), 0);
                assert_eq!(next, next_incarnation(old, parent), "every shard moves to the same one");
            }
        }
    }
}
