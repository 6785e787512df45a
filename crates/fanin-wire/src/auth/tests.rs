use super::*;

const REF_KEY: Key = Key([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);

/// The reference implementation's `vectors_sip64` (key 00..0f, message
/// 00..n-1) for n = 0..=16.
const REF_VECTORS: [u64; 17] = [
    0x726fdb47dd0e0e31,
    0x74f839c593dc67fd,
    0x0d6c8009d9a94f5a,
    0x85676696d7fb7e2d,
    0xcf2794e0277187b7,
    0x18765564cd99a68d,
    0xcbc9466e58fee3ce,
    0xab0200f58b01d137,
    0x93f5f5799a932462,
    0x9e0082df0ba9e4b0,
    0x7a5dbbc594ddb9f3,
    0xf4b32f46226bada7,
    0x751e8fbc860ee5fb,
    0x14ea5627c0843d90,
    0xf723ca908e7af2ee,
    0xa129ca6149be45e5,
    0x3f2acc7f57c29bdb,
];

#[test]
fn siphash24_matches_the_reference_vectors() {
    let msg: Vec<u8> = (0..64).collect();
    for (n, &want) in REF_VECTORS.iter().enumerate() {
        assert_eq!(siphash24(&REF_KEY, &msg[..n]), want, "n = {n}");
    }
}

#[test]
fn incremental_writes_equal_one_write() {
    let msg: Vec<u8> = (0..200u8).collect();
    let whole = siphash24(&REF_KEY, &msg);
    for split in [0, 1, 3, 7, 8, 9, 15, 16, 17, 100, 199, 200] {
        for split2 in [split, (split + 5).min(200)] {
            let mut h = SipHasher24::new(&REF_KEY);
            h.write(&msg[..split]);
            h.write(&msg[split..split2]);
            h.write(&msg[split2..]);
            assert_eq!(h.finish(), whole, "split at {split}, {split2}");
        }
    }
}

/// A Join of job 7 from source 3, sealed with seq 0x0000_0102_0304_0506
/// under the member key derived from job key 00..0f: pins the trailer
/// layout, the derivation and the tag (docs/protocol.md, "Sealed datagrams").
const GOLDEN_JOIN: [u8; 40] = [
    0xfa, 0x17, 0x01, 0x84, // preamble, Join | SEALED
    0x00, 0x00, 0x00, 0x03, // flags, dtype, src_id 3
    0x00, 0x00, 0x00, 0x00, // src_cnt, gen_id
    0x00, 0x00, 0x00, 0x07, // job_id 7
    0x00, 0x00, 0x00, 0x00, // block_id
    0x00, 0x00, 0x80, 0x80, // grad_cnt, exp, next_exp (EXP_NONE)
    0x00, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, // seq
    0x1c, 0xf0, 0xeb, 0x51, 0x8f, 0x25, 0x5d, 0xb5, // tag
];
const GOLDEN_MEMBER_KEY: &str = "8b5638aa5b5876fd2805b96de9d9ab72";

fn golden_unsealed() -> Vec<u8> {
    let mut v = GOLDEN_JOIN[..24].to_vec();
    v[3] = 0x04;
    v
}

#[test]
fn member_key_derivation_is_pinned() {
    let k = derive_member_key(&REF_KEY, 7, 3);
    assert_eq!(k.to_hex(), GOLDEN_MEMBER_KEY);
    assert_ne!(derive_member_key(&REF_KEY, 7, 4), k, "another source");
    assert_ne!(derive_member_key(&REF_KEY, 8, 3), k, "another job");
}

#[test]
fn seal_writes_the_golden_bytes_and_open_reads_them() {
    let key = derive_member_key(&REF_KEY, 7, 3);
    let mut buf = vec![0xEE; 40];
    buf[..24].copy_from_slice(&golden_unsealed());
    seal(&key, 0x0000_0102_0304_0506, &mut buf).unwrap();
    assert_eq!(buf, GOLDEN_JOIN, "{buf:02x?}");
    let (inner, seq) = open(&key, &GOLDEN_JOIN).unwrap();
    assert_eq!(seq, 0x0000_0102_0304_0506);
    assert_eq!(inner, &GOLDEN_JOIN[..24]);
    let sealed = Sealed::split(&GOLDEN_JOIN).unwrap();
    assert_eq!(sealed.tag, 0x1cf0_eb51_8f25_5db5);
}

#[test]
fn any_flipped_bit_or_other_key_fails_the_tag() {
    let key = derive_member_key(&REF_KEY, 7, 3);
    // header (src_id), body-less join: flip in header, seq and tag.
    for (at, what) in [(7, "header src_id"), (15, "header job_id"), (3, "msg_type low bits"), (26, "seq"), (39, "tag")] {
        let mut bad = GOLDEN_JOIN;
        bad[at] ^= 0x01;
        assert_eq!(open(&key, &bad), Err(AuthError::BadTag), "{what}");
    }
    // a body: a sealed contribution with payload, one bit flipped in it
    let mut packet = vec![0u8; 24 + 16 + TRAILER_LEN];
    packet[..24].copy_from_slice(&golden_unsealed());
    packet[3] = 0x01;
    packet[21] = 4; // grad_cnt 4
    seal(&key, 9, &mut packet).unwrap();
    assert!(open(&key, &packet).is_ok());
    let mut bad = packet.clone();
    bad[30] ^= 0x40;
    assert_eq!(open(&key, &bad), Err(AuthError::BadTag), "body");
    assert_eq!(open(&derive_member_key(&REF_KEY, 7, 4), &packet), Err(AuthError::BadTag), "another member's key");
    assert_eq!(open(&derive_member_key(&REF_KEY, 8, 3), &packet), Err(AuthError::BadTag), "another job's key");
    assert_eq!(open(&Key([0; 16]), &packet), Err(AuthError::BadTag), "zero key");
}

/// A datagram of 2424 bytes (two full NH chunks and a 376-byte tail padded
/// to 384): pins chunking, padding and the Toeplitz key shift. The same
/// value is computed independently in python/tests/test_auth.py.
fn long_datagram() -> Vec<u8> {
    let mut inner = golden_unsealed();
    inner[3] = 0x81;
    inner.extend((0..2400u32).map(|i| (i * 7 + 1) as u8));
    inner
}
const GOLDEN_LONG_TAG: u64 = 0x97c7_8363_8b3e_9830;

#[test]
fn a_multi_chunk_tag_is_pinned_and_covers_every_chunk_and_the_length() {
    let key = derive_member_key(&REF_KEY, 7, 3);
    let inner = long_datagram();
    assert_eq!(mac(&key, 42, &inner), GOLDEN_LONG_TAG);
    let mut packet = inner.clone();
    packet.resize(inner.len() + TRAILER_LEN, 0);
    seal(&key, 42, &mut packet).unwrap();
    assert_eq!(open(&key, &packet).unwrap(), (&inner[..], 42));
    // a bit in the first chunk, the second chunk, the last word of the tail
    for at in [100, NH_CHUNK + 5, inner.len() - 1] {
        let mut bad = packet.clone();
        bad[at] ^= 0x01;
        assert_eq!(open(&key, &bad), Err(AuthError::BadTag), "byte {at}");
    }
    // zero padding is not ambiguous: one more zero byte is another tag
    let mut longer = inner.clone();
    longer.push(0);
    assert_ne!(mac(&key, 42, &longer), mac(&key, 42, &inner));
    // two chunks swapped (each digest is keyed by position through the order)
    let mut swapped = inner.clone();
    let (a, b) = swapped.split_at_mut(NH_CHUNK);
    a.swap_with_slice(&mut b[..NH_CHUNK]);
    assert_ne!(mac(&key, 42, &swapped), mac(&key, 42, &inner));
    assert_ne!(mac(&key, 43, &inner), mac(&key, 42, &inner), "seq");
}

#[test]
fn nh_passes_are_keyed_and_shifted() {
    let k = NhKey::new(&REF_KEY);
    let data = vec![0u8; 64];
    let d = nh_digest(&k, &data);
    assert_eq!(d.len(), 2);
    assert_ne!(d[0], d[1], "the second pass uses the shifted key");
    assert_ne!(nh_digest(&NhKey::new(&Key([1; 16])), &data), d, "another key");
}

#[test]
fn unsealed_and_short_datagrams_are_refused_by_length_not_panic() {
    let key = REF_KEY;
    assert_eq!(open(&key, &golden_unsealed()), Err(AuthError::Unsealed));
    assert_eq!(open(&key, &[]), Err(AuthError::Unsealed));
    assert_eq!(open(&key, &[0xfa, 0x17, 0x01, 0x84, 0, 0]), Err(AuthError::Truncated(6)));
    let mut small = [0u8; 10];
    assert!(seal(&key, 1, &mut small).is_err());
}

#[test]
fn sequence_numbers_stay_in_their_lane() {
    let s = first_seq(3, 0x1234_5678_9abc_def0);
    assert_eq!(lane_of(s), 3);
    assert_eq!(s & 0xffff_ffff_ffff, 0x5678_9abc_def0);
    assert_eq!(next_seq(s), s + 1);
    let last = (3u64 << 48) | 0xffff_ffff_ffff;
    assert_eq!(next_seq(last), (3u64 << 48) | 1, "wraps to 1 inside the lane");
    assert_eq!(first_seq(0, 0), 1, "never zero");
}

#[test]
fn keys_parse_from_hex_and_never_print() {
    let k = Key::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
    assert_eq!(k, REF_KEY);
    assert_eq!(k.to_hex(), "000102030405060708090a0b0c0d0e0f");
    assert!(Key::from_hex("0102").unwrap_err().contains("32 hex digits"));
    assert!(Key::from_hex("zz0102030405060708090a0b0c0d0e0f").is_err());
    assert_eq!(format!("{k:?}"), "Key(..)");
}

#[test]
fn the_result_key_is_no_member_key_is_bound_to_its_switch_and_epoch_and_travels_wrapped() {
    const INC: u32 = 0x1234_5679;
    const EPOCH: u32 = 2;
    let result = derive_result_key(&REF_KEY, 7, INC, EPOCH);
    assert_eq!(result.to_hex(), GOLDEN_RESULT_KEY);
    assert_ne!(derive_result_key(&REF_KEY, 8, INC, EPOCH), result, "another job");
    assert_ne!(derive_result_key(&REF_KEY, 7, INC + 2, EPOCH), result, "another switch, or a restart");
    assert_ne!(derive_result_key(&REF_KEY, 7, INC, EPOCH + 1), result, "another epoch (a member left)");
    for src in [0u16, 3, u16::MAX] {
        assert_ne!(derive_member_key(&REF_KEY, 7, src), result, "a member key");
    }
    // each member gets other bytes, and only its own key unwraps them
    let (k3, k4) = (derive_member_key(&REF_KEY, 7, 3), derive_member_key(&REF_KEY, 7, 4));
    let (w3, w4) = (wrap_result_key(&k3, 7, INC, EPOCH, &result), wrap_result_key(&k4, 7, INC, EPOCH, &result));
    assert_eq!(hex(&w3), GOLDEN_WRAPPED_FOR_3);
    assert_ne!(w3, w4);
    assert_ne!(w3, result.0, "the key is not sent in clear");
    assert_eq!(Key(wrap_result_key(&k3, 7, INC, EPOCH, &Key(w3))), result);
    assert_ne!(Key(wrap_result_key(&k4, 7, INC, EPOCH, &Key(w3))), result);
    // another incarnation's or epoch's key travels under another pad: a
    // member that left knows the old epoch's key and may have seen a
    // member's old JoinAck; with one pad for both epochs that would give it
    // the pad, and the new JoinAck the new key
    let xor = |a: [u8; 16], b: [u8; 16]| -> [u8; 16] { core::array::from_fn(|i| a[i] ^ b[i]) };
    for (inc, epoch) in [(INC + 2, EPOCH), (INC, EPOCH + 1)] {
        let other = derive_result_key(&REF_KEY, 7, inc, epoch);
        let w3_other = wrap_result_key(&k3, 7, inc, epoch, &other);
        assert_ne!(xor(w3, w3_other), xor(result.0, other.0), "no pad used twice ({inc:#x}, {epoch})");
        assert_ne!(xor(w3, result.0), xor(w3_other, result.0), "the old pad does not unwrap the new key");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_group_lane_sequence_number_stays_unique_and_is_bound_by_the_tag() {
    let seq = first_seq(3, 1_000);
    let g = group_seq(seq);
    assert!(is_group_seq(g) && !is_group_seq(seq));
    assert_eq!(lane_of(g), GROUP_LANE | 3);
    assert_eq!(g & ((1 << LANE_SHIFT) - 1), seq & ((1 << LANE_SHIFT) - 1), "same counter");
    assert!(is_group_seq(next_seq(g)), "the counter stays in its lane");
    // flipping the group bit of a sealed datagram breaks its tag
    let result = derive_result_key(&REF_KEY, 7, 1, 0);
    let mut packet = golden_unsealed();
    packet.extend_from_slice(&[0; TRAILER_LEN]);
    seal(&result, g, &mut packet).unwrap();
    assert_eq!(open(&result, &packet).map(|(_, s)| s), Ok(g));
    let at = packet.len() - TRAILER_LEN;
    packet[at] ^= 0x80;
    assert_eq!(open(&result, &packet), Err(AuthError::BadTag));
}
// Pinned here and recomputed from protocol.md §2.4 by an independent
// SipHash in python/tests/test_auth.py.
const GOLDEN_RESULT_KEY: &str = "8a2ff77d4d29e5890fdf1c1358d725c9";
const GOLDEN_WRAPPED_FOR_3: &str = "1122fa37bea696d5338190604a094b83";
