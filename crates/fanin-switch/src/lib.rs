//! The fanin switch daemon: the software form of Trio's run-to-completion
//! forwarding plane.
//!
//! * One thread per shard owns a UDP socket (data port `base + shard`) and
//!   the shard's part of every job (`fanin_proto::switch::ValueSwitch`). A
//!   packet is handled start to finish by that thread: receive batch,
//!   aggregate, send batch. State is sharded by `(job, block)` so the hot path
//!   takes no locks.
//! * The control plane (admission, removal, listing, counters) reaches the
//!   shards through command channels; the gRPC control API and the config
//!   file both go through [`SwitchCore`].
//! * A Prometheus text endpoint on 127.0.0.1 exports per-reason counters.
//!
//! The daemon makes no protocol decisions: everything about packets lives
//! in `fanin-proto`.

pub mod config;
mod core;
mod handover;
mod metrics;
mod scanners;
mod shard;

pub use crate::config::{ConfigError, DaemonConfig, FaultConfig, JobConfig, Listen, TrimSection};
pub use crate::core::{StartError, SwitchCore, SwitchHandle};
pub use fanin_control::{AdmitFailure, JobEntry, KvRegion, SwitchInfo, TreeRole};
