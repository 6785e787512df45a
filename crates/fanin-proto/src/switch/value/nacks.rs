//! Nacks the program sends, counted once they went out (docs/protocol.md, docs/overload.md).

use super::*;

/// Over its rate: back-pressure to the sender while its nack budget
/// lasts (docs/overload.md), counted either way.
pub(super) fn rate_limited<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    from: A,
    env: Envelope,
    packet: &Packet<&[u8]>,
    nack: bool,
) {
    counters.rate_limited += 1;
    if !nack {
        counters.rate_limited_unanswered += 1;
        return;
    }
    send_trim_nack(counters, out, from, env, packet, TrimCause::RateLimited);
}

/// A Trimmed nack (back-pressure, docs/overload.md) from the job's program,
/// sealed like every other reply of a keyed job (a keyed worker ignores an
/// unsealed one): slot exhaustion and rate limits here, the shard's queue
/// trim in `trimming.rs`.
pub(super) fn send_trim_nack<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    dest: A,
    env: Envelope,
    request: &Packet<&[u8]>,
    cause: TrimCause,
) {
    send_counted_nack(counters, out, dest, env, |buf| {
        Nack { reason: NackReason::Trimmed, detail: cause as u32 }.emit_reply(request, true, buf);
    });
}

pub(super) fn send_nack<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    dest: A,
    env: Envelope,
    request: &Packet<&[u8]>,
    reason: NackReason,
    detail: u32,
) {
    send_nack_tagged(counters, out, dest, env, request, reason, detail, None)
}

/// [`send_nack`], with this switch's incarnation tag in the body when given
/// (BlockExpired: workers drop one from another incarnation).
#[allow(clippy::too_many_arguments)]
pub(super) fn send_nack_tagged<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    dest: A,
    env: Envelope,
    request: &Packet<&[u8]>,
    reason: NackReason,
    detail: u32,
    tag: Option<u16>,
) {
    send_counted_nack(counters, out, dest, env, |buf| {
        Nack { reason, detail }.emit_reply(request, false, buf);
        if let Some(tag) = tag {
            buf[NACK_TAG].copy_from_slice(&tag.to_be_bytes());
        }
    });
}

/// Send a nack `fill` writes (sealed per `env`), counted once it went out.
pub(super) fn send_counted_nack<A: Copy + PartialEq>(
    counters: &mut Counters,
    out: &mut impl Transmit<A>,
    dest: A,
    env: Envelope,
    fill: impl FnOnce(&mut [u8]),
) {
    if send(out, dest, Nack::DATAGRAM_LEN, env, fill) {
        counters.nacks_sent += 1;
    }
}
