//! Where machines write the datagrams they want sent. The caller owns the
//! storage: the daemon passes a `fanin_udp::SendBatch`, the simulator its
//! event queue, tests a [`VecTransmit`].

/// A sink for outgoing datagrams addressed to `A`.
pub trait Transmit<A> {
    /// Reserve a datagram of exactly `len` bytes to `dest` and return it to be
    /// filled in.
    fn push(&mut self, dest: A, len: usize) -> &mut [u8];

    /// Queue a copy of `bytes` to `dest`.
    fn push_copy(&mut self, dest: A, bytes: &[u8]) {
        self.push(dest, bytes.len()).copy_from_slice(bytes);
    }

    /// Queue `bytes` to every destination in `dests` (a switch's result to
    /// each member) and return how many that was. The default queues a
    /// copy per destination; the daemon's sink overrides it to queue the
    /// bytes once and hand the kernel the same buffer for every member.
    fn push_fanout(&mut self, dests: impl IntoIterator<Item = A>, bytes: &[u8]) -> usize
    where
        Self: Sized,
    {
        let mut n = 0;
        for dest in dests {
            self.push_copy(dest, bytes);
            n += 1;
        }
        n
    }

    /// While `ce` is set, what is pushed is a datagram this machine relays
    /// unchanged that arrived with Congestion Experienced in its IP header
    /// (a GOAT on-path relay): a sink that chooses codepoints sends it on
    /// CE-marked to every receiver that answers marks, as a router passes
    /// the mark on. The default sends nothing differently.
    fn set_relaying_ce(&mut self, ce: bool) {
        let _ = ce;
    }

    /// Queue `bytes` once to the IPv4 multicast `group` (a switch's result
    /// to the members listening there) and return true, or return false if
    /// this sink cannot reach groups, in which case the caller sends to
    /// each member instead. The default cannot.
    ///
    /// `listeners` are the addresses of the members listening there (None
    /// for one whose address is not known yet): a sink that chooses a
    /// datagram's ECN codepoint by its receiver marks the one copy
    /// ECN-capable only if every listener answers marks.
    fn push_group(
        &mut self,
        group: std::net::SocketAddrV4,
        listeners: impl IntoIterator<Item = Option<A>>,
        bytes: &[u8],
    ) -> bool
    where
        Self: Sized,
    {
        let _ = (group, listeners.into_iter(), bytes);
        false
    }
}

/// A growable list of datagrams, for tests and simple drivers.
#[derive(Debug, Default, Clone)]
pub struct VecTransmit<A> {
    pub datagrams: Vec<(A, Vec<u8>)>,
    /// Datagrams to multicast groups (kept apart: `A` need not be an IP
    /// address). Only recorded when `groups_reachable` is set.
    pub group_datagrams: Vec<(std::net::SocketAddrV4, Vec<u8>)>,
    pub groups_reachable: bool,
    /// How many datagrams were pushed while relaying a CE mark
    /// ([`Transmit::set_relaying_ce`]).
    pub relayed_ce: usize,
    relaying_ce: bool,
}

impl<A> VecTransmit<A> {
    pub fn new() -> Self {
        Self {
            datagrams: Vec::new(),
            group_datagrams: Vec::new(),
            groups_reachable: false,
            relayed_ce: 0,
            relaying_ce: false,
        }
    }
    pub fn len(&self) -> usize {
        self.datagrams.len()
    }
    pub fn is_empty(&self) -> bool {
        self.datagrams.is_empty()
    }
    pub fn drain(&mut self) -> std::vec::Drain<'_, (A, Vec<u8>)> {
        self.datagrams.drain(..)
    }
}

impl<A> Transmit<A> for VecTransmit<A> {
    fn push(&mut self, dest: A, len: usize) -> &mut [u8] {
        self.relayed_ce += usize::from(self.relaying_ce);
        self.datagrams.push((dest, vec![0; len]));
        &mut self.datagrams.last_mut().expect("just pushed").1
    }

    fn set_relaying_ce(&mut self, ce: bool) {
        self.relaying_ce = ce;
    }

    fn push_group(
        &mut self,
        group: std::net::SocketAddrV4,
        _listeners: impl IntoIterator<Item = Option<A>>,
        bytes: &[u8],
    ) -> bool {
        if self.groups_reachable {
            self.group_datagrams.push((group, bytes.to_vec()));
        }
        self.groups_reachable
    }
}
