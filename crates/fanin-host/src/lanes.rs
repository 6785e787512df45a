//! Send lanes: a worker's datagrams spread over several sockets, each sent
//! from a thread of its own (docs/network.md, "A worker on several threads").
//!
//! On a rate-limited link at 1500-byte frames most of a worker's cost is the
//! kernel's per-frame work for what it sends (the system call, the qdisc,
//! the device, and on a veth the receiving namespace's softirq), and it
//! lands on the core of the thread that sends. One thread then carries
//! about 2.3 Gbit/s whatever the cores around it do. Lanes move that work
//! onto more cores while the protocol stays one sans-IO state machine on
//! the caller's thread: lane `k` carries every datagram to the switch shards
//! `s` with `s % lanes == k`, so each shard still sees one address per
//! member (a shard learns it from the member's datagrams, and answers
//! there), and the order of one shard's datagrams is kept.
//!
//! Lane 0 is the session's own socket, sent on the caller's thread as
//! without lanes (joins go to shard 0, so through it). Lanes 1.. each own a
//! socket and a thread that does nothing but `sendmmsg` the batches the
//! caller's thread filled. Batches circulate between the two through a
//! small pool: a lane whose thread falls behind makes the caller wait for a
//! free batch, the back-pressure a blocking socket gives one thread. The
//! caller's thread receives on every lane's socket (the replies of a shard
//! come to the socket it heard from).

use std::io;
use std::net::SocketAddr;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use fanin_udp::{BatchSocket, SendBatch};

/// Most lanes a session takes (one socket and thread each).
pub const MAX_LANES: usize = 16;

/// Datagrams per send batch.
pub(crate) const BATCH_DATAGRAMS: usize = 256;

/// Batches a threaded lane owns: one being filled, the others queued for or
/// inside its thread's `sendmmsg`. Three keeps a thread busy while the
/// caller fills the next one, without holding much more than a window.
const BATCHES_PER_LANE: usize = 3;

/// The socket every lane's datagrams leave from and the batch being filled
/// for it.
pub(crate) struct SendLanes {
    lanes: Vec<Lane>,
    /// The first error a lane met handing over or sending a full batch in
    /// the middle of a burst ([`push`](Self::push)): lane 0's send error, a
    /// threaded lane's "stopped". Reported by the next
    /// [`flush_all`](Self::flush_all).
    deferred: Option<io::Error>,
}

struct Lane {
    socket: Arc<BatchSocket>,
    filling: SendBatch,
    /// Datagrams queued on this lane over the session's life.
    queued: u64,
    /// None for lane 0, sent inline on the caller's thread.
    thread: Option<LaneThread>,
}

struct LaneThread {
    /// Full batches to the thread (None once closing).
    to_send: Option<SyncSender<SendBatch>>,
    /// Sent batches back, cleared.
    sent: Receiver<SendBatch>,
    /// The first send error the thread met, reported by the next flush.
    error: Arc<Mutex<Option<io::Error>>>,
    handle: Option<JoinHandle<()>>,
    /// Why the thread is gone, once it is known to be: every later step
    /// fails with the same words (its panic's message is read once, when
    /// the thread is joined).
    gone: Option<String>,
}

impl SendLanes {
    /// Lane 0 only: the session's own socket (`offload`: UDP GSO where
    /// the socket has it).
    pub(crate) fn new(socket: BatchSocket, offload: bool) -> Self {
        let filling = new_batch(&socket, offload);
        Self { lanes: vec![Lane { socket: Arc::new(socket), filling, queued: 0, thread: None }], deferred: None }
    }

    /// Adds a lane sending from `socket` on a new thread.
    pub(crate) fn add_threaded(&mut self, socket: BatchSocket, offload: bool) -> io::Result<()> {
        let index = self.lanes.len();
        let (to_send, full) = sync_channel::<SendBatch>(BATCHES_PER_LANE);
        let (give_back, sent) = sync_channel::<SendBatch>(BATCHES_PER_LANE);
        for _ in 1..BATCHES_PER_LANE {
            give_back.send(new_batch(&socket, offload)).expect("the receiver is alive");
        }
        let filling = new_batch(&socket, offload);
        let socket = Arc::new(socket);
        let error = Arc::new(Mutex::new(None));
        let (thread_socket, thread_error) = (socket.clone(), error.clone());
        let handle = std::thread::Builder::new().name(format!("fanin-lane-{index}")).spawn(move || {
            while let Ok(mut batch) = full.recv() {
                if let Err(e) = thread_socket.send_batch(&mut batch) {
                    thread_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                }
                batch.clear();
                if give_back.send(batch).is_err() {
                    break; // the session is gone
                }
            }
        })?;
        self.lanes.push(Lane {
            socket,
            filling,
            queued: 0,
            thread: Some(LaneThread { to_send: Some(to_send), sent, error, handle: Some(handle), gone: None }),
        });
        Ok(())
    }

    pub(crate) fn count(&self) -> usize {
        self.lanes.len()
    }

    /// Every lane's socket, lane 0 first (to receive on).
    pub(crate) fn sockets(&self) -> impl Iterator<Item = &BatchSocket> {
        self.lanes.iter().map(|l| &*l.socket)
    }

    pub(crate) fn socket(&self, lane: usize) -> &BatchSocket {
        &self.lanes[lane].socket
    }

    /// Room for a `len`-byte datagram to `dest` on the lane of `shard`,
    /// flushing that lane first if its batch is full (a send error met
    /// there is reported by the next [`flush_all`](Self::flush_all)).
    pub(crate) fn push(&mut self, shard: u16, dest: SocketAddr, len: usize) -> &mut [u8] {
        let lane = shard as usize % self.lanes.len();
        if self.lanes[lane].filling.is_full() {
            if let Err(e) = self.flush(lane) {
                self.deferred.get_or_insert(e);
            }
        }
        self.lanes[lane].queued += 1;
        self.lanes[lane].filling.push(dest, len)
    }

    /// Datagrams each lane was given to send, lane 0 first.
    pub(crate) fn queued(&self) -> impl Iterator<Item = u64> + '_ {
        self.lanes.iter().map(|l| l.queued)
    }

    /// Sends what every lane holds (threaded lanes: hands it to the thread).
    /// Returns the first error: one lane 0 met since the last call (in
    /// this flush or a full batch's mid-burst one), or one a lane's thread
    /// met.
    pub(crate) fn flush_all(&mut self) -> io::Result<()> {
        let mut first = match self.deferred.take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        for lane in 0..self.lanes.len() {
            let r = self.flush(lane).and_then(|()| self.lanes[lane].take_thread_error()).and_then(|()| {
                // a thread that ended while the session lives died: say so
                // now, not when this lane next has a datagram to send
                match self.lanes[lane].thread.as_mut() {
                    Some(t) if t.gone.is_some() || t.handle.as_ref().is_some_and(JoinHandle::is_finished) => {
                        Err(t.stopped(lane))
                    }
                    _ => Ok(()),
                }
            });
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    fn flush(&mut self, lane: usize) -> io::Result<()> {
        let l = &mut self.lanes[lane];
        if l.filling.is_empty() {
            return Ok(());
        }
        let Some(t) = &mut l.thread else {
            return l.socket.send_batch(&mut l.filling).map(|_| ());
        };
        // A free batch first (waits while the thread holds them all: the
        // lane's back-pressure), then the full one to the thread.
        let Ok(empty) = t.sent.recv() else { return Err(t.stopped(lane)) };
        let full = std::mem::replace(&mut l.filling, empty);
        match t.to_send.as_ref().expect("open until drop").send(full) {
            Ok(()) => Ok(()),
            Err(_) => Err(t.stopped(lane)),
        }
    }
}

/// An empty send batch for `socket`.
fn new_batch(socket: &BatchSocket, offload: bool) -> SendBatch {
    let mut batch = SendBatch::new(BATCH_DATAGRAMS);
    batch.set_gso(offload && socket.gso_supported());
    batch
}

impl LaneThread {
    /// The error for a lane whose thread is gone, with its panic's message
    /// (the same each time).
    fn stopped(&mut self, lane: usize) -> io::Error {
        let why = self.gone.get_or_insert_with(|| match self.handle.take().map(JoinHandle::join) {
            Some(Err(panic)) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into()),
            _ => "it ended".into(),
        });
        io::Error::other(format!("send lane {lane} stopped: {why}"))
    }
}

impl Lane {
    fn take_thread_error(&self) -> io::Result<()> {
        match self.thread.as_ref().and_then(|t| t.error.lock().unwrap_or_else(|p| p.into_inner()).take()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for SendLanes {
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            if let Some(t) = lane.thread.as_mut() {
                // Closing the channel ends the thread after what it holds.
                t.to_send = None;
                if let Some(h) = t.handle.take() {
                    let _ = h.join();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send error on lane 0 when a full batch goes out in the middle of a
    /// burst is not lost: the burst's flush reports it, even though what
    /// the flush itself sent went out.
    #[test]
    fn a_mid_burst_send_error_on_lane_0_is_reported_by_the_next_flush() {
        let socket = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let sink = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut lanes = SendLanes::new(socket, false);
        // port 0 is no destination: the kernel refuses the send (EINVAL)
        let nowhere: SocketAddr = "127.0.0.1:0".parse().unwrap();
        for _ in 0..BATCH_DATAGRAMS {
            lanes.push(0, nowhere, 8).fill(1);
        }
        // the full batch goes out (and fails) here; this one is fine
        lanes.push(0, sink.local_addr().unwrap(), 8).fill(2);
        let err = lanes.flush_all().expect_err("the mid-burst failure is reported");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert!(lanes.flush_all().is_ok(), "reported once");
    }

    /// A lane thread that panicked with `message` (and has ended), and the
    /// sender of its batch-return channel, kept open as a live session's is.
    fn dead_lane_thread(message: &'static str) -> (LaneThread, SyncSender<SendBatch>) {
        let (to_send, full) = sync_channel::<SendBatch>(1);
        let (give_back, sent) = sync_channel::<SendBatch>(1);
        let handle = std::thread::spawn(move || {
            drop(full);
            panic!("{message}");
        });
        while !handle.is_finished() {
            std::thread::yield_now();
        }
        (LaneThread { to_send: Some(to_send), sent, error: Arc::default(), handle: Some(handle), gone: None }, give_back)
    }

    /// A lane whose thread died says so, with the panic's message, instead
    /// of the caller waiting for a batch that never comes back.
    #[test]
    fn a_lane_whose_thread_panicked_fails_with_the_panics_message() {
        let (mut t, _give_back) = dead_lane_thread("boom in the lane");
        let err = t.stopped(2);
        assert_eq!(err.to_string(), "send lane 2 stopped: boom in the lane");
        assert_eq!(t.stopped(2).to_string(), "send lane 2 stopped: boom in the lane", "the same words every time");
    }

    /// A lane thread that died with nothing queued for it fails the next
    /// step, and every one after it, not only the first step that gives
    /// that lane a datagram (after a retransmission timeout, if the lost
    /// batch held a window's tail).
    #[test]
    fn an_idle_lane_whose_thread_died_fails_every_next_step() {
        let socket = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut lanes = SendLanes::new(socket, false);
        let (thread, _give_back) = dead_lane_thread("boom while idle");
        let lane_socket = BatchSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let filling = new_batch(&lane_socket, false);
        lanes.lanes.push(Lane {
            socket: Arc::new(lane_socket),
            filling,
            queued: 0,
            thread: Some(thread),
        });
        for _ in 0..2 {
            let err = lanes.flush_all().expect_err("the dead lane is reported");
            assert_eq!(err.to_string(), "send lane 1 stopped: boom while idle");
        }
    }
}
