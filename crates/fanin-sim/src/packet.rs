//! The simulated packet: a small `Copy` value carried inside events and
//! queues, so the hot path allocates nothing.

use fanin_proto::trim::Trimmable;

use crate::kernel::Ps;

/// Bytes of a header: a trimmed packet and every control packet (NDP's 64 B).
pub const HEADER_BYTES: u32 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A whole data packet.
    Data,
    /// A data packet whose payload was cut.
    Header,
    Ack,
    Nack,
    Pull,
}

/// Where a packet's payload was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrimPoint {
    None,
    /// By the output queue (ideal NDP switch).
    Queue,
    /// By an ingress-pipeline meter (Tofino design).
    Ingress,
    /// After deflect-on-drop and recirculation (Tofino).
    Dod,
    /// Header mirrored on drop and recirculated (MoD).
    Mirror,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet {
    pub kind: Kind,
    pub trim: TrimPoint,
    /// Returned to sender: routed towards `src`.
    pub bounced: bool,
    /// Not the first transmission of `seq`.
    pub retransmit: bool,
    pub size: u32,
    pub flow: u32,
    pub seq: u32,
    pub src: u32,
    pub dst: u32,
    /// Egress port chosen by the switch; carried through recirculation.
    pub egress: u16,
    pub sent: Ps,
}

impl Packet {
    pub fn control(kind: Kind, flow: u32, seq: u32, src: u32, dst: u32, now: Ps) -> Self {
        Packet { kind, trim: TrimPoint::None, bounced: false, retransmit: false, size: HEADER_BYTES, flow, seq, src, dst, egress: 0, sent: now }
    }

    /// The host the packet is travelling to.
    pub fn destination(&self) -> u32 {
        if self.bounced {
            self.src
        } else {
            self.dst
        }
    }

    /// Cut the payload at `point`.
    pub fn cut(&mut self, point: TrimPoint) {
        if self.kind == Kind::Data {
            self.kind = Kind::Header;
            self.size = HEADER_BYTES;
            self.trim = point;
        }
    }

    /// A data packet or what is left of one.
    pub fn is_data_derived(&self) -> bool {
        matches!(self.kind, Kind::Data | Kind::Header)
    }
}

impl Trimmable for Packet {
    fn wire_len(&self) -> u32 {
        self.size
    }
    fn trim(&mut self) {
        self.cut(TrimPoint::Queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_stays_small_and_trimming_keeps_identity() {
        assert!(std::mem::size_of::<Packet>() <= 40, "{}", std::mem::size_of::<Packet>());
        let mut p = Packet { kind: Kind::Data, trim: TrimPoint::None, bounced: false, retransmit: false, size: 1500, flow: 3, seq: 9, src: 1, dst: 2, egress: 0, sent: 7 };
        p.cut(TrimPoint::Ingress);
        assert_eq!((p.kind, p.size, p.trim, p.flow, p.seq), (Kind::Header, HEADER_BYTES, TrimPoint::Ingress, 3, 9));
        // Cutting twice changes nothing; control packets are never cut.
        p.cut(TrimPoint::Dod);
        assert_eq!(p.trim, TrimPoint::Ingress);
        let mut ack = Packet::control(Kind::Ack, 3, 9, 2, 1, 0);
        ack.trim();
        assert_eq!((ack.kind, ack.trim), (Kind::Ack, TrimPoint::None));
        p.bounced = true;
        assert_eq!(p.destination(), 1);
    }
}
