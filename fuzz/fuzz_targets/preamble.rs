//! `preamble::Preamble::parse` on untrusted datagrams.
//!
//! Oracles: an accepted preamble re-emits to the first `PREAMBLE_LEN` bytes of
//! the input; input shorter than `PREAMBLE_LEN` is `Truncated`.
#![no_main]

use fanin_wire::{Preamble, WireError, PREAMBLE_LEN, VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let preamble = match Preamble::parse(data) {
        Ok(preamble) => preamble,
        Err(e) => {
            let _ = e.to_string();
            if data.len() < PREAMBLE_LEN {
                assert_eq!(e, WireError::Truncated { needed: PREAMBLE_LEN, got: data.len() });
            }
            return;
        }
    };
    assert!(data.len() >= PREAMBLE_LEN, "accepted fewer than {PREAMBLE_LEN} bytes");
    assert_eq!(preamble.version, VERSION);
    let _ = preamble.msg_type.carries_block();

    let mut buf = [0xA5u8; PREAMBLE_LEN];
    Preamble::emit(preamble.msg_type, &mut buf);
    // emit writes an unsealed preamble; the sealed bit is all parse dropped.
    let mut want = [data[0], data[1], data[2], data[3]];
    assert_eq!(preamble.sealed, want[3] & fanin_wire::auth::SEALED != 0);
    want[3] &= !fanin_wire::auth::SEALED;
    assert_eq!(&buf[..], &want[..], "emit(parse(x)) != x; preamble: {preamble:?}");
    assert_eq!(Preamble::parse(&buf), Ok(Preamble { sealed: false, ..preamble }));
});
