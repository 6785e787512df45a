//! Switch-side programs.

mod counters;
mod value;

pub mod guard;
pub use counters::Counters;
pub use value::{AdmitError, AgingConfig, MemoryModel, ShardConfig, Uplink, ValueSwitch, Verdict, MAX_CHECKS, MAX_SCANNERS};
