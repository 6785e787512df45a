//! The straggler scanners as timer threads of their own (`[aging] threads
//! = true`), as Trio-ML's are (§5): scanner `i` of N wakes at `i/N` of each
//! job's visit period after scanner `i-1`, visits slice `i` of the job's
//! scan words on every shard (`fanin_proto::switch::AgingBoard::visit`,
//! atomic REF flags and counts the shard threads set), and hands the
//! blocks it finds idle to the shard that owns them, waking it. The shard
//! ages a block out only if its word still says idle, so a contribution
//! that arrived in between wins. The shard threads then never scan
//! (their `handle_timeout` leaves aging to these threads).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fanin_proto::switch::{Idle, AgingBoard, ScanSchedule};

use crate::shard::Command;

/// A shard's wake-up: an eventfd the shard waits on beside its socket.
#[derive(Debug)]
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd with a zero count and flags; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd that nothing else owns.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to an eventfd.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reset after a wake-up (the count is read and cleared).
    pub(crate) fn clear(&self) {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64; nonblocking.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

/// Every shard's scan schedules, as each shard last published them (after
/// any change to its jobs).
pub(crate) type Registry = Arc<Mutex<Vec<Vec<ScanSchedule>>>>;

/// Where the scanners deliver: each shard's command channel and waker.
pub(crate) struct Shards {
    pub commands: Vec<Sender<Command>>,
    pub wakers: Vec<Arc<Waker>>,
}

/// Start `n` scanner threads over the shards' schedules; the shard clock
/// is `epoch` (the shards' `Time` is nanoseconds since it).
pub(crate) fn spawn(
    n: u16,
    registry: Registry,
    shards: Arc<Shards>,
    epoch: Instant,
    shutdown: Arc<AtomicBool>,
) -> Vec<JoinHandle<()>> {
    (0..n as u64)
        .map(|i| {
            let (registry, shards, shutdown) = (registry.clone(), shards.clone(), shutdown.clone());
            std::thread::Builder::new()
                .name(format!("fanin-scanner-{i}"))
                .spawn(move || run(i, registry, &shards, epoch, &shutdown))
                .expect("spawn scanner thread")
        })
        .collect()
}

fn run(i: u64, registry: Registry, shards: &Shards, epoch: Instant, shutdown: &AtomicBool) {
    // The scans need wake-ups tens of microseconds apart (as the shards did).
    // SAFETY: prctl with an integer argument has no memory effects.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0) };
    // next tick number of this scanner per board (a job removed and
    // admitted again under its id gets a new board, and a new schedule)
    // (the entry holds the board, so its address is not reused meanwhile)
    let mut next: HashMap<*const AgingBoard, (u64, Arc<AgingBoard>)> = HashMap::new();
    let mut idle: Vec<Idle> = Vec::new();
    const IDLE_WAIT: Duration = Duration::from_millis(5);
    while !shutdown.load(Ordering::Relaxed) {
        let schedules = registry.lock().map(|r| r.clone()).unwrap_or_default();
        let now = epoch.elapsed().as_nanos() as u64;
        let mut wake_at = now + IDLE_WAIT.as_nanos() as u64;
        for (shard, list) in schedules.iter().enumerate() {
            for s in list {
                if i >= s.slices {
                    continue; // more threads than this job's scanners
                }
                // this scanner's ticks: k = i (mod slices), at k * tick_ns
                let first = || {
                    let k = now / s.tick_ns + 1;
                    k + (i + s.slices - k % s.slices) % s.slices
                };
                let (k, _) = next.entry(Arc::as_ptr(&s.board)).or_insert_with(|| (first(), s.board.clone()));
                if *k * s.tick_ns <= now {
                    // a thread that fell behind visits once, not once per missed tick
                    let (lo, hi) = s.board.slice(i, s.slices);
                    idle.clear();
                    s.board.visit(lo, hi, &mut idle);
                    if !idle.is_empty() {
                        let names = std::mem::take(&mut idle);
                        let _ = shards.commands[shard].send(Command::AgeIdle(s.job_id, s.board.clone(), names));
                        shards.wakers[shard].wake();
                    }
                    let behind = (now / s.tick_ns).saturating_sub(*k) / s.slices + 1;
                    *k += behind * s.slices;
                }
                wake_at = wake_at.min(*k * s.tick_ns);
            }
        }
        next.retain(|board, _| schedules.iter().flatten().any(|s| Arc::as_ptr(&s.board) == *board));
        let now = epoch.elapsed().as_nanos() as u64;
        if wake_at > now {
            std::thread::sleep(Duration::from_nanos(wake_at - now));
        }
    }
}
