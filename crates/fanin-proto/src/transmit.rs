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
}

/// A growable list of datagrams, for tests and simple drivers.
#[derive(Debug, Default, Clone)]
pub struct VecTransmit<A> {
    pub datagrams: Vec<(A, Vec<u8>)>,
}

impl<A> VecTransmit<A> {
    pub fn new() -> Self {
        Self { datagrams: Vec::new() }
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
        self.datagrams.push((dest, vec![0; len]));
        &mut self.datagrams.last_mut().expect("just pushed").1
    }
}
