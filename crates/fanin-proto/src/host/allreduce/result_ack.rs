//! Result acknowledgements (docs/memory.md, "Free at acknowledgement"): a
//! switch shard that refused a block for want of pooled memory may hold
//! done blocks whose results every member already has, but it cannot know
//! it. In answer to such a refusal the worker tells that shard which
//! results it holds: every block before its lowest block without a result,
//! and a bitmap of those after it within the window. Sent at most once a
//! round trip per shard, and only under memory pressure, so it costs
//! nothing otherwise.

use std::time::Duration;

use fanin_wire::value::{write_result_ack, Packet, Repr, RESULT_ACK_MAX_WORDS};
use fanin_wire::MessageType;

use super::op::BlockPhase;
use super::AllreduceSession;
use crate::auth::push_sealed;
use crate::job::shard_of;
use crate::time::Time;
use crate::transmit::Transmit;

/// Which shards asked (by refusing a block for memory) and when each was
/// last answered.
#[derive(Debug, Default)]
pub(super) struct ResultAcks {
    due: Vec<u16>,
    last_sent: Vec<(u16, Time)>,
}

impl ResultAcks {
    /// A shard refused block `block_id` with `MemoryExhausted`: answer it
    /// with an acknowledgement unless one went there within `round_trip`.
    pub(super) fn asked(&mut self, shard: u16, now: Time, round_trip: Duration) {
        if self.due.contains(&shard) {
            return;
        }
        let recent = self.last_sent.iter().any(|&(s, t)| s == shard && now.saturating_since(t) < round_trip);
        if !recent {
            self.due.push(shard);
        }
    }

    fn sent_to(&mut self, shard: u16, now: Time) {
        match self.last_sent.iter_mut().find(|(s, _)| *s == shard) {
            Some(entry) => entry.1 = now,
            None => self.last_sent.push((shard, now)),
        }
    }
}

impl AllreduceSession {
    /// Note a `MemoryExhausted` refusal of `block_id` (a Trimmed nack).
    pub(super) fn on_memory_refusal(&mut self, now: Time, block_id: u32) {
        let Some(params) = self.params else { return };
        let shard = shard_of(self.config.job_id, block_id, params.block_cnt_max, params.shard_count);
        let round_trip = self.srtt.unwrap_or(Duration::from_millis(1));
        self.result_acks.asked(shard, now, round_trip);
        self.cc.on_memory_short(now, round_trip);
    }

    /// Send the acknowledgements that are due: the running allreduce's
    /// lowest block without a result, and which of the blocks in the
    /// window after it have theirs.
    pub(super) fn send_result_acks(&mut self, now: Time, out: &mut impl Transmit<u16>) -> usize {
        let Some(op) = self.op.as_ref() else {
            self.result_acks.due.clear();
            return 0;
        };
        let mut sent = 0;
        let shards = std::mem::take(&mut self.result_acks.due);
        for shard in shards {
            let low = op.low;
            let ahead = (op.blocks.len() as u32).saturating_sub(low).min(self.cc.max());
            let words = (ahead as usize).div_ceil(64).min(RESULT_ACK_MAX_WORDS);
            let repr = Repr {
                block_id: op.block_id(low),
                grad_cnt: words as u16,
                ..Repr::new(MessageType::ResultAck, self.config.job_id, self.config.src_id)
            };
            let seal = self.sealer.as_mut().map(|s| (s.key, s.take_seq()));
            push_sealed(out, shard, repr.buffer_len(), seal.as_ref().map(|(k, q)| (k, *q)), |buf| {
                let mut packet = Packet::new_unchecked(buf);
                repr.emit(&mut packet);
                write_result_ack(packet.payload_mut(), |i| {
                    i < ahead && op.blocks[(low + i) as usize].phase == BlockPhase::Done
                });
            });
            self.result_acks.sent_to(shard, now);
            sent += 1;
        }
        sent
    }
}
