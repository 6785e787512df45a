//! `kv::Packet::new_checked` + `kv::Repr::parse` on untrusted datagrams.
//!
//! Oracles, beyond "never panics":
//! * `Repr::parse` on an unchecked view agrees with `Packet::new_checked`
//!   (same accept/reject decision, same error);
//! * every accessor of an accepted view is in bounds, and so is the body
//!   parser of its message type (`FetchRequest`, `FetchReplyHead` + entries,
//!   `Nack`, the `LongData` tuple walk or key fragment, the `Data` slots);
//! * an accepted `Data` packet has no bitmap bit beyond `slot_count`;
//! * round trip: emitting the parsed `Repr` into a buffer pre-filled with a
//!   marker and copying the body reproduces the input exactly.
#![no_main]

use fanin_wire::kv::{slot_mask, FetchReplyHead, FetchRequest, Nack, Packet, Repr, FLAG_KEY_FRAGMENT, HEADER_LEN};
use fanin_wire::MessageType;
use libfuzzer_sys::fuzz_target;

const MARKER: u8 = 0xA5;

fuzz_target!(|data: &[u8]| {
    let checked = Packet::new_checked(data);
    let parsed = Repr::parse(&Packet::new_unchecked(data));
    let (packet, repr) = match (checked, parsed) {
        (Ok(p), Ok(r)) => (p, r),
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "new_checked and Repr::parse reject for different reasons");
            let _ = (a.to_string(), a.kind());
            return;
        }
        (a, b) => panic!("new_checked and Repr::parse disagree: {a:?} vs {b:?}"),
    };
    assert!(repr.msg_type.is_kv());
    assert_eq!(packet.msg_type(), repr.msg_type);
    let body = packet.body();
    match repr.msg_type {
        MessageType::KvData => {
            assert_eq!(packet.bitmap() & !slot_mask(repr.slot_count as usize), 0);
            for i in 0..repr.slot_count as usize {
                let _ = (packet.key_part(i), packet.value(i));
            }
            assert_eq!(repr.buffer_len(), data.len());
        }
        MessageType::KvLongData if repr.flags & FLAG_KEY_FRAGMENT != 0 => {
            let f = packet.key_fragment().expect("accepted key fragment does not parse");
            assert!(!f.bytes.is_empty() && f.offset as u64 + f.bytes.len() as u64 <= f.total_len as u64);
            assert_eq!(packet.long_tuples().count(), 0);
        }
        MessageType::KvLongData => {
            let n = packet.long_tuples().count();
            assert_eq!(n, repr.slot_count as usize, "the tuple walk disagrees with the check");
            assert!(packet.key_fragment().is_none());
        }
        MessageType::KvFetch => {
            FetchRequest::parse(body).expect("accepted Fetch has a bad body");
        }
        MessageType::KvFetchReply => {
            let head = FetchReplyHead::parse(body).expect("accepted FetchReply has a bad body");
            assert_eq!(FetchReplyHead::entries(body).count(), head.entry_count as usize);
        }
        MessageType::KvNack => {
            let _ = Nack::parse(body).expect("accepted Nack has a bad body").reason.describe();
        }
        _ => assert_eq!(repr.buffer_len(), data.len()),
    }
    let mut buf = vec![MARKER; data.len()];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut out);
    out.body_mut().copy_from_slice(&data[HEADER_LEN..]);
    // The parser accepts the sealed bit (the trailer was stripped before);
    // emit writes an unsealed datagram.
    buf[3] |= data[3] & fanin_wire::auth::SEALED;
    assert!(buf == data, "emit(parse(x)) != x\n  in:  {data:02x?}\n  out: {buf:02x?}");
});
