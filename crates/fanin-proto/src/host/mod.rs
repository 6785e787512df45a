//! Host-side machines.

mod allreduce;
#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod trim_tests;

pub use allreduce::{AllreduceSession, Event, Outcome, SessionConfig, SessionError, Tensor};
