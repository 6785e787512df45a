//! Golden vectors: the bytes here are the specification in docs/kv.md.
//! Each message is checked four ways: read fields from known bytes, write
//! fields and compare bytes, parse, emit (into a buffer pre-filled with a
//! marker byte so a forgotten field shows).

use super::*;
use proptest::prelude::*;

const MARKER: u8 = 0xA5;

/// Data packet of task 0x01020304, channel 5, seq 7, two slots; slot 0 holds
/// ("ab", 3) [key part = "ab", zero padding, length byte 2], slot 1 is
/// blank, bitmap 0b01.
const DATA: [u8; 56] = [
    0xFA, 0x17, 0x01, 0x20, // magic, version 1, KvData
    0x00, 0x02, 0x00, 0x05, // flags 0; slot_count 2; channel 5
    0x01, 0x02, 0x03, 0x04, // task_id
    0x00, 0x00, 0x00, 0x07, // seq 7
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // bitmap
    b'a', b'b', 0, 0, 0, 0, 0, 2, // slot 0 key part
    0, 0, 0, 0, 0, 0, 0, 3, // slot 0 value
    0, 0, 0, 0, 0, 0, 0, 0, // slot 1 key part (blank)
    0, 0, 0, 0, 0, 0, 0, 0, // slot 1 value
];

/// Switch ACK of seq 7 on channel 5.
const ACK: [u8; 16] = [
    0xFA, 0x17, 0x01, 0x22, 0x01, 0x00, 0x00, 0x05, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x07,
];

/// Fetch of copy 1, AA 3, up to 32 entries from index 256, epoch 9.
const FETCH: [u8; 24] = [
    0xFA, 0x17, 0x01, 0x27, 0x00, 0x00, 0x00, 0x00, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x09,
    0x01, 0x03, 0x00, 0x20, 0x00, 0x00, 0x01, 0x00,
];

/// Nack: unknown task 0x01020304.
const NACK: [u8; 24] = [
    0xFA, 0x17, 0x01, 0x2C, 0x00, 0x00, 0x00, 0x05, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x07,
    0x00, 0x01, 0x00, 0x00, 0x01, 0x02, 0x03, 0x04,
];

fn key_ab() -> [u8; 8] {
    [b'a', b'b', 0, 0, 0, 0, 0, 2]
}

#[test]
fn data_read_fields() {
    let p = Packet::new_checked(&DATA[..]).unwrap();
    assert_eq!(p.msg_type(), MessageType::KvData);
    assert_eq!((p.flags(), p.slot_count(), p.channel(), p.task_id(), p.seq()), (0, 2, 5, 0x0102_0304, 7));
    assert_eq!(p.bitmap(), 1);
    assert_eq!((p.key_part(0), p.value(0)), (key_ab(), 3));
    assert_eq!((p.key_part(1), p.value(1)), ([0; 8], 0));
}

#[test]
fn data_write_fields_and_emit() {
    let repr = Repr { slot_count: 2, ..Repr::new(MessageType::KvData, 0x0102_0304, 5, 7) };
    assert_eq!(repr.buffer_len(), DATA.len());
    let mut buf = [MARKER; 56];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    p.set_bitmap(1);
    p.set_slot(0, key_ab(), 3);
    p.set_slot(1, [0; 8], 0);
    assert_eq!(buf, DATA);
    assert_eq!(Repr::parse(&Packet::new_checked(&DATA[..]).unwrap()).unwrap(), repr);
}

#[test]
fn ack_four_ways() {
    let p = Packet::new_checked(&ACK[..]).unwrap();
    assert_eq!(p.flags() & FLAG_BY_SWITCH, FLAG_BY_SWITCH);
    let repr = Repr { flags: FLAG_BY_SWITCH, ..Repr::new(MessageType::KvAck, 0x0102_0304, 5, 7) };
    assert_eq!(Repr::parse(&p).unwrap(), repr);
    let mut buf = [MARKER; 16];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert_eq!(buf, ACK);
}

#[test]
fn fetch_four_ways() {
    let p = Packet::new_checked(&FETCH[..]).unwrap();
    let req = FetchRequest::parse(p.body()).unwrap();
    assert_eq!(req, FetchRequest { copy: 1, aa: 3, max_entries: 32, start: 256 });
    let repr = Repr::new(MessageType::KvFetch, 0x0102_0304, 0, 9);
    assert_eq!(Repr::parse(&p).unwrap(), repr);
    assert_eq!(repr.buffer_len(), FETCH.len());
    let mut buf = [MARKER; 24];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut out);
    req.emit(out.body_mut());
    assert_eq!(buf, FETCH);
}

#[test]
fn nack_four_ways() {
    let p = Packet::new_checked(&NACK[..]).unwrap();
    let nack = Nack::parse(p.body()).unwrap();
    assert_eq!(nack, Nack { reason: NackReason::UnknownTask, detail: 0x0102_0304 });
    let mut buf = [MARKER; 24];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    Repr::new(MessageType::KvNack, 0x0102_0304, 5, 7).emit(&mut out);
    nack.emit(out.body_mut());
    assert_eq!(buf, NACK);
}

#[test]
fn fetch_reply_round_trip() {
    let entry = FetchEntry { index: 17, count: 2, key_part: key_ab(), sum: -5, min: -7, max: 2 };
    let head = FetchReplyHead { copy: 0, aa: 1, entry_count: 1, start: 0, next: 18 };
    let len = HEADER_LEN + FETCH_REPLY_FIXED + FETCH_ENTRY_LEN;
    let mut buf = vec![MARKER; len];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    Repr::new(MessageType::KvFetchReply, 1, 0, 3).emit(&mut p);
    head.emit(p.body_mut());
    entry.emit(&mut p.body_mut()[FETCH_REPLY_FIXED..]);
    assert!(!buf.contains(&MARKER));
    let p = Packet::new_checked(&buf[..]).unwrap();
    assert_eq!(FetchReplyHead::parse(p.body()).unwrap(), head);
    assert_eq!(FetchReplyHead::entries(p.body()).collect::<Vec<_>>(), vec![entry]);
}

#[test]
fn long_data_round_trip() {
    let keys: [&[u8]; 2] = [b"a-rather-long-key-indeed", b""];
    let len = HEADER_LEN + long_body_len(keys.iter().copied());
    let mut buf = vec![MARKER; len];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    Repr { slot_count: 2, ..Repr::new(MessageType::KvLongData, 1, 2, 3) }.emit(&mut p);
    let at = emit_long_tuple(keys[0], 11, p.body_mut());
    emit_long_tuple(keys[1], -1, &mut p.body_mut()[at..]);
    let p = Packet::new_checked(&buf[..]).unwrap();
    assert_eq!(p.long_tuples().collect::<Vec<_>>(), vec![(keys[0], 11), (keys[1], -1)]);
    // One byte short: the walk notices.
    assert!(matches!(Packet::new_checked(&buf[..len - 1]), Err(WireError::Truncated { .. })));
}

#[test]
fn key_fragment_golden_vector() {
    // one fragment of a 5 000-byte key: key_id 4, offset 1176, 9 bytes, value 7
    // (the seed `long-key-fragment` of the kv_packet fuzz target)
    let piece = b"fragment!";
    let mut buf = vec![MARKER; HEADER_LEN + FRAGMENT_FIXED + LONG_TUPLE_FIXED + piece.len()];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    Repr { flags: FLAG_KEY_FRAGMENT, slot_count: 1, ..Repr::new(MessageType::KvLongData, 1, 1, 3) }.emit(&mut p);
    emit_key_fragment(4, 5000, 1176, piece, 7, p.body_mut());
    let mut want = vec![0xFA, 0x17, 0x01, 0x21, 0x04, 0x01, 0x00, 0x01, 0, 0, 0, 1, 0, 0, 0, 3];
    want.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0x13, 0x88, 0, 0, 0x04, 0x98, 0, 9, 0, 0, 0, 0, 0, 0, 0, 7]);
    want.extend_from_slice(piece);
    assert_eq!(buf, want);
    let p = Packet::new_checked(&buf[..]).unwrap();
    let f = p.key_fragment().unwrap();
    assert_eq!((f.key_id, f.total_len, f.offset, f.bytes, f.value), (4, 5000, 1176, &piece[..], 7));
    assert_eq!(p.long_tuples().count(), 0, "a fragment is not a whole tuple");
    // beyond the key, or empty: malformed
    let mut beyond = buf.clone();
    beyond[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&4_992u32.to_be_bytes());
    assert_eq!(
        Packet::new_checked(&beyond[..]).unwrap_err(),
        WireError::FragmentOutOfRange { offset: 4_992, len: 9, total: 5_000 }
    );
    let mut two = buf.clone();
    two[5] = 2;
    assert!(matches!(Packet::new_checked(&two[..]), Err(WireError::TooManyElements { .. })));
}

#[test]
fn rejects_say_why() {
    let mut bad = DATA;
    bad[field::BODY + 7] = 0b100; // bit 2 with slot_count 2
    assert_eq!(
        Packet::new_checked(&bad[..]).unwrap_err(),
        WireError::BitmapBeyondSlots { bitmap: 0b100, slot_count: 2 }
    );
    assert!(matches!(Packet::new_checked(&DATA[..55]), Err(WireError::LengthMismatch { .. })));
    let mut flags = ACK;
    flags[4] = 0x80;
    assert_eq!(Packet::new_checked(&flags[..]).unwrap_err(), WireError::ReservedBits(0x80));
    // found by the kv_machines fuzz target: a Data packet flagged as a key
    // fragment passed the check and the receiver read its bitmap as a
    // fragment header, slicing past the end of a short body
    let mut fragment = DATA;
    fragment[4] |= FLAG_KEY_FRAGMENT;
    assert_eq!(Packet::new_checked(&fragment[..]).unwrap_err(), WireError::ReservedBits(fragment[4]));
    let mut slots = DATA;
    slots[5] = 65;
    assert!(matches!(Packet::new_checked(&slots[..]), Err(WireError::TooManyElements { .. })));
    let mut reason = NACK;
    reason[17] = 99;
    assert_eq!(Packet::new_checked(&reason[..]).unwrap_err(), WireError::UnknownNackReason(99));
    // A value-stream packet is not a key-value packet, and vice versa.
    let mut value = [0u8; 24];
    value[..4].copy_from_slice(&[0xFA, 0x17, 0x01, 0x01]);
    assert_eq!(Packet::new_checked(&value[..]).unwrap_err(), WireError::WrongService(0x01));
    assert_eq!(crate::value::Packet::new_checked(&DATA[..]).unwrap_err(), WireError::WrongService(0x20));
}

proptest! {
    #[test]
    fn never_panics_and_agrees_with_parse(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let checked = Packet::new_checked(&bytes[..]);
        let parsed = Repr::parse(&Packet::new_unchecked(&bytes[..]));
        prop_assert_eq!(checked.is_ok(), parsed.is_ok());
        if let Ok(p) = checked {
            let _ = (p.bitmap(), p.long_tuples().count());
            if p.msg_type() == MessageType::KvData {
                for i in 0..p.slot_count() as usize { let _ = (p.key_part(i), p.value(i)); }
            }
        }
    }

    #[test]
    fn data_round_trips(slots in 0usize..=8, bitmap: u64, seq: u32, vals in proptest::collection::vec(any::<i64>(), 8)) {
        let bitmap = bitmap & slot_mask(slots);
        let repr = Repr { slot_count: slots as u8, ..Repr::new(MessageType::KvData, 9, 1, seq) };
        let mut buf = vec![MARKER; repr.buffer_len()];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut p);
        p.set_bitmap(bitmap);
        for (i, v) in vals.iter().enumerate().take(slots) { p.set_slot(i, (i as u64).to_be_bytes(), *v); }
        let p = Packet::new_checked(&buf[..]).unwrap();
        prop_assert_eq!(Repr::parse(&p).unwrap(), repr);
        prop_assert_eq!(p.bitmap(), bitmap);
        for (i, v) in vals.iter().enumerate().take(slots) { prop_assert_eq!(p.value(i), *v); }
    }
}

/// The switch ACK above, sealed (docs/protocol.md §2.4, docs/kv.md §2.1):
/// task key 00 01 .. 0f, the member key of channel 5 of task 0x01020304,
/// seq 0x0000_0102_0304_0506. Pins that key-value datagrams take the same
/// trailer and derivation as value datagrams (channel in place of src_id).
const SEALED_ACK: [u8; 32] = [
    0xFA, 0x17, 0x01, 0xA2, 0x01, 0x00, 0x00, 0x05, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x07, // Ack | SEALED
    0x00, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, // seq
    0x94, 0x66, 0xCA, 0x77, 0x25, 0x29, 0xC1, 0x26, // tag
];

#[test]
fn golden_sealed_ack() {
    use crate::auth::{derive_member_key, open, seal, Key};
    let task_key = Key(core::array::from_fn(|i| i as u8));
    let key = derive_member_key(&task_key, 0x0102_0304, 5);
    let mut buf = [MARKER; 32];
    buf[..16].copy_from_slice(&ACK);
    seal(&key, 0x0000_0102_0304_0506, &mut buf).unwrap();
    assert_eq!(&buf[..24], &SEALED_ACK[..24]);
    assert_eq!(buf, SEALED_ACK);
    // Opened, the inner datagram parses as the Ack, with the sealed bit.
    let (inner, seq) = open(&key, &SEALED_ACK).unwrap();
    assert_eq!(seq, 0x0000_0102_0304_0506);
    let p = Packet::new_checked(inner).unwrap();
    assert_eq!(p.msg_type(), MessageType::KvAck);
    assert_eq!(Repr::parse(&p).unwrap(), Repr::parse(&Packet::new_checked(&ACK[..]).unwrap()).unwrap());
    // Not opened, the trailer is 16 bytes the Ack does not have.
    assert!(matches!(Packet::new_checked(&SEALED_ACK[..]), Err(WireError::LengthMismatch { .. })));
}
