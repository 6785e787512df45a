//! The switch's per-channel receive window (ASK §3.3): the compact W-bit
//! `seen` array driven by `set_bit` / `clr_bitc`, the `max_seq` stale-packet
//! rule, and `PktState` (the bitmap each packet left the switch with).

/// What the window says about a data packet's `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// First appearance: aggregate, then [`SeenWindow::record`] the bitmap.
    New,
    /// Seen before: the packet leaves with this `PktState` bitmap (the
    /// tuples the switch did not absorb the first time).
    Duplicate { pkt_state: u64 },
    /// `seq <= max_seq - W`: older than the window, dropped (§3.3 corner case).
    Stale,
    /// `seq > max_seq + W`: a sender with a window larger than W, or garbage.
    /// Not in the paper; dropped so it cannot corrupt `seen`.
    BeyondWindow,
}

/// One channel's receive window of W packets.
#[derive(Debug, Clone)]
pub struct SeenWindow {
    w: u32,
    /// Compact `seen`: W bits. In an even segment (`(seq / W) % 2 == 0`) 1
    /// means observed; in an odd segment 0 means observed.
    seen: Vec<u64>,
    /// `PktState[seq % W]`: bitmap of the tuples still in the packet after
    /// its first pass.
    pkt_state: Vec<u64>,
    /// Highest seq observed; `None` before the first packet.
    max_seq: Option<u32>,
}

impl SeenWindow {
    /// `w >= 1`.
    pub fn new(w: u32) -> Self {
        let w = w.max(1);
        Self { w, seen: vec![0; (w as usize).div_ceil(64)], pkt_state: vec![0; w as usize], max_seq: None }
    }

    pub fn window(&self) -> u32 {
        self.w
    }
    pub fn max_seq(&self) -> Option<u32> {
        self.max_seq
    }

    /// Raw `seen` bit r (for tests and inspection).
    pub fn seen_bit(&self, r: u32) -> bool {
        self.seen[(r / 64) as usize] >> (r % 64) & 1 == 1
    }

    /// `set_bit(b)`: set, return the previous value.
    fn set_bit(&mut self, r: u32) -> bool {
        let prev = self.seen_bit(r);
        self.seen[(r / 64) as usize] |= 1 << (r % 64);
        prev
    }

    /// `clr_bitc(b)`: clear, return the complement of the previous value.
    fn clr_bitc(&mut self, r: u32) -> bool {
        let prev = self.seen_bit(r);
        self.seen[(r / 64) as usize] &= !(1 << (r % 64));
        !prev
    }

    /// Observe `seq` (equation 8), after the `max_seq` window check.
    pub fn observe(&mut self, seq: u32) -> Observation {
        let w = self.w as u64;
        let max = self.max_seq.map_or(-1i64, |m| m as i64);
        if (seq as i64) <= max - w as i64 {
            return Observation::Stale;
        }
        if seq as i64 > max + w as i64 {
            return Observation::BeyondWindow;
        }
        let (q, r) = (seq as u64 / w, (seq as u64 % w) as u32);
        let observed = if q % 2 == 0 { self.set_bit(r) } else { self.clr_bitc(r) };
        self.max_seq = Some(self.max_seq.map_or(seq, |m| m.max(seq)));
        if observed {
            Observation::Duplicate { pkt_state: self.pkt_state[r as usize] }
        } else {
            Observation::New
        }
    }

    /// Equation 9: `PktState[seq % W] <- bitmap` after a packet's first pass.
    pub fn record(&mut self, seq: u32, bitmap: u64) {
        self.pkt_state[(seq % self.w) as usize] = bitmap;
    }
}
