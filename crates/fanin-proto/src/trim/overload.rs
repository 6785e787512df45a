//! Trimming in the switch daemon: when a shard's processing queue is above
//! its watermark, contributions are answered with a header-only
//! [`NackReason::Trimmed`] nack instead of being aggregated (NDP's
//! return-to-sender, done by the switch itself).
//!
//! Why not [`PortQueue`](super::PortQueue): in the daemon the queue that
//! overflows is the kernel's socket receive queue, in front of the shard
//! thread. The daemon cannot cut a payload on enqueue or serve headers ahead
//! of data; it sees a datagram only when it dequeues it. What it can do is
//! measure the backlog behind each batch and, above the watermark, spend as
//! little as possible on the datagrams it holds and tell their senders at
//! once, so they slow down before the kernel starts dropping silently.
//! docs/trimming-daemon.md explains the choice and what a hardware switch
//! does instead.
//!
//! The same reply serves any back-pressure cause ([`TrimCause`]): block-table
//! or memory exhaustion can answer with `TrimCause::MemoryExhausted` through
//! [`return_to_sender`] unchanged.

use fanin_wire::value::{Nack, NackReason, Packet};
#[cfg(test)]
use fanin_wire::value::{Dtype, Repr, HEADER_LEN};
pub use fanin_wire::value::TrimCause;
use fanin_wire::MessageType;

use crate::transmit::Transmit;

/// The level of a processing queue above which the switch trims, as a
/// fraction of the queue's capacity (the socket receive buffer the kernel
/// granted, so it follows the `net.core.rmem_max` cap automatically).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watermark {
    fraction: f64,
}

impl Watermark {
    /// `fraction` in `0.0..1.0`: at 1.0 the kernel drops before the switch
    /// would ever trim. 0.0 trims whenever anything waits behind a batch
    /// (useful to force trimming in tests).
    pub fn new(fraction: f64) -> Result<Self, String> {
        if !(0.0..1.0).contains(&fraction) {
            return Err(format!(
                "trim.watermark = {fraction} is out of range: give a fraction of the receive buffer in 0.0..1.0 \
                 (at 1.0 or above the kernel drops before the switch trims)"
            ));
        }
        Ok(Self { fraction })
    }

    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    /// Whether `queued` bytes waiting in a queue of `capacity` bytes are
    /// above the watermark.
    pub fn exceeded(&self, queued: usize, capacity: usize) -> bool {
        queued as f64 > self.fraction * capacity as f64
    }

    /// Which datagrams of a receive batch sat beyond the watermark.
    ///
    /// `before` and `after` are the queue's bytes just before and just after
    /// the batch was read, `batch_len` the batch's datagram bytes. The batch
    /// is the head of the queue in FIFO order and covered about
    /// `before - after` queue bytes; a datagram whose end lies beyond the
    /// watermark arrived to a queue at least that deep, exactly the packets
    /// NDP trims on arrival. Arrivals during the read make `after` larger,
    /// so the estimate errs towards trimming less.
    pub fn plan(&self, before: usize, after: usize, capacity: usize, batch_len: usize) -> TrimPlan {
        let threshold = self.fraction * capacity as f64;
        if before as f64 <= threshold || batch_len == 0 {
            return TrimPlan::NEVER;
        }
        let covered = match before.saturating_sub(after) {
            0 => before, // the queue refilled as fast as it drained
            c => c,
        };
        TrimPlan { scale: covered as f64 / batch_len as f64, cursor: 0.0, threshold }
    }
}

/// A cursor over one batch, from [`Watermark::plan`]: ask [`TrimPlan::trims`]
/// for each datagram in order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrimPlan {
    /// Queue bytes per datagram byte (the kernel's per-datagram overhead).
    scale: f64,
    /// Queue position of the next datagram's start.
    cursor: f64,
    threshold: f64,
}

impl TrimPlan {
    /// Trims nothing (trimming off, or the queue below the watermark).
    pub const NEVER: Self = Self { scale: 0.0, cursor: 0.0, threshold: f64::INFINITY };

    /// Whether the next datagram of the batch, `len` bytes long, ends beyond
    /// the watermark.
    pub fn trims(&mut self, len: usize) -> bool {
        self.cursor += len as f64 * self.scale;
        self.cursor > self.threshold
    }
}

/// Outcome of [`return_to_sender`] (and of the switch program's
/// `ValueSwitch::trim_datagram`).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrimVerdict {
    /// Answered with a Trimmed nack; the datagram must not be processed.
    Trimmed,
    /// Not a data contribution (or not a valid one): process it as usual.
    /// Joins, exponent-only rounds and anything malformed are never trimmed:
    /// they carry no payload to save, and the program counts what it refuses.
    Process,
    /// A keyed job's datagram that did not verify (forged, replayed,
    /// unsealed): counted by the program and dropped, never answered.
    Refused,
}

/// Whether a trim would save anything: a data contribution or
/// retransmission with a payload. Reads only the header.
pub fn is_trimmable(packet: &Packet<&[u8]>) -> bool {
    matches!(MessageType::from_u8(packet.msg_type_code()), Ok(MessageType::Contribution | MessageType::Retransmission))
        && !packet.exp_only()
        && packet.grad_cnt() > 0
}

/// If `bytes` is a data contribution (or retransmission), write the Trimmed
/// nack for it to `from` and return [`TrimVerdict::Trimmed`]. Reads only the
/// header: the payload is never touched. The nack is plain: a keyed job's
/// trims go through the switch program, which verifies and seals.
pub fn return_to_sender<A: Copy>(from: A, bytes: &[u8], cause: TrimCause, out: &mut impl Transmit<A>) -> TrimVerdict {
    let Ok(packet) = Packet::new_checked(bytes) else { return TrimVerdict::Process };
    if !is_trimmable(&packet) {
        return TrimVerdict::Process;
    }
    emit_trim_nack(from, &packet, cause, out);
    TrimVerdict::Trimmed
}

/// The Trimmed nack: the request's identity (job, source, generation,
/// block, dtype, `exp_only`) with the cause as detail (docs/protocol.md §2).
pub fn emit_trim_nack<A: Copy>(dest: A, request: &Packet<&[u8]>, cause: TrimCause, out: &mut impl Transmit<A>) {
    let buf = out.push(dest, Nack::DATAGRAM_LEN);
    Nack { reason: NackReason::Trimmed, detail: cause as u32 }.emit_reply(request, true, buf);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transmit::VecTransmit;

    fn contribution(msg_type: MessageType, grad_cnt: u16, exp_only: bool) -> Vec<u8> {
        let repr = Repr {
            exp_only,
            grad_cnt,
            gen_id: 4,
            block_id: 77,
            dtype: Dtype::Float32,
            exp: 3,
            ..Repr::new(msg_type, 9, 2)
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        buf
    }

    #[test]
    fn a_data_contribution_comes_back_as_a_header_only_trimmed_nack() {
        for t in [MessageType::Contribution, MessageType::Retransmission] {
            let mut out = VecTransmit::new();
            let bytes = contribution(t, 256, false);
            assert_eq!(return_to_sender(5u8, &bytes, TrimCause::ProcessingQueue, &mut out), TrimVerdict::Trimmed);
            let sent: Vec<_> = out.drain().collect();
            assert_eq!(sent.len(), 1);
            let (dest, reply) = &sent[0];
            assert_eq!((*dest, reply.len()), (5, HEADER_LEN + Nack::LEN), "header-only, back to the sender");
            let p = Packet::new_checked(&reply[..]).unwrap();
            let r = Repr::parse(&p).unwrap();
            assert_eq!((r.msg_type, r.job_id, r.src_id, r.gen_id, r.block_id), (MessageType::Nack, 9, 2, 4, 77));
            assert_eq!((r.dtype, r.exp_only, r.grad_cnt), (Dtype::Float32, false, 0));
            let nack = Nack::parse(p.payload()).unwrap();
            assert_eq!(nack, Nack { reason: NackReason::Trimmed, detail: 1 });
        }
    }

    #[test]
    fn joins_exponent_rounds_results_and_garbage_are_processed_not_trimmed() {
        let mut out = VecTransmit::new();
        let join = contribution(MessageType::Join, 0, false);
        let exp_only = contribution(MessageType::Contribution, 0, true);
        let result = contribution(MessageType::Result, 4, false);
        for bytes in [&join[..], &exp_only[..], &result[..], &[0xFA, 0x17, 1][..], &[][..]] {
            assert_eq!(return_to_sender(1u8, bytes, TrimCause::ProcessingQueue, &mut out), TrimVerdict::Process);
        }
        assert_eq!(out.drain().count(), 0);
    }

    #[test]
    fn watermark_is_a_fraction_of_capacity_and_rejects_nonsense() {
        let w = Watermark::new(0.5).unwrap();
        assert!(!w.exceeded(500, 1000));
        assert!(w.exceeded(501, 1000));
        assert!(Watermark::new(0.0).unwrap().exceeded(1, 1000));
        assert!(!Watermark::new(0.0).unwrap().exceeded(0, 1000));
        // the batch drained 10 000 of 12 000 queued bytes in five 1 000-byte
        // datagrams (2 000 queue bytes each); watermark at 5 000 of 10 000
        let mut plan = w.plan(12_000, 2_000, 10_000, 5_000);
        let trimmed: Vec<bool> = (0..5).map(|_| plan.trims(1_000)).collect();
        assert_eq!(trimmed, [false, false, true, true, true], "the datagrams beyond 5 000 queue bytes");
        let mut below = w.plan(5_000, 0, 10_000, 5_000);
        assert!((0..5).all(|_| !below.trims(1_000)), "a queue at the watermark is not trimmed");
        let mut refilled = w.plan(8_000, 9_000, 10_000, 4_000);
        let trimmed: Vec<bool> = (0..4).map(|_| refilled.trims(1_000)).collect();
        assert_eq!(trimmed, [false, false, true, true], "refilled queue: positions span `before`");
        for bad in [1.0, 1.5, -0.1, f64::NAN] {
            let e = Watermark::new(bad).unwrap_err();
            assert!(e.contains("trim.watermark") && e.contains("0.0..1.0"), "{e}");
        }
    }
}
