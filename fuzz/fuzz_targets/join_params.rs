//! `value::JoinParams::parse` on an untrusted JoinAck body.
//!
//! Oracles: a body of at least `LEN` bytes parses (a shorter one is
//! `Truncated`), and emit(parse(x)) equals the first `LEN` bytes of x with the
//! flags field (bytes 18..20) reduced to its defined bits,
//! `JOINACK_RESULTS_ON_GROUP`, `JOINACK_PARTIAL_RESULTS`,
//! `JOINACK_RESULT_KEY` and the high byte, `order_shards` (the others are
//! ignored on receipt and sent as 0), and the result key's 16 bytes zeroed
//! unless `JOINACK_RESULT_KEY` is set; the order classes are
//! `shard_count`'s for 0, none for `ORDER_ANY`, else the byte.
#![no_main]

use fanin_wire::value::{JoinParams, JOINACK_PARTIAL_RESULTS, JOINACK_RESULTS_ON_GROUP, JOINACK_RESULT_KEY, ORDER_ANY};
use fanin_wire::WireError;
use libfuzzer_sys::fuzz_target;

const LEN: usize = JoinParams::LEN;
const FLAGS: core::ops::Range<usize> = 18..20;

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
    let defined = JOINACK_RESULTS_ON_GROUP | JOINACK_PARTIAL_RESULTS | JOINACK_RESULT_KEY | 0xFF00;
    let flags = u16::from_be_bytes([expected[18], expected[19]]) & defined;
    expected[FLAGS].copy_from_slice(&flags.to_be_bytes());
    if flags & JOINACK_RESULT_KEY == 0 {
        expected[28..48].fill(0); // the wrapped key and its epoch
    }
    assert_eq!(params.result_key.is_some(), flags & JOINACK_RESULT_KEY != 0);
    assert_eq!(params.results_on_group, flags & JOINACK_RESULTS_ON_GROUP != 0);
    assert_eq!(params.partial_results, flags & JOINACK_PARTIAL_RESULTS != 0);
    assert_eq!(params.order_shards as u16, flags >> 8);
    let classes = match params.order_shards {
        0 => Some(params.shard_count.max(1)),
        ORDER_ANY => None,
        n => Some(n as u16),
    };
    assert_eq!(params.order_classes(), classes);
    assert_eq!(buf, expected, "emit(parse(x)) != x; params: {params:?}");
    assert_eq!(JoinParams::parse(&buf), Ok(params));
});
