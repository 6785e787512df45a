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

use super::sealing::{self, envelope, Peer};
use super::{send_trim_nack, ValueSwitch};
use crate::time::Time;
use crate::transmit::Transmit;
use crate::trim::{is_trimmable, return_to_sender, TrimVerdict};

impl<A: Copy> ValueSwitch<A> {
    /// Answer a data contribution with a Trimmed nack of `cause` instead of
    /// processing it. [`TrimVerdict::Process`] for anything else (joins,
    /// exponent rounds, malformed datagrams: the program counts those);
    /// [`TrimVerdict::Refused`] for a keyed job's datagram that did not
    /// verify (counted in `auth_*`, no reply).
    pub fn trim_datagram(&mut self, now: Time, from: A, bytes: &[u8], cause: TrimCause, out: &mut impl Transmit<A>) -> TrimVerdict {
        // The header decides, before any tag is checked: what is not
        // data goes the normal way, where it is verified once. (A sealed
        // datagram is classified without its trailer.)
        let unverified = fanin_wire::auth::Sealed::split(bytes).map_or(bytes, |s| s.inner);
        match Packet::new_checked(unverified) {
            Ok(p) if is_trimmable(&p) => {}
            _ => return TrimVerdict::Process,
        }
        let job_id = u32::from_be_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        let src = u16::from_be_bytes([bytes[6], bytes[7]]) as usize;
        let Some(job) = self.jobs.get_mut(&job_id) else {
            // Unknown job: the plain, header-only reply.
            return return_to_sender(from, bytes, cause, out);
        };
        let Some(auth) = job.auth.as_mut() else {
            // Unkeyed: the plain, header-only reply.
            if job.members.contains(src) {
                job.liveness.heard(src, now);
            }
            return return_to_sender(from, bytes, cause, out);
        };
        self.counters.rx_datagrams += 1;
        let Some(inner) = sealing::admit(Some(&mut *auth), true, bytes, &mut self.counters) else {
            return TrimVerdict::Refused;
        };
        let packet = match Packet::new_checked(inner) {
            Ok(p) => p,
            Err(err) => {
                self.counters.count_malformed(&err);
                return TrimVerdict::Refused;
            }
        };
        let env = envelope(Some(auth), Peer::Member(src));
        send_trim_nack(&mut self.counters, out, from, env, &packet, cause);
        if job.members.contains(src) {
            job.liveness.heard(src, now);
        }
        TrimVerdict::Trimmed
    }
}
