//! One egress port: a data queue and a high-priority header queue.
//!
//! NDP's switch queue: data packets wait in a small data queue; when it is
//! full the arriving packet's payload is cut and the header joins the header
//! queue, which is served ahead of data by weighted round robin (so data
//! still moves when many headers arrive, and trimmed headers jump the data
//! queue). When the header queue is full too, the header goes back to its
//! sender (return-to-sender).
//!
//! The queue only stores and orders packets; the caller serialises them on a
//! link, decides routes and applies return-to-sender.

use std::collections::VecDeque;

/// What a queue needs to know about a packet.
pub trait Trimmable {
    /// Bytes the packet occupies on the wire (and in the buffer).
    fn wire_len(&self) -> u32;
    /// Cut the payload, leaving the header (and set NDP's trimmed bit).
    fn trim(&mut self);
}

/// Capacities and weights of a port queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    pub data_capacity_bytes: u64,
    pub header_capacity_bytes: u64,
    /// While both queues are backlogged, serve `header_weight` headers for
    /// every `data_weight` data packets.
    pub header_weight: u32,
    pub data_weight: u32,
}

impl QueueConfig {
    /// NDP defaults used by fanin's simulator: 10 MTU-sized data packets
    /// (the paper's "as low as ten MTU-sized packets"), a 64 KiB header queue
    /// (1024 headers of 64 B), 10:1 round robin.
    pub fn ndp(mtu: u32) -> Self {
        Self { data_capacity_bytes: 10 * mtu as u64, header_capacity_bytes: 64 * 1024, header_weight: 10, data_weight: 1 }
    }

    /// A FIFO with (practically) no limit, e.g. a host NIC or a recirculation port.
    pub fn unbounded() -> Self {
        Self { data_capacity_bytes: u64::MAX, header_capacity_bytes: u64::MAX, header_weight: 1, data_weight: 1 }
    }
}

/// The queue a packet was placed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Data,
    Header,
}

/// Result of [`PortQueue::enqueue_ndp`].
#[must_use]
#[derive(Debug, PartialEq, Eq)]
pub enum NdpVerdict<P> {
    /// Queued whole in the data queue.
    Queued,
    /// Payload cut; the header is in the header queue.
    Trimmed,
    /// Payload cut and the header queue full: the (trimmed) packet is handed
    /// back to be returned to its sender.
    ReturnToSender(P),
}

/// Occupancy high-water marks and counters of one port queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub max_data_bytes: u64,
    pub max_data_packets: u64,
    pub max_header_bytes: u64,
    pub trimmed: u64,
    pub returned_to_sender: u64,
    pub rejected: u64,
}

/// An egress port's queues. Packets of type `P` are stored by value.
#[derive(Debug, Clone)]
pub struct PortQueue<P> {
    config: QueueConfig,
    data: VecDeque<P>,
    headers: VecDeque<P>,
    data_bytes: u64,
    header_bytes: u64,
    /// Position in the WRR cycle of `header_weight + data_weight` slots.
    slot: u32,
    stats: QueueStats,
}

impl<P: Trimmable> PortQueue<P> {
    pub fn new(config: QueueConfig) -> Self {
        Self {
            config,
            data: VecDeque::new(),
            headers: VecDeque::new(),
            data_bytes: 0,
            header_bytes: 0,
            slot: 0,
            stats: QueueStats::default(),
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }
    pub fn stats(&self) -> &QueueStats {
        &self.stats
    }
    pub fn data_len(&self) -> usize {
        self.data.len()
    }
    pub fn header_len(&self) -> usize {
        self.headers.len()
    }
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }
    pub fn header_bytes(&self) -> u64 {
        self.header_bytes
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty() && self.headers.is_empty()
    }

    /// Would a data packet of `bytes` fit now?
    pub fn data_fits(&self, bytes: u32) -> bool {
        self.data_bytes.saturating_add(bytes as u64) <= self.config.data_capacity_bytes
    }

    /// Drop-tail: queue `p` in the data queue if it fits, else hand it back.
    pub fn try_enqueue_data(&mut self, p: P) -> Result<(), P> {
        let len = p.wire_len();
        if !self.data_fits(len) {
            self.stats.rejected += 1;
            return Err(p);
        }
        self.data_bytes += len as u64;
        self.data.push_back(p);
        self.stats.max_data_bytes = self.stats.max_data_bytes.max(self.data_bytes);
        self.stats.max_data_packets = self.stats.max_data_packets.max(self.data.len() as u64);
        Ok(())
    }

    /// Queue a header (a trimmed packet or a control packet) in the
    /// high-priority queue if it fits, else hand it back.
    pub fn enqueue_header(&mut self, p: P) -> Result<(), P> {
        let len = p.wire_len() as u64;
        if self.header_bytes.saturating_add(len) > self.config.header_capacity_bytes {
            self.stats.rejected += 1;
            return Err(p);
        }
        self.header_bytes += len;
        self.headers.push_back(p);
        self.stats.max_header_bytes = self.stats.max_header_bytes.max(self.header_bytes);
        Ok(())
    }

    /// Ideal NDP trimming of an arriving data packet: queue it whole if the
    /// data queue has room, else trim it into the header queue, else return
    /// it to its sender.
    pub fn enqueue_ndp(&mut self, p: P) -> NdpVerdict<P> {
        let p = match self.try_enqueue_data(p) {
            Ok(()) => return NdpVerdict::Queued,
            Err(p) => p,
        };
        self.stats.rejected -= 1; // not a rejection: trimming follows
        let mut p = p;
        p.trim();
        self.stats.trimmed += 1;
        match self.enqueue_header(p) {
            Ok(()) => NdpVerdict::Trimmed,
            Err(p) => {
                self.stats.rejected -= 1;
                self.stats.returned_to_sender += 1;
                NdpVerdict::ReturnToSender(p)
            }
        }
    }

    /// The next packet to put on the wire, by weighted round robin between
    /// headers and data while both are backlogged.
    pub fn dequeue(&mut self) -> Option<(P, Class)> {
        let class = match (self.headers.is_empty(), self.data.is_empty()) {
            (true, true) => return None,
            (false, true) => Class::Header,
            (true, false) => Class::Data,
            (false, false) => {
                let cycle = (self.config.header_weight + self.config.data_weight).max(1);
                let class = if self.slot < self.config.header_weight { Class::Header } else { Class::Data };
                self.slot = (self.slot + 1) % cycle;
                class
            }
        };
        let p = match class {
            Class::Header => self.headers.pop_front(),
            Class::Data => self.data.pop_front(),
        }?;
        let len = p.wire_len() as u64;
        match class {
            Class::Header => self.header_bytes -= len,
            Class::Data => self.data_bytes -= len,
        }
        Some((p, class))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Pkt {
        id: u32,
        len: u32,
        trimmed: bool,
    }
    impl Trimmable for Pkt {
        fn wire_len(&self) -> u32 {
            self.len
        }
        fn trim(&mut self) {
            self.len = 64;
            self.trimmed = true;
        }
    }
    fn data(id: u32) -> Pkt {
        Pkt { id, len: 1500, trimmed: false }
    }
    fn cfg() -> QueueConfig {
        QueueConfig { data_capacity_bytes: 3000, header_capacity_bytes: 128, header_weight: 2, data_weight: 1 }
    }

    #[test]
    fn drop_tail_rejects_the_arriving_packet() {
        let mut q = PortQueue::new(cfg());
        assert!(q.try_enqueue_data(data(1)).is_ok());
        assert!(q.try_enqueue_data(data(2)).is_ok());
        assert_eq!(q.try_enqueue_data(data(3)), Err(data(3)));
        assert_eq!(q.dequeue().map(|x| x.0.id), Some(1));
        assert!(q.try_enqueue_data(data(4)).is_ok());
        let order: Vec<u32> = std::iter::from_fn(|| q.dequeue().map(|x| x.0.id)).collect();
        assert_eq!(order, [2, 4]);
        assert_eq!(q.stats().rejected, 1);
    }

    #[test]
    fn ndp_trims_the_arriving_packet_then_returns_to_sender() {
        let mut q = PortQueue::new(cfg());
        assert_eq!(q.enqueue_ndp(data(1)), NdpVerdict::Queued);
        assert_eq!(q.enqueue_ndp(data(2)), NdpVerdict::Queued);
        assert_eq!(q.enqueue_ndp(data(3)), NdpVerdict::Trimmed);
        assert_eq!(q.enqueue_ndp(data(4)), NdpVerdict::Trimmed);
        // Header queue (128 B) holds two 64 B headers: the fifth comes back trimmed.
        assert_eq!(q.enqueue_ndp(data(5)), NdpVerdict::ReturnToSender(Pkt { id: 5, len: 64, trimmed: true }));
        assert_eq!((q.data_len(), q.header_len()), (2, 2));
        let s = *q.stats();
        assert_eq!((s.trimmed, s.returned_to_sender, s.rejected), (3, 1, 0));
        // Headers jump the data queue: 2 headers per data packet.
        let order: Vec<(u32, bool)> = std::iter::from_fn(|| q.dequeue().map(|x| (x.0.id, x.0.trimmed))).collect();
        assert_eq!(order, [(3, true), (4, true), (1, false), (2, false)]);
        assert_eq!((q.data_bytes(), q.header_bytes()), (0, 0));
    }

    #[test]
    fn weighted_round_robin_serves_data_while_headers_are_backlogged() {
        let cfg = QueueConfig { data_capacity_bytes: 1 << 20, header_capacity_bytes: 1 << 20, header_weight: 2, data_weight: 1 };
        let mut q = PortQueue::new(cfg);
        for i in 0..3 {
            q.try_enqueue_data(data(100 + i)).unwrap();
        }
        for i in 0..6 {
            q.enqueue_header(Pkt { id: i, len: 64, trimmed: true }).unwrap();
        }
        let order: Vec<u32> = std::iter::from_fn(|| q.dequeue().map(|x| x.0.id)).collect();
        assert_eq!(order, [0, 1, 100, 2, 3, 101, 4, 5, 102]);
    }

    #[test]
    fn only_backlogged_classes_advance_the_cycle() {
        let mut q = PortQueue::new(QueueConfig { header_weight: 1, data_weight: 1, ..QueueConfig::unbounded() });
        q.try_enqueue_data(data(1)).unwrap();
        q.try_enqueue_data(data(2)).unwrap();
        assert_eq!(q.dequeue().map(|x| x.1), Some(Class::Data));
        q.enqueue_header(Pkt { id: 9, len: 64, trimmed: true }).unwrap();
        assert_eq!(q.dequeue().map(|x| (x.0.id, x.1)), Some((9, Class::Header)));
        assert_eq!(q.dequeue().map(|x| x.0.id), Some(2));
        assert!(q.dequeue().is_none());
    }
}
