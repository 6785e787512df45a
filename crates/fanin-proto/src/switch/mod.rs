//! Switch-side programs.

mod counters;
mod value;

pub mod guard;
pub use counters::Counters;
pub use value::{
    AdmitError, AgingBoard, AgingConfig, Idle, MemoryModel, ScanSchedule, ShardConfig, Uplink, ValueSwitch, Verdict, MAX_CHECKS,
    MAX_SCANNERS, MAX_TRANSIT_SOURCES,
};
