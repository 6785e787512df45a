//! Host-side machines.

mod allreduce;
pub mod congestion;
#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod trim_tests;
#[cfg(test)]
mod ecn_tests;
#[cfg(test)]
mod memory_tests;
#[cfg(test)]
mod auth_tests;

pub use allreduce::{
    AllreduceSession, AuthStats, Event, LingerStats, LINGER_PROBE_INTERVAL, Outcome, Prepared, SessionConfig, SessionError, Tensor, TensorMut, TensorRef,
};
