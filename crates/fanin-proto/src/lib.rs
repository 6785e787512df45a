//! fanin's protocol logic as sans-IO state machines.
//!
//! A machine takes `(datagram, now)` and `(timeout, now)` and produces
//! datagrams to send (written into a [`Transmit`] sink the caller owns) and its
//! next deadline (`poll_timeout`). It never opens a socket, reads a clock,
//! spawns a thread or sleeps. The switch daemon, the host library, the
//! simulator and the tests therefore all run this one implementation.
//!
//! * [`switch::ValueSwitch`]: the value-stream aggregation program of one
//!   switch shard (Trio-ML job and block records, SwitchML loss recovery).
//! * [`host::AllreduceSession`]: a worker's allreduce session.
//! * [`bfp`]: block floating point (SwitchML) used by both sides.

pub mod auth;
pub mod bfp;
pub mod fault;
pub mod host;
pub mod job;
pub mod kv;
pub mod mask;
pub mod serial;
pub mod switch;
pub mod time;
pub mod transmit;
pub mod trim;

pub use job::{shard_of, JobMode, JobSpec, JobSpecError};
pub use time::Time;
pub use transmit::{Transmit, VecTransmit};
