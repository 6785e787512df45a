//! Switch-side programs.

mod counters;
mod value;

pub use counters::Counters;
pub use value::{AdmitError, ShardConfig, ValueSwitch, Verdict};
