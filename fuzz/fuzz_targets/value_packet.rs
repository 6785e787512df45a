//! `value::Packet::new_checked` + `value::Repr::parse` on untrusted datagrams.
//!
//! Oracles, beyond "never panics":
//! * `Repr::parse` on an unchecked view agrees with `Packet::new_checked`
//!   (same accept/reject decision, same error);
//! * every accessor of an accepted view is in bounds, and so is the body
//!   parser of its message type (`JoinParams` for JoinAck, `Nack` for Nack,
//!   the bitmap of a ResultAck, whose `grad_cnt` counts 64-bit words);
//! * round trip: emitting the parsed `Repr` into a fresh buffer of
//!   `buffer_len()` bytes (pre-filled with a marker, so a field `emit`
//!   forgets shows) and copying the payload reproduces the input exactly,
//!   and that buffer parses back to the same `Repr`.
#![no_main]

use fanin_wire::value::{read_lanes, result_ack_holds, JoinParams, Nack, Packet, Repr};
use fanin_wire::{MessageType, Preamble};
use libfuzzer_sys::fuzz_target;

const MARKER: u8 = 0xA5;

fuzz_target!(|data: &[u8]| {
    let checked = Packet::new_checked(data);
    let parsed = Repr::parse(&Packet::new_unchecked(data));
    let (packet, repr) = match (checked, parsed) {
        (Ok(packet), Ok(repr)) => (packet, repr),
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "new_checked and Repr::parse reject for different reasons");
            let _ = a.to_string();
            return;
        }
        (a, b) => panic!("new_checked and Repr::parse disagree: {a:?} vs {b:?}"),
    };

    // The preamble of an accepted packet is valid and says the same.
    let preamble = Preamble::parse(data).expect("accepted packet has a bad preamble");
    assert_eq!(preamble.msg_type, repr.msg_type);
    assert_eq!(repr.buffer_len(), data.len(), "buffer_len differs from the datagram length");

    // Accessors of a checked view never panic.
    assert_eq!(packet.msg_type_code(), repr.msg_type as u8);
    assert_eq!(packet.grad_cnt(), repr.grad_cnt);
    let payload = packet.payload();
    if repr.msg_type.carries_block() {
        // int32 lanes, or int16 lanes for the 16-bit dtypes
        let mut values = vec![0i32; repr.grad_cnt as usize];
        read_lanes(repr.dtype, payload, &mut values);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(packet.element(i), *v);
        }
    } else if repr.msg_type == MessageType::ResultAck {
        // grad_cnt counts the bitmap's 64-bit words; every bit is readable
        assert_eq!(payload.len(), repr.grad_cnt as usize * 8);
        let held = (0..repr.grad_cnt as u32 * 64).filter(|&i| result_ack_holds(payload, i)).count();
        assert!(held <= payload.len() * 8);
        assert!(!result_ack_holds(payload, repr.grad_cnt as u32 * 64), "a bit past the body");
    } else {
        assert_eq!(repr.grad_cnt, 0, "non-block message accepted with elements");
    }
    match repr.msg_type {
        MessageType::JoinAck => {
            JoinParams::parse(payload).expect("accepted JoinAck has a bad body");
        }
        MessageType::Nack => {
            let nack = Nack::parse(payload).expect("accepted Nack has a bad body");
            let _ = nack.reason.describe();
        }
        _ => {}
    }

    // Round trip: emit(parse(x)) + payload == x.
    let mut buf = vec![MARKER; repr.buffer_len()];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut out);
    out.payload_mut().copy_from_slice(payload);
    // The parsers accept the sealed bit (the trailer was stripped before);
    // emit writes an unsealed datagram.
    buf[3] |= data[3] & fanin_wire::auth::SEALED;
    assert!(buf == data, "emit(parse(x)) != x\n  in:  {data:02x?}\n  out: {buf:02x?}\n  repr: {repr:?}");
    let again = Packet::new_checked(&buf[..]).expect("emitted packet rejected");
    assert_eq!(Repr::parse(&again).expect("emitted packet does not parse"), repr);
});
