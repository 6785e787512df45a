//! `value::JoinParams::parse` on an untrusted JoinAck body.
//!
//! Oracles: a body of at least `LEN` bytes parses (a shorter one is
//! `Truncated`), and emit(parse(x)) equals the first `LEN` bytes of x with the
//! reserved field (bytes 18..20) zeroed.
#![no_main]

use fanin_wire::value::JoinParams;
use fanin_wire::WireError;
use libfuzzer_sys::fuzz_target;

const LEN: usize = JoinParams::LEN;
const RESERVED: core::ops::Range<usize> = 18..20;

fuzz_target!(|data: &[u8]| {
    let params = match JoinParams::parse(data) {
        Ok(params) => params,
        Err(e) => {
            let _ = e.to_string();
            if data.len() < LEN {
                assert_eq!(e, WireError::Truncated { needed: LEN, got: data.len() });
            }
            return;
        }
    };
    assert!(data.len() >= LEN, "accepted a body shorter than {LEN} bytes");

    let mut buf = [0xA5u8; LEN];
    params.emit(&mut buf);
    let mut expected = [0u8; LEN];
    expected.copy_from_slice(&data[..LEN]);
    expected[RESERVED].fill(0);
    assert_eq!(buf, expected, "emit(parse(x)) != x; params: {params:?}");
    assert_eq!(JoinParams::parse(&buf), Ok(params));
});
