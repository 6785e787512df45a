//! Golden vectors: the bytes here are the specification in docs/protocol.md.
//! Each message is checked four ways: read fields from known bytes, write
//! fields and compare bytes, parse, emit (into a buffer pre-filled with a
//! marker byte so a forgotten field shows).

use super::*;
use proptest::prelude::*;

const MARKER: u8 = 0xA5;

/// A contribution from src 3 of job 0x01020304, block 0x0A0B0C0D, gen 7,
/// float32, final, exponent 5, next exponent -2, two elements 1 and -1.
const CONTRIBUTION: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x01, // magic, version 1, Contribution
    0x08, 0x01, 0x00, 0x03, // flags: final; dtype float32; src_id 3
    0x00, 0x00, 0x00, 0x07, // src_cnt 0; gen_id 7
    0x01, 0x02, 0x03, 0x04, // job_id
    0x0A, 0x0B, 0x0C, 0x0D, // block_id
    0x00, 0x02, 0x05, 0xFE, // grad_cnt 2; exp 5; next_exp -2
    0x00, 0x00, 0x00, 0x01, // 1
    0xFF, 0xFF, 0xFF, 0xFF, // -1
];

fn contribution_repr() -> Repr {
    Repr {
        msg_type: MessageType::Contribution,
        age_op: 0,
        final_block: true,
        degraded: false,
        exp_only: false,
        no_data: false,
        dtype: Dtype::Float32,
        src_id: 3,
        src_cnt: 0,
        gen_id: 7,
        job_id: 0x0102_0304,
        block_id: 0x0A0B_0C0D,
        grad_cnt: 2,
        exp: 5,
        next_exp: -2,
    }
}

/// A degraded, aged result (age_op 1) summing 3 sources, int32, one element.
const RESULT: [u8; 28] = [
    0xFA, 0x17, 0x01, 0x03, // Result
    0x14, 0x00, 0x00, 0x00, // age_op 1, degraded; int32; src_id 0
    0x00, 0x03, 0xFF, 0xFF, // src_cnt 3; gen_id 65535
    0x00, 0x00, 0x00, 0x2A, // job_id 42
    0xFF, 0xFF, 0xFF, 0xFF, // block_id 2^32-1
    0x00, 0x01, 0x80, 0x80, // grad_cnt 1; exp NONE; next_exp NONE
    0x7F, 0xFF, 0xFF, 0xFF, // i32::MAX
];

/// JoinAck for job 9, src 2 of 4.
const JOIN_ACK: [u8; 72] = [
    0xFA, 0x17, 0x01, 0x05, // JoinAck
    0x00, 0x00, 0x00, 0x02, // flags; int32; src_id 2
    0x00, 0x04, 0x00, 0x00, // src_cnt 4; gen_id 0
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x00, 0x00, 0x00, 0x00, // block_id
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x00, 0x01, 0x00, // block_cnt_max 256
    0x00, 0x00, 0x04, 0x00, // block_grad_max 1024
    0x00, 0x00, 0x00, 0x0A, // block_exp_ms 10
    0xDE, 0xAD, 0xBE, 0xEF, // incarnation
    0x00, 0x02, 0x00, 0x00, // shard_count 2; flags
    0x00, 0x00, 0x10, 0x00, // next_block 4096
    0x00, 0x00, 0x01, 0x66, // packet_elems 358 (a 1500-byte MTU)
    0x00, 0x00, 0x00, 0x00, // result_key: zeros, flags bit 2 clear
    0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, // result_epoch: zero too
];

/// Nack: not a member, detail 17.
const NACK: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x06, 0x00, 0x00, 0x00, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x09,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x80, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x11,
];

#[test]
fn contribution_read_fields() {
    let p = Packet::new_checked(&CONTRIBUTION[..]).unwrap();
    assert_eq!(p.msg_type_code(), 0x01);
    assert!(p.final_block() && !p.degraded() && !p.exp_only());
    assert_eq!(p.age_op(), 0);
    assert_eq!(p.dtype_code(), 1);
    assert_eq!((p.src_id(), p.src_cnt(), p.gen_id()), (3, 0, 7));
    assert_eq!((p.job_id(), p.block_id()), (0x0102_0304, 0x0A0B_0C0D));
    assert_eq!((p.grad_cnt(), p.exp(), p.next_exp()), (2, 5, -2));
    assert_eq!((p.element(0), p.element(1)), (1, -1));
}

#[test]
fn contribution_write_fields() {
    let mut buf = [MARKER; 32];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    p.set_msg_type(MessageType::Contribution);
    p.set_flags(0, true, false, false, false);
    p.set_dtype(Dtype::Float32);
    p.set_src_id(3);
    p.set_src_cnt(0);
    p.set_gen_id(7);
    p.set_job_id(0x0102_0304);
    p.set_block_id(0x0A0B_0C0D);
    p.set_grad_cnt(2);
    p.set_exp(5);
    p.set_next_exp(-2);
    write_elements(&[1, -1], p.payload_mut());
    assert_eq!(buf, CONTRIBUTION);
}

#[test]
fn contribution_parse_and_emit() {
    let repr = Repr::parse(&Packet::new_checked(&CONTRIBUTION[..]).unwrap()).unwrap();
    assert_eq!(repr, contribution_repr());
    assert_eq!(repr.buffer_len(), CONTRIBUTION.len());
    let mut buf = [MARKER; 32];
    let mut p = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut p);
    write_elements(&[1, -1], p.payload_mut());
    assert_eq!(buf, CONTRIBUTION);
}

#[test]
fn result_parse_and_emit() {
    let p = Packet::new_checked(&RESULT[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr.msg_type, MessageType::Result);
    assert_eq!((repr.age_op, repr.degraded, repr.final_block), (1, true, false));
    assert_eq!((repr.src_cnt, repr.gen_id, repr.job_id, repr.block_id), (3, 0xFFFF, 42, u32::MAX));
    assert_eq!((repr.exp, repr.next_exp), (EXP_NONE, EXP_NONE));
    let mut out = [0i32; 1];
    read_elements(p.payload(), &mut out);
    assert_eq!(out, [i32::MAX]);
    let mut buf = [MARKER; 28];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut q);
    write_elements(&out, q.payload_mut());
    assert_eq!(buf, RESULT);
}

#[test]
fn join_ack_parse_and_emit() {
    let p = Packet::new_checked(&JOIN_ACK[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr.msg_type, MessageType::JoinAck);
    let params = JoinParams::parse(p.payload()).unwrap();
    assert_eq!(
        params,
        JoinParams {
            block_cnt_max: 256,
            block_grad_max: 1024,
            block_exp_ms: 10,
            incarnation: 0xDEAD_BEEF,
            shard_count: 2,
            next_block: 4096,
            results_on_group: false,
            partial_results: false,
            packet_elems: 358,
            order_shards: 0,
            result_key: None,
        }
    );
    let mut buf = [MARKER; 72];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut q);
    params.emit(q.payload_mut());
    assert_eq!(buf, JOIN_ACK);
}

#[test]
fn order_shards_travel_in_the_high_byte_of_the_join_ack_flags() {
    let p = Packet::new_checked(&JOIN_ACK[..]).unwrap();
    let mut params = JoinParams::parse(p.payload()).unwrap();
    assert_eq!((params.order_shards, params.order_classes()), (0, Some(2)), "0: the shard count's order");
    params.order_shards = 10;
    let mut body = [0u8; JoinParams::LEN];
    params.emit(&mut body);
    assert_eq!(body[18], 10, "flags bits 8..15");
    assert_eq!(JoinParams::parse(&body).unwrap(), params);
    assert_eq!(params.order_classes(), Some(10));
    params.order_shards = ORDER_ANY;
    assert_eq!(params.order_classes(), None);
    // below a switch: the lcm of its shards and the upstream's classes
    assert_eq!(order_shards_below(Some(5), 1), 5);
    assert_eq!(order_shards_below(Some(4), 2), 4, "lcm 4, not the own 2");
    assert_eq!(order_shards_below(Some(2), 4), 0, "lcm = own shard count");
    assert_eq!(order_shards_below(Some(6), 4), 12);
    assert_eq!(order_shards_below(Some(1), 8), 0);
    assert_eq!(order_shards_below(Some(200), 3), ORDER_ANY, "600 classes do not fit a byte");
    assert_eq!(order_shards_below(None, 1), ORDER_ANY);
}

#[test]
fn golden_join_ack_with_results_on_the_group() {
    // the same JoinAck with flags bit 0 (offset 24 + 19) set
    let mut golden = JOIN_ACK;
    golden[43] = 0x01;
    let p = Packet::new_checked(&golden[..]).unwrap();
    let params = JoinParams::parse(p.payload()).unwrap();
    assert!(params.results_on_group);
    assert_eq!(params.next_block, 4096);
    let mut buf = golden;
    buf[24..].fill(MARKER);
    params.emit(&mut buf[24..]);
    assert_eq!(buf, golden);
    // other flag bits are ignored on receipt
    golden[42] = 0x80;
    assert!(JoinParams::parse(&golden[24..]).unwrap().results_on_group);
}

#[test]
fn golden_join_ack_with_a_wrapped_result_key() {
    // flags bits 0 and 2 (offset 24 + 19): on the group, the 16 bytes at
    // body offset 28 are the wrapped result key, the 4 at 44 its epoch
    let mut golden = JOIN_ACK;
    golden[43] = 0x05;
    for (i, b) in golden[52..68].iter_mut().enumerate() {
        *b = 0xA0 + i as u8;
    }
    golden[68..72].copy_from_slice(&[0x00, 0x00, 0x01, 0x02]);
    let params = JoinParams::parse(&golden[24..]).unwrap();
    let want: [u8; 16] = core::array::from_fn(|i| 0xA0 + i as u8);
    assert_eq!(params.result_key, Some(WrappedResultKey { epoch: 0x0102, wrapped: want }));
    assert!(params.results_on_group);
    let mut buf = golden;
    buf[24..].fill(MARKER);
    params.emit(&mut buf[24..]);
    assert_eq!(buf, golden);
    // without bit 2 the bytes are not a key, whatever they hold
    golden[43] = 0x01;
    assert_eq!(JoinParams::parse(&golden[24..]).unwrap().result_key, None);
}

#[test]
fn a_join_listening_on_the_group_sets_the_final_bit() {
    let repr = Repr { final_block: true, ..Repr::new(MessageType::Join, 9, 2) };
    let mut buf = [0u8; HEADER_LEN];
    repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert_eq!(buf[4], 0x08, "F bit of the flags byte");
    let p = Packet::new_checked(&buf[..]).unwrap();
    assert!(p.listens_on_group());
    let plain = Repr::new(MessageType::Join, 9, 2);
    plain.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert!(!Packet::new_checked(&buf[..]).unwrap().listens_on_group());
}

#[test]
fn nack_parse_and_emit() {
    let p = Packet::new_checked(&NACK[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    let nack = Nack::parse(p.payload()).unwrap();
    assert_eq!(nack, Nack { reason: NackReason::NotMember, detail: 17 });
    assert_eq!(repr.src_id, 17);
    let mut buf = [MARKER; 32];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut q);
    nack.emit(q.payload_mut());
    assert_eq!(buf, NACK);
}

#[test]
fn rejects_truncated_packets() {
    for len in 0..HEADER_LEN {
        assert!(matches!(
            Packet::new_checked(&CONTRIBUTION[..len]),
            Err(WireError::Truncated { .. })
        ));
    }
}

#[test]
fn rejects_inconsistent_lengths() {
    // one element missing
    assert_eq!(
        Packet::new_checked(&CONTRIBUTION[..28]).unwrap_err(),
        WireError::LengthMismatch { expected: 32, got: 28 }
    );
    // trailing garbage
    let mut long = CONTRIBUTION.to_vec();
    long.push(0);
    assert_eq!(
        Packet::new_checked(&long[..]).unwrap_err(),
        WireError::LengthMismatch { expected: 32, got: 33 }
    );
}

#[test]
fn rejects_bad_magic_version_type_dtype_flags() {
    let mut b = CONTRIBUTION;
    b[0] = 0x00;
    assert!(matches!(Packet::new_checked(&b[..]), Err(WireError::BadMagic { found: 0x0017, .. })));
    let mut b = CONTRIBUTION;
    b[2] = 2;
    assert_eq!(
        Packet::new_checked(&b[..]).unwrap_err(),
        WireError::UnsupportedVersion { found: 2, supported: 1 }
    );
    let mut b = CONTRIBUTION;
    b[3] = 0x7F;
    assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), WireError::UnknownMessageType(0x7F));
    let mut b = CONTRIBUTION;
    b[5] = 9;
    assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), WireError::UnknownDtype(9));
}

#[test]
fn no_data_is_a_block_message_flag_and_a_result_with_it_has_no_body() {
    // a contribution whose sender owns no part of the block's sum
    let mut b = CONTRIBUTION;
    b[4] |= 1;
    let p = Packet::new_checked(&b[..]).unwrap();
    assert!(p.no_data() && Repr::parse(&p).unwrap().no_data);
    // the bit is reserved on every other message type
    let mut join = [0u8; HEADER_LEN];
    let repr = Repr::new(MessageType::Join, 1, 0);
    repr.emit(&mut Packet::new_unchecked(&mut join[..]));
    join[4] |= 1;
    assert_eq!(Packet::new_checked(&join[..]).unwrap_err(), WireError::ReservedBits(0x01));
    // a result without data: header only, 24 bytes
    let ack = Repr { no_data: true, src_cnt: 3, block_id: 9, ..Repr::new(MessageType::Result, 1, 0) };
    let mut buf = vec![0u8; ack.buffer_len()];
    assert_eq!(buf.len(), HEADER_LEN);
    ack.emit(&mut Packet::new_unchecked(&mut buf[..]));
    // docs/protocol.md §9, "Result without data"
    let golden = [
        0xfa, 0x17, 0x01, 0x03, 0x01, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,
        0x09, 0x00, 0x00, 0x80, 0x80,
    ];
    assert_eq!(buf, golden);
    assert_eq!(Repr::parse(&Packet::new_checked(&buf[..]).unwrap()).unwrap(), ack);
    // ... and one that claims elements is malformed
    let mut b = RESULT;
    b[4] |= 1;
    assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), WireError::NoDataWithPayload(1));
}

#[test]
fn a_data_message_cut_at_its_header_is_a_trimmed_header_and_nothing_else_is() {
    // docs/protocol.md §4.14: a trimming link cut the lanes, kept the header
    for whole in [&CONTRIBUTION[..], &RESULT[..]] {
        let cut = &whole[..HEADER_LEN];
        assert!(matches!(Packet::new_checked(cut), Err(WireError::LengthMismatch { got: HEADER_LEN, .. })));
        let p = Packet::trimmed_header(cut).expect("a trimmed header");
        let whole = Packet::new_checked(whole).unwrap();
        assert_eq!((p.msg_type_code(), p.job_id(), p.src_id(), p.block_id()), (whole.msg_type_code(), whole.job_id(), whole.src_id(), whole.block_id()));
        assert_eq!(p.grad_cnt(), whole.grad_cnt());
    }
    // a whole datagram, a cut anywhere else, a header of a type without
    // lanes, an exponent-only round and a no-data result are not trims
    assert!(Packet::trimmed_header(&CONTRIBUTION[..]).is_none());
    assert!(Packet::trimmed_header(&CONTRIBUTION[..HEADER_LEN + 4]).is_none());
    assert!(Packet::trimmed_header(&CONTRIBUTION[..HEADER_LEN - 1]).is_none());
    let join = Repr::new(MessageType::Join, 1, 0);
    let mut buf = vec![0u8; join.buffer_len()];
    join.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert!(Packet::trimmed_header(&buf[..]).is_none());
    for repr in [
        Repr { exp_only: true, ..Repr::new(MessageType::Contribution, 1, 0) },
        Repr { no_data: true, ..Repr::new(MessageType::Result, 1, 0) },
    ] {
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf.len(), HEADER_LEN);
        assert!(Packet::new_checked(&buf[..]).is_ok(), "a valid header-only message");
        assert!(Packet::trimmed_header(&buf[..]).is_none());
    }
    // a corrupted header is malformed, not a trim
    let mut bad = CONTRIBUTION;
    bad[0] ^= 0xFF;
    assert!(Packet::trimmed_header(&bad[..HEADER_LEN]).is_none());
    assert_eq!(TrimCause::from_detail(4), Some(TrimCause::Network));
}

#[test]
fn rejects_oversized_grad_cnt() {
    let mut b = CONTRIBUTION;
    b[20] = 0xFF;
    b[21] = 0xFF;
    assert_eq!(
        Packet::new_checked(&b[..]).unwrap_err(),
        WireError::TooManyElements { grad_cnt: 0xFFFF, max: MAX_GRAD_CNT }
    );
}

#[test]
fn rejects_exp_only_with_payload() {
    let mut b = CONTRIBUTION;
    b[4] |= FLAG_EXP_ONLY;
    assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), WireError::ExpOnlyWithPayload(2));
}

#[test]
fn largest_packet_fits_one_datagram() {
    const { assert!(HEADER_LEN + MAX_GRAD_CNT * ELEM_LEN <= crate::MAX_DATAGRAM) };
    const { assert!(MAX_GRAD_CNT >= 16_000) };
}

fn arb_repr() -> impl Strategy<Value = Repr> {
    (
        prop_oneof![
            Just(MessageType::Contribution),
            Just(MessageType::Retransmission),
            Just(MessageType::Result)
        ],
        0u8..16,
        any::<(bool, bool)>(),
        0u8..4,
        any::<(u16, u16, u16, u32, u32)>(),
        0u16..300,
        any::<(i8, i8)>(),
    )
        .prop_map(|(msg_type, age_op, (f, d), dt, (s, c, g, j, b), n, (e, ne))| Repr {
            msg_type,
            age_op,
            final_block: f,
            degraded: d,
            exp_only: false,
            // a result without data has no body
            no_data: msg_type != MessageType::Result || n == 0,
            dtype: Dtype::from_u8(dt).unwrap(),
            src_id: s,
            src_cnt: c,
            gen_id: g,
            job_id: j,
            block_id: b,
            grad_cnt: n,
            exp: e,
            next_exp: ne,
        })
}

proptest! {
    #[test]
    fn emit_then_parse_round_trips(repr in arb_repr(), seed in any::<i32>()) {
        let mut buf = vec![MARKER; repr.buffer_len()];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut p);
        // values that fit the dtype's lanes (int16 for 16-bit dtypes)
        let fit = |v: i32| if repr.dtype.lane_len() == 2 { v as i16 as i32 } else { v };
        let values: Vec<i32> = (0..repr.grad_cnt as i32).map(|i| fit(i.wrapping_mul(seed))).collect();
        write_lanes(repr.dtype, &values, p.payload_mut());
        let checked = Packet::new_checked(&buf[..]).unwrap();
        prop_assert_eq!(Repr::parse(&checked).unwrap(), repr);
        let mut back = vec![0; values.len()];
        read_lanes(repr.dtype, checked.payload(), &mut back);
        prop_assert_eq!(back, values);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(p) = Packet::new_checked(&bytes[..]) {
            let repr = Repr::parse(&p).unwrap();
            prop_assert_eq!(repr.buffer_len(), bytes.len());
            for i in 0..p.grad_cnt() as usize { let _ = p.element(i); }
        }
    }
}

/// Membership notice for job 5: source 3 declared permanently slow at block
/// 0x100, the job now waits for 7 sources.
const MEMBERSHIP: [u8; 24] = [
    0xFA, 0x17, 0x01, 0x07, // Membership
    0x10, 0x00, 0x00, 0x03, // age_op 1 (slow); int32; src_id 3
    0x00, 0x07, 0x00, 0x02, // src_cnt 7; gen_id 2
    0x00, 0x00, 0x00, 0x05, // job_id 5
    0x00, 0x00, 0x01, 0x00, // block_id 256
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
];

#[test]
fn membership_parse_and_emit() {
    let p = Packet::new_checked(&MEMBERSHIP[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr.msg_type, MessageType::Membership);
    assert_eq!((repr.age_op, repr.src_id, repr.src_cnt), (MEMBERSHIP_SLOW, 3, 7));
    assert_eq!((repr.job_id, repr.block_id, repr.gen_id), (5, 256, 2));
    let expected = Repr {
        age_op: MEMBERSHIP_SLOW,
        src_cnt: 7,
        gen_id: 2,
        block_id: 256,
        ..Repr::new(MessageType::Membership, 5, 3)
    };
    assert_eq!(repr, expected);
    let mut buf = [MARKER; 24];
    expected.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert_eq!(buf, MEMBERSHIP);
    // a Membership notice carries no body
    let mut long = MEMBERSHIP.to_vec();
    long.push(0);
    assert!(Packet::new_checked(&long[..]).is_err());
}

#[test]
fn block_expired_nack_round_trips() {
    let mut body = [0u8; Nack::LEN];
    Nack { reason: NackReason::BlockExpired, detail: 77 }.emit(&mut body);
    assert_eq!(body, [0, 9, 0, 0, 0, 0, 0, 77]);
    assert_eq!(Nack::parse(&body).unwrap(), Nack { reason: NackReason::BlockExpired, detail: 77 });
}

/// Trimmed nack (return-to-sender): job 9, src 3, gen 7, block 0x0A0B0C0D,
/// float32, echoing the trimmed exponent-only contribution's `exp_only` flag;
/// reason 10 Trimmed, detail 1 (TrimCause::ProcessingQueue).
const TRIM_NACK: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x06, // Nack
    0x02, 0x01, 0x00, 0x03, // flags: exp_only; float32; src_id 3
    0x00, 0x00, 0x00, 0x07, // src_cnt 0; gen_id 7
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x0A, 0x0B, 0x0C, 0x0D, // block_id
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x0A, 0x00, 0x00, // reason 10 Trimmed; reserved
    0x00, 0x00, 0x00, 0x01, // detail: cause 1, processing queue
];

#[test]
fn trim_nack_four_ways() {
    let p = Packet::new_checked(&TRIM_NACK[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.src_id(), p.gen_id(), p.job_id()), (0x06, 3, 7, 9));
    assert_eq!((p.block_id(), p.grad_cnt()), (0x0A0B_0C0D, 0));
    assert!(p.exp_only() && !p.final_block() && !p.degraded());
    let repr = Repr::parse(&p).unwrap();
    let expected = Repr {
        exp_only: true,
        no_data: false,
        dtype: Dtype::Float32,
        gen_id: 7,
        block_id: 0x0A0B_0C0D,
        ..Repr::new(MessageType::Nack, 9, 3)
    };
    assert_eq!(repr, expected);
    let nack = Nack::parse(p.payload()).unwrap();
    assert_eq!(nack, Nack { reason: NackReason::Trimmed, detail: TrimCause::ProcessingQueue as u32 });
    assert_eq!(TrimCause::from_detail(nack.detail), Some(TrimCause::ProcessingQueue));
    assert_eq!(TrimCause::from_detail(77), None, "unknown causes are tolerated");
    let mut buf = [MARKER; 32];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    expected.emit(&mut q);
    nack.emit(q.payload_mut());
    assert_eq!(buf, TRIM_NACK);
    // one past the last reason is still malformed
    let mut bad = TRIM_NACK;
    bad[25] = 15;
    assert_eq!(Packet::new_checked(&bad[..]).unwrap_err(), WireError::UnknownNackReason(15));
    // the other causes
    assert_eq!(TrimCause::from_detail(2), Some(TrimCause::MemoryExhausted));
    assert_eq!(TrimCause::from_detail(3), Some(TrimCause::RateLimited));
}

/// JobFailed nack: job 9 failed because source 2 went silent; the refused
/// data contribution came from src 3, gen 7, block 0x0A0B0C0D, float32.
const JOB_FAILED_NACK: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x06, // Nack
    0x00, 0x01, 0x00, 0x03, // flags 0; float32; src_id 3
    0x00, 0x00, 0x00, 0x07, // src_cnt 0; gen_id 7
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x0A, 0x0B, 0x0C, 0x0D, // block_id
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x0B, 0x00, 0x00, // reason 11 JobFailed; reserved
    0x00, 0x00, 0x00, 0x02, // detail: the silent source, 2
];

#[test]
fn job_failed_nack_four_ways() {
    let p = Packet::new_checked(&JOB_FAILED_NACK[..]).unwrap();
    assert_eq!((p.msg_type_code(), p.src_id(), p.job_id(), p.block_id()), (0x06, 3, 9, 0x0A0B_0C0D));
    let repr = Repr::parse(&p).unwrap();
    let expected =
        Repr { dtype: Dtype::Float32, gen_id: 7, block_id: 0x0A0B_0C0D, ..Repr::new(MessageType::Nack, 9, 3) };
    assert_eq!(repr, expected);
    let nack = Nack::parse(p.payload()).unwrap();
    assert_eq!(nack, Nack { reason: NackReason::JobFailed, detail: 2 });
    let mut buf = [MARKER; 32];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    expected.emit(&mut q);
    nack.emit(q.payload_mut());
    assert_eq!(buf, JOB_FAILED_NACK);
}

/// Membership notice: job 9 failed, source 2 went silent (age_op 3), 3
/// members were still active.
const MEMBERSHIP_FAILED_NOTICE: [u8; 24] = [
    0xFA, 0x17, 0x01, 0x07, // Membership
    0x30, 0x00, 0x00, 0x02, // age_op 3 (failed) | flags 0; int32; src_id 2
    0x00, 0x03, 0x00, 0x00, // src_cnt 3; gen_id 0
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x00, 0x00, 0x00, 0x28, // block_id 40
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
];

#[test]
fn membership_failed_notice_four_ways() {
    let p = Packet::new_checked(&MEMBERSHIP_FAILED_NOTICE[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    let expected = Repr { age_op: MEMBERSHIP_FAILED, src_cnt: 3, block_id: 40, ..Repr::new(MessageType::Membership, 9, 2) };
    assert_eq!(repr, expected);
    let mut buf = [MARKER; 24];
    expected.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert_eq!(buf, MEMBERSHIP_FAILED_NOTICE);
}

/// StaleIncarnation nack (docs/restart.md): worker 3 of job 9 sent block
/// 0x0A0B0C0D of gen 7 tagged for an earlier life of the switch; the switch
/// (incarnation 0x8E5A_3C01, tag 0x3C01 in the reserved field) refuses it.
const STALE_NACK: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x06, // Nack
    0x00, 0x00, 0x00, 0x03, // flags 0; int32; src_id 3
    0x00, 0x00, 0x00, 0x07, // src_cnt 0; gen_id 7
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x0A, 0x0B, 0x0C, 0x0D, // block_id
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x0C, 0x3C, 0x01, // reason 12 StaleIncarnation; incarnation tag
    0x8E, 0x5A, 0x3C, 0x01, // detail: the switch's incarnation
];

#[test]
fn stale_incarnation_nack_carries_the_tag_and_the_incarnation() {
    let p = Packet::new_checked(&STALE_NACK[..]).unwrap();
    let nack = Nack::parse(p.payload()).unwrap();
    assert_eq!(nack, Nack { reason: NackReason::StaleIncarnation, detail: 0x8E5A_3C01 });
    assert_eq!(Nack::tag_of(&STALE_NACK), incarnation_tag(0x8E5A_3C01));
    assert_eq!(Nack::tag_of(&STALE_NACK[..20]), 0, "short datagrams have no tag");
    let mut buf = [MARKER; 32];
    let mut q = Packet::new_unchecked(&mut buf[..]);
    Repr { gen_id: 7, block_id: 0x0A0B_0C0D, ..Repr::new(MessageType::Nack, 9, 3) }.emit(&mut q);
    nack.emit(q.payload_mut());
    buf[NACK_TAG].copy_from_slice(&incarnation_tag(0x8E5A_3C01).to_be_bytes());
    assert_eq!(buf, STALE_NACK);
}

/// Sync request for job 5: switch rank 2048 forwards the join of worker 3
/// toward the root.
const SYNC: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x08, // Sync
    0x00, 0x00, 0x08, 0x00, // flags 0; int32; src_id 2048 (the forwarding switch)
    0x00, 0x00, 0x00, 0x00, // src_cnt 0; gen_id 0
    0x00, 0x00, 0x00, 0x05, // job_id 5
    0x00, 0x00, 0x00, 0x00, // block_id 0
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x03, 0x00, 0x01, // origin 3; flags SYNC_NEWCOMER
    0x00, 0x00, 0x00, 0x2A, // align_blocks 42
];

#[test]
fn sync_parse_and_emit() {
    let p = Packet::new_checked(&SYNC[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr, Repr::new(MessageType::Sync, 5, 2048));
    let body = SyncRequest { origin: 3, flags: SYNC_NEWCOMER, align_blocks: 42 };
    assert_eq!(SyncRequest::parse(p.payload()).unwrap(), body);
    let mut buf = [MARKER; 32];
    let mut packet = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut packet);
    body.emit(packet.payload_mut());
    assert_eq!(buf, SYNC);
    // the body is fixed-size: a short one is refused
    assert!(Packet::new_checked(&SYNC[..30]).is_err());
}

/// Result acknowledgement of worker 3 in job 5: it lacks block 0x100 and
/// holds blocks 0x101, 0x102 and 0x140 (bits 1, 2 and 64).
const RESULT_ACK: [u8; 40] = [
    0xFA, 0x17, 0x01, 0x09, // ResultAck
    0x00, 0x00, 0x00, 0x03, // flags 0; int32; src_id 3
    0x00, 0x00, 0x00, 0x00, // src_cnt 0; gen_id 0
    0x00, 0x00, 0x00, 0x05, // job_id 5
    0x00, 0x00, 0x01, 0x00, // block_id 0x100: the lowest block without a result
    0x00, 0x02, 0x80, 0x80, // grad_cnt 2 (bitmap words); exp/next_exp NONE
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x06, // word 0: bits 1, 2
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // word 1: bit 64
];

#[test]
fn result_ack_parse_and_emit() {
    let p = Packet::new_checked(&RESULT_ACK[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr, Repr { block_id: 0x100, grad_cnt: 2, ..Repr::new(MessageType::ResultAck, 5, 3) });
    let held: Vec<u32> = (0..200).filter(|&i| result_ack_holds(p.payload(), i)).collect();
    assert_eq!(held, [1, 2, 64]);
    let mut buf = [MARKER; 40];
    let mut packet = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut packet);
    write_result_ack(packet.payload_mut(), |i| [1, 2, 64].contains(&i));
    assert_eq!(buf, RESULT_ACK);
    // the body is grad_cnt words long; flags have no meaning here
    assert!(Packet::new_checked(&RESULT_ACK[..32]).is_err());
    let mut flagged = RESULT_ACK;
    flagged[4] = 0x08;
    assert_eq!(Packet::new_checked(&flagged[..]).unwrap_err(), WireError::ReservedBits(0x08));
}

#[test]
fn element_loops_equal_the_byte_by_byte_definition() {
    // On a CPU with AVX2 these take the vector loops (crate::simd); the
    // reference here is the definition, one element at a time.
    let mut next = crate::test_rng(0x2545_f491_4f6c_dd1d);
    for len in 0..70usize {
        let payload: Vec<u8> = (0..4 * len).map(|_| next() as u8).collect();
        let be = |i: usize| i32::from_be_bytes([payload[4 * i], payload[4 * i + 1], payload[4 * i + 2], payload[4 * i + 3]]);
        // read: a longer output keeps its tail
        let mut out = vec![7i32; len + 3];
        read_elements(&payload, &mut out);
        assert!((0..len).all(|i| out[i] == be(i)) && out[len..] == [7, 7, 7], "read, len {len}");
        // add: wrapping
        let start: Vec<i32> = (0..len).map(|_| next() as i32).collect();
        let mut sum = start.clone();
        add_elements(&mut sum, &payload);
        assert!((0..len).all(|i| sum[i] == start[i].wrapping_add(be(i))), "add, len {len}");
        // write: a longer payload keeps its tail
        let mut bytes = vec![0xAAu8; 4 * len + 5];
        write_elements(&start, &mut bytes);
        let expected: Vec<u8> = start.iter().flat_map(|v| v.to_be_bytes()).collect();
        assert_eq!(&bytes[..4 * len], &expected[..], "write, len {len}");
        assert!(bytes[4 * len..].iter().all(|&b| b == 0xAA));
    }
}

#[test]
fn golden_join_ack_with_partial_results_and_a_join_with_its_member_incarnation() {
    // JOIN_ACK with flags bit 1 (partial_results, byte 43 = 0x02)
    let mut golden = JOIN_ACK;
    golden[43] = 0x02;
    let params = JoinParams::parse(&golden[24..]).unwrap();
    assert!(params.partial_results && !params.results_on_group);
    let mut buf = golden;
    buf[24..].fill(MARKER);
    params.emit(&mut buf[24..]);
    assert_eq!(buf, golden);
    // A Join of job 9 from source 2, member incarnation 0xBEEF in src_cnt:
    // fa170104 00000002 beef0000 00000009 00000000 00008080
    let join: [u8; 24] = [
        0xFA, 0x17, 0x01, 0x04, 0x00, 0x00, 0x00, 0x02, 0xBE, 0xEF, 0x00, 0x00, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x80, 0x80,
    ];
    let p = Packet::new_checked(&join[..]).unwrap();
    assert_eq!(p.member_incarnation(), 0xBEEF);
    let repr = Repr { src_cnt: 0xBEEF, ..Repr::new(MessageType::Join, 9, 2) };
    let mut out = [MARKER; 24];
    repr.emit(&mut Packet::new_unchecked(&mut out[..]));
    assert_eq!(out, join);
}

/// Membership notice: job 9's round ended because source 1 joined as a new
/// process (age_op 4); 2 members; the next round starts at block 16.
const ROUND_ENDED_NOTICE: [u8; 24] = [
    0xFA, 0x17, 0x01, 0x07, // Membership
    0x40, 0x00, 0x00, 0x01, // age_op 4 (restarted) | flags 0; int32; src_id 1
    0x00, 0x02, 0x00, 0x00, // src_cnt 2; gen_id 0
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x00, 0x00, 0x00, 0x10, // block_id 16: the next round's start
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
];

#[test]
fn round_ended_notice_both_ways() {
    let p = Packet::new_checked(&ROUND_ENDED_NOTICE[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    let expected =
        Repr { age_op: MEMBERSHIP_RESTARTED, src_cnt: 2, block_id: 16, ..Repr::new(MessageType::Membership, 9, 1) };
    assert_eq!(repr, expected);
    let mut buf = [MARKER; 24];
    expected.emit(&mut Packet::new_unchecked(&mut buf[..]));
    assert_eq!(buf, ROUND_ENDED_NOTICE);
}

/// A recovery Join (age_op 2) of job 9 from source 2, member incarnation
/// 0xBEEF, generation 7, lowest block without a result 0x53; its body: the
/// running allreduce began at block 0x50 as generation 7.
const RECOVER_JOIN: [u8; 32] = [
    0xFA, 0x17, 0x01, 0x04, // Join
    0x20, 0x00, 0x00, 0x02, // age_op 2 (recover) | flags 0; int32; src_id 2
    0xBE, 0xEF, 0x00, 0x07, // src_cnt = member incarnation; gen_id 7
    0x00, 0x00, 0x00, 0x09, // job_id 9
    0x00, 0x00, 0x00, 0x53, // block_id: the lowest block without a result
    0x00, 0x00, 0x80, 0x80, // grad_cnt 0; exp/next_exp NONE
    0x00, 0x00, 0x00, 0x50, // anchor block
    0x00, 0x07, 0x00, 0x00, // anchor gen_id 7; reserved
];

#[test]
fn recover_join_carries_its_anchor_both_ways() {
    let p = Packet::new_checked(&RECOVER_JOIN[..]).unwrap();
    let repr = Repr::parse(&p).unwrap();
    let expected = Repr {
        age_op: JOIN_RECOVER,
        src_cnt: 0xBEEF,
        gen_id: 7,
        block_id: 0x53,
        ..Repr::new(MessageType::Join, 9, 2)
    };
    assert_eq!(repr, expected);
    assert_eq!(expected.buffer_len(), RECOVER_JOIN.len());
    let anchor = RecoverAnchor::parse(p.payload()).unwrap();
    assert_eq!(anchor, RecoverAnchor { block: 0x50, gen_id: 7 });
    let mut buf = [MARKER; 32];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    expected.emit(&mut out);
    anchor.emit(out.payload_mut());
    assert_eq!(buf, RECOVER_JOIN);
    // the body is part of a recovery Join: one without it is cut short, and
    // a plain Join carries none
    assert!(Packet::new_checked(&RECOVER_JOIN[..24]).is_err());
    let mut plain = RECOVER_JOIN;
    plain[4] = 0x00;
    assert!(Packet::new_checked(&plain[..]).is_err());
    assert!(Packet::new_checked(&plain[..24]).is_ok());
}

#[test]
fn the_packet_size_for_an_mtu_leaves_room_for_every_header_and_the_seal() {
    // 1500 - IPv4 20 - UDP 8 - header 24 - seal 16 = 1432 bytes = 358 elements
    assert_eq!(elems_fitting_mtu(1500, false), 358);
    assert_eq!(elems_fitting_mtu(1500, true), 353);
    assert_eq!(elems_fitting_mtu(9000, false), 2233);
    // loopback's 64 KiB: (65536 - 68) / 4, sealed datagram included
    assert_eq!(elems_fitting_mtu(65536, false), 16367);
    assert_eq!(elems_fitting_mtu(1 << 20, false) as usize, MAX_GRAD_CNT);
    assert_eq!(elems_fitting_mtu(0, false), 1);
    let d = 20 + 8 + HEADER_LEN + crate::auth::TRAILER_LEN + 358 * ELEM_LEN;
    assert_eq!(d, 1500);
}

/// The contribution above as float16: two int16 lanes (1, -1), 2 bytes per
/// element (docs/protocol.md §5.6 and §9).
const CONTRIBUTION_F16: [u8; 28] = [
    0xFA, 0x17, 0x01, 0x01, // magic, version 1, Contribution
    0x08, 0x02, 0x00, 0x03, // flags: final; dtype float16; src_id 3
    0x00, 0x00, 0x00, 0x07, // src_cnt 0; gen_id 7
    0x01, 0x02, 0x03, 0x04, // job_id
    0x0A, 0x0B, 0x0C, 0x0D, // block_id
    0x00, 0x02, 0x05, 0xFE, // grad_cnt 2; exp 5; next_exp -2
    0x00, 0x01, 0xFF, 0xFF, // 1, -1 (int16 lanes)
];

#[test]
fn golden_float16_contribution_has_int16_lanes() {
    let p = Packet::new_checked(&CONTRIBUTION_F16[..]).unwrap();
    assert_eq!(p.dtype_code(), 2);
    assert_eq!((p.grad_cnt(), p.element(0), p.element(1)), (2, 1, -1));
    let repr = Repr::parse(&p).unwrap();
    assert_eq!(repr, Repr { dtype: Dtype::Float16, ..contribution_repr() });
    assert_eq!(repr.buffer_len(), 28);
    let mut buf = [MARKER; 28];
    let mut out = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut out);
    write_lanes(Dtype::Float16, &[1, -1], out.payload_mut());
    assert_eq!(buf, CONTRIBUTION_F16);
    // int32 lanes of the same count are a length mismatch for a 16-bit dtype
    let mut long = CONTRIBUTION.to_vec();
    long[5] = 3; // bfloat16
    assert!(matches!(Packet::new_checked(&long[..]), Err(WireError::LengthMismatch { expected: 28, got: 32 })));
}

#[test]
fn int16_lanes_add_in_int32_and_saturate_only_when_written() {
    let mut sum = [0i32; 3];
    let lanes = |v: &[i16]| v.iter().flat_map(|x| x.to_be_bytes()).collect::<Vec<u8>>();
    add_lanes(Dtype::BFloat16, &mut sum, &lanes(&[i16::MAX, -1, 7]));
    add_lanes(Dtype::BFloat16, &mut sum, &lanes(&[i16::MAX, -1, 7]));
    assert_eq!(sum, [65534, -2, 14], "no wrap in the accumulator");
    let mut back = [0i32; 3];
    read_lanes(Dtype::BFloat16, &lanes(&[-5, 0, 300]), &mut back);
    assert_eq!(back, [-5, 0, 300]);
    let mut out = [0u8; 6];
    write_lanes(Dtype::Float16, &sum, &mut out);
    assert_eq!(out, [0x7F, 0xFF, 0xFF, 0xFE, 0x00, 0x0E], "a sum beyond int16 saturates");
    assert_eq!((Dtype::Float16.lane_len(), Dtype::Float32.lane_len()), (2, 4));
}
