//! fanin's packet-level discrete-event simulator.
//!
//! htsim's shape (event list, queue, pipe, route) with three differences:
//! nothing is global (a [`net::Sim`] owns its event list and its seeded
//! generators, so several simulations run in one process and a run is a pure
//! function of its configuration), queue disciplines are fanin-proto's sans-IO
//! code (`fanin_proto::trim`) rather than simulator-only models, and the
//! experiments are library functions whose tests fail on a mismatch.
//!
//! * [`kernel`]: the (time, sequence)-ordered event list, picosecond time.
//! * [`net`]: hosts, switches, ports (queue + link), switch models (drop-tail,
//!   ideal NDP trimming, mirror-on-drop, the Tofino design), NDP hosts.
//! * [`topo`]: one switch, leaf-spine, fat-tree k; [`permutation`]: a
//!   permutation workload on any of them.
//! * [`trimming`]: the trimming paper's simulation study (Figs. 5-9).
//! * [`allreduce`]: one `ValueSwitch` and N `AllreduceSession` workers.
//! * [`scale`]: fanin's tree vs ring at scale; [`goat`]: a GOAT plan (PS + responsibility filters).

pub mod allreduce;
pub mod fabric;
pub mod goat;
pub mod e2e;
pub mod kernel;
pub mod ndp;
pub mod net;
pub mod packet;
pub mod permutation;
pub mod scale;
pub mod topo;
pub mod trimming;
