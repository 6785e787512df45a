//! `value::Nack::parse` on an untrusted Nack body.
//!
//! Oracles: a body shorter than `LEN` is `Truncated`; an accepted body
//! round-trips through emit (with the reserved bytes 2..4 zeroed).
#![no_main]

use fanin_wire::value::Nack;
use fanin_wire::WireError;
use libfuzzer_sys::fuzz_target;

const LEN: usize = Nack::LEN;
const RESERVED: core::ops::Range<usize> = 2..4;

fuzz_target!(|data: &[u8]| {
    let nack = match Nack::parse(data) {
        Ok(nack) => nack,
        Err(e) => {
            let _ = e.to_string();
            if data.len() < LEN {
                assert_eq!(e, WireError::Truncated { needed: LEN, got: data.len() });
            }
            return;
        }
    };
    assert!(data.len() >= LEN, "accepted a body shorter than {LEN} bytes");
    assert!(!nack.reason.describe().is_empty());

    let mut buf = [0xA5u8; LEN];
    nack.emit(&mut buf);
    let mut expected = [0u8; LEN];
    expected.copy_from_slice(&data[..LEN]);
    expected[RESERVED].fill(0);
    assert_eq!(buf, expected, "emit(parse(x)) != x; nack: {nack:?}");
    assert_eq!(Nack::parse(&buf), Ok(nack));
});
