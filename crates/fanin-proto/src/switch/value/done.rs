//! Members that finished: a lingering member's `JOIN_DONE` (the end of its
//! stream), and the answer that every member is done, so lingering can
//! stop exactly when nobody can need a recovery any more (docs/restart.md,
//! "Idle members"). In a tree a switch whose members are all done says so
//! to its parent with a `JOIN_DONE` of its own, and the root's
//! `JOIN_ALL_DONE` comes down the same way.

use super::*;

/// Every member said it is done, at the same block: that block.
fn all_done_here<A>(job: &Job<A>) -> Option<u32> {
    let mut at = None;
    for m in job.members.iter() {
        let x = *job.done_at.get(&(m as u16))?;
        if at.is_some_and(|a| a != x) {
            return None; // (one ran more allreduces than another)
        }
        at = Some(x);
    }
    at
}

/// Whether every worker of the job, the whole tree's, is done at `block`.
fn all_done_at<A>(job: &Job<A>, block: u32) -> bool {
    all_done_here(job) == Some(block) && (job.uplink.is_none() || job.all_done_above == Some(block))
}

/// Record member `src` (a worker, or a child switch for all of its own)
/// done at `block`, and tell the parent: this switch's members all done
/// (a `JOIN_DONE` from its tree rank), or else a probe for a restart
/// further up ([`probe_up`]); both at most every [`PROBE_UP_INTERVAL`].
/// Returns whether every worker of the job is done at `block`: then
/// [`answer_all_done`].
pub(super) fn note_done<A: Copy + PartialEq>(
    job: &mut Job<A>,
    now: Time,
    src: u16,
    block: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> bool {
    job.done_at.insert(src, block);
    counters.done_joins += 1;
    match all_done_here(job) {
        Some(at) => join_up(job, now, JOIN_DONE, at, counters, out),
        None => probe_up(job, now, counters, out),
    }
    all_done_at(job, block)
}

/// `JOIN_ALL_DONE` at `block` to member `src` at `dest`.
pub(super) fn answer_all_done<A: Copy + PartialEq>(job: &mut Job<A>, config: &ShardConfig, src: u16, dest: A, block: u32, out: &mut impl Transmit<A>) {
    answer_join_as(job, config, src, src, dest, JoinStart::at(block), JOIN_ALL_DONE, out);
}

/// A worker's `JOIN_DONE`: recorded, and answered as a probe (a plain
/// JoinAck with this switch's incarnation: a restart shows there), or with
/// `JOIN_ALL_DONE` once every worker is done at its block. (A child
/// switch's is answered only with the latter: parent_restart.rs.)
#[allow(clippy::too_many_arguments)]
pub(super) fn done_join<A: Copy + PartialEq>(
    job: &mut Job<A>,
    config: &ShardConfig,
    now: Time,
    src: u16,
    from: A,
    block: u32,
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
) -> Verdict {
    if note_done(job, now, src, block, counters, out) {
        answer_all_done(job, config, src, from, block, out);
    } else {
        let start = job.start_block;
        answer_join(job, config, src, src, from, start, out);
    }
    Verdict::Consumed
}

/// The parent's `JOIN_ALL_DONE`: every worker of the tree is done at
/// `block`; this switch's members learn it from their next `JOIN_DONE`.
pub(super) fn all_done_from_parent<A>(job: &mut Job<A>, block: u32) {
    job.all_done_above = Some(block);
}
