//! Packet trimming queue disciplines (NDP; "Packet trimming in programmable
//! switches", Popa et al.), as sans-IO building blocks.
//!
//! * [`queue::PortQueue`]: one egress port with a data queue and a
//!   high-priority header queue served by weighted round robin. It offers
//!   drop-tail, ideal NDP trimming (cut the payload when the data queue is
//!   full, header into the header queue, return-to-sender when the header
//!   queue is full) and the primitive operations the hardware designs need
//!   (enqueue data only if it fits, enqueue a header).
//! * [`meter::IngressTrimmer`]: the paper's Tofino design (§4, §5, Fig. 3):
//!   per-pipeline, per-egress-port meters at 100% / 50% / 25% of line rate
//!   (optimistic / half-pessimistic / pessimistic), soft-state timers `T0`
//!   and `T1`, congestion notifications from the deflect-on-drop (DoD)
//!   recirculation port to one or all pipelines.
//!
//! * [`overload`]: the switch daemon's trimming: a watermark on a shard's
//!   processing queue and the return-to-sender reply (a Trimmed nack).
//!
//! Nothing here owns a clock or a socket: every call takes `now`, packets are
//! values of a caller type implementing [`queue::Trimmable`]. The simulator
//! (`fanin-sim`) drives these types; the switch daemon can use them as is.

pub mod meter;
pub mod overload;
pub mod queue;

pub use meter::{
    Color, IngressTrimmer, IngressVerdict, Meter, MeterDesign, MeterMode, NotifyScope, PortModeState, TrimControlConfig, TrTcm,
};
pub use overload::{is_trimmable, return_to_sender, TrimCause, TrimPlan, TrimVerdict, Watermark};
pub use queue::{Class, NdpVerdict, PortQueue, QueueConfig, QueueStats, Trimmable};
