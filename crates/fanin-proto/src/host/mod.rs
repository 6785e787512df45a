//! Host-side machines.

mod allreduce;

pub use allreduce::{AllreduceSession, Event, Outcome, SessionConfig, SessionError, Tensor};
