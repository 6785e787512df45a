//! fanin's key-value host daemon (`fanin kv daemon`, ASK §3.1).
//!
//! It drives the sans-IO machines of `fanin_proto::kv` over real UDP and
//! holds no protocol logic of its own:
//! * data channels ([`channel`]): threads with a UDP socket each, running
//!   the receiver and sender machines placed on them;
//! * a control channel (TCP, JSON lines) between daemons: senders join a
//!   task at the receiver's daemon and report failures, the receiver's
//!   daemon tells senders when a task is aborted;
//! * a local API (Unix socket, JSON lines) for applications, whose inputs
//!   and results travel through shared-memory files ([`records`]);
//! * a client of the switch control API ([`switch_ctl`]) that allocates and
//!   releases the tasks' switch regions.
//!
//! `docs/kv.md` §10 describes the local API and the failure handling.

pub mod api;
pub mod channel;
pub mod columns;
mod daemon;
pub mod liveness;
pub mod records;
pub mod switch_ctl;

pub use daemon::{DaemonError, KvDaemon, KvDaemonConfig, TaskParams};
