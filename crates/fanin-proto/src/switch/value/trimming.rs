//! The shard's queue trim (cause 1, docs/trimming-daemon.md) as the switch
//! program sees it. The daemon decides *which* datagrams to trim (the ones
//! past the receive-queue watermark); the program decides *how*: a keyed
//! job's datagram is verified first, exactly as on the normal path, and its
//! Trimmed nack is sealed for the member, so a keyed worker (which ignores
//! anything unsealed) backs off like an unkeyed one, and a forged or
//! replayed datagram is counted and dropped instead of drawing a reply.
//! Verifying costs one tag; the aggregation, the block lookup and the
//! result fan-out that the trim saves cost several times that.
//!
//! A trimmed contribution still proves its member alive (its liveness
//! clock is refreshed, as for an aggregated one): under overload a member
//! may see every contribution trimmed for longer than the member timeout,
//! and declaring it dead would degrade the job's results, the opposite of
//! what back-pressure is for.

use fanin_wire::value::{Packet, TrimCause};
use fanin_wire::MessageType;

use super::sealing::{self, envelope, Peer};
use super::{send_trim_nack, ValueSwitch, Verdict};
use crate::time::Time;
use crate::transmit::Transmit;
use crate::trim::{is_trimmable, return_to_sender, TrimVerdict};

impl<A: Copy + PartialEq> ValueSwitch<A> {
    /// A data message that a trimming link cut to its header on the way
    /// here (docs/protocol.md §4.14; NDP): the sender learns of the loss in
    /// one trip instead of a timeout. A member's contribution is answered
    /// with a Trimmed nack of cause `Network` (the worker resends it and
    /// cuts its window, as for any trim); a result cut on the way down from
    /// the parent makes this switch resend its cached partial, which the
    /// parent answers with the result again. Nothing is added anywhere: a
    /// header has no lanes. A keyed job's cut datagram lost its seal with
    /// its tail and was refused before this (counted under `auth_*`); its
    /// sender recovers by retransmission as after a drop.
    pub(super) fn handle_trimmed_in_network(
        &mut self,
        now: Time,
        from: A,
        cut: &Packet<&[u8]>,
        out: &mut impl Transmit<A>,
    ) -> Verdict {
        self.counters.trimmed_in_network += 1;
        let Some(job) = self.jobs.get_mut(&cut.job_id()) else {
            self.counters.unknown_job += 1;
            return Verdict::Consumed;
        };
        match MessageType::from_u8(cut.msg_type_code()) {
            Ok(MessageType::Contribution | MessageType::Retransmission) => {
                let src = cut.src_id() as usize;
                if !job.members.contains(src) {
                    self.counters.non_member += 1;
                    return Verdict::Consumed;
                }
                job.liveness.heard(src, now);
                let env = envelope(job.auth.as_mut(), Peer::Member(src));
                send_trim_nack(&mut self.counters, out, from, env, cut, TrimCause::Network);
                Verdict::Consumed
            }
            Ok(MessageType::Result) if job.uplink.as_ref().is_some_and(|up| up.parent.contains(&from)) => {
                self.resend_partial_up(cut.job_id(), cut.block_id(), cut.gen_id(), false, out)
            }
            _ => {
                self.counters.protocol_violation += 1;
                Verdict::Consumed
            }
        }
    }

    /// Answer a data contribution with a Trimmed nack of `cause` instead of
    /// processing it. [`TrimVerdict::Process`] for anything else (joins,
    /// exponent rounds, malformed datagrams: the program counts those);
    /// [`TrimVerdict::Refused`] for a keyed job's datagram that did not
    /// verify (counted in `auth_*`, no reply).
    pub fn trim_datagram(&mut self, now: Time, from: A, bytes: &[u8], cause: TrimCause, out: &mut impl Transmit<A>) -> TrimVerdict {
        // The header decides, before any tag is checked: what is not
        // data goes the normal way, where it is verified once. (A sealed
        // datagram is classified without its trailer; once its tag
        // verifies, these same bytes are what the seal covered.)
        let unverified = fanin_wire::auth::Sealed::split(bytes).map_or(bytes, |s| s.inner);
        let packet = match Packet::new_checked(unverified) {
            Ok(p) if is_trimmable(&p) => p,
            _ => return TrimVerdict::Process,
        };
        let src = packet.src_id() as usize;
        let Some(job) = self.jobs.get_mut(&packet.job_id()) else {
            // Unknown job: the plain, header-only reply.
            return return_to_sender(from, bytes, cause, out);
        };
        let verdict = match job.auth.as_mut() {
            // Unkeyed: the plain, header-only reply.
            None => return_to_sender(from, bytes, cause, out),
            Some(auth) => {
                self.counters.rx_datagrams += 1;
                if sealing::admit(Some(&mut *auth), true, bytes, &mut self.counters).is_none() {
                    return TrimVerdict::Refused;
                }
                let env = envelope(Some(auth), Peer::Member(src));
                send_trim_nack(&mut self.counters, out, from, env, &packet, cause);
                TrimVerdict::Trimmed
            }
        };
        if job.members.contains(src) {
            job.liveness.heard(src, now);
        }
        verdict
    }
}
