//! fanin packet formats.
//!
//! Every fanin datagram starts with a common 4-byte [preamble](preamble): magic,
//! version and message type. The rest depends on the service the message type
//! belongs to; this crate currently defines the value-stream (gradient)
//! aggregation service of Trio-ML / SwitchML in [`value`] and the key-value
//! aggregation service of ASK in [`kv`].
//!
//! Each message comes in two layers, as in smoltcp's `wire` module:
//! a zero-copy view over a byte buffer ([`value::Packet`]) whose accessors never
//! panic once [`value::Packet::new_checked`] has accepted the buffer, and a plain
//! parsed representation ([`value::Repr`]) with `parse`, `emit` and `buffer_len`.
//! `emit` into a buffer of exactly `buffer_len()` bytes never panics.
//!
//! All integers are in network byte order. `docs/protocol.md` is the
//! specification; the golden vectors in the tests pin it.

pub mod auth;
pub mod kv;
pub mod preamble;
pub mod simd;
pub mod value;

mod error;

pub use error::WireError;
pub use preamble::{MessageType, Preamble, MAGIC, PREAMBLE_LEN, VERSION};

/// A small deterministic generator for the crate's randomised tests
/// (xorshift64; `seed` must not be 0).
#[cfg(test)]
pub(crate) fn test_rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Largest UDP payload an IPv4 datagram can carry; no fanin packet is longer.
pub const MAX_DATAGRAM: usize = 65_507;
