use super::*;
use crate::transmit::VecTransmit;

#[test]
fn in_order_numbers_are_accepted_once() {
    let mut w = ReplayWindow::default();
    for s in 1..=3000 {
        assert_eq!(w.accept(s), Ok(()), "seq {s}");
    }
    assert_eq!(w.top(), 3000);
    assert_eq!(w.accept(3000), Err(Replay::Duplicate));
    assert_eq!(w.accept(2999), Err(Replay::Duplicate));
    assert_eq!(w.accept(0), Err(Replay::TooOld));
}

#[test]
fn reordering_inside_the_window_is_accepted_and_duplicates_are_not() {
    let mut w = ReplayWindow::default();
    assert_eq!(w.accept(2000), Ok(()));
    assert_eq!(w.accept(1990), Ok(()), "1990 came late, inside the window");
    assert_eq!(w.accept(1995), Ok(()));
    assert_eq!(w.accept(1990), Err(Replay::Duplicate));
    assert_eq!(w.accept(2000), Err(Replay::Duplicate));
    assert_eq!(w.accept(2001), Ok(()));
    // oldest number still inside: top - (REPLAY_WINDOW - 1)
    assert_eq!(w.accept(2001 - (REPLAY_WINDOW - 1)), Ok(()));
    assert_eq!(w.accept(2001 - REPLAY_WINDOW), Err(Replay::TooOld));
}

#[test]
fn numbers_far_behind_are_too_old_even_if_never_seen() {
    let mut w = ReplayWindow::default();
    assert_eq!(w.accept(5000), Ok(()));
    assert_eq!(w.accept(5000 - REPLAY_WINDOW), Err(Replay::TooOld));
    assert_eq!(w.accept(1), Err(Replay::TooOld));
}

#[test]
fn a_big_jump_forgets_everything_behind_the_new_window() {
    let mut w = ReplayWindow::default();
    for s in [10, 11, 12] {
        w.accept(s).unwrap();
    }
    // Jump by exactly the window: bits are shared modulo REPLAY_WINDOW, so
    // 10 + W must not look like a duplicate of 10.
    assert_eq!(w.accept(10 + REPLAY_WINDOW), Ok(()));
    assert_eq!(w.accept(11 + REPLAY_WINDOW), Ok(()), "11's bit is reused once 11 slid out");
    assert_eq!(w.accept(12), Err(Replay::Duplicate), "12 is still inside the window, and was seen");
    assert_eq!(w.accept(11), Err(Replay::TooOld));
    assert_eq!(w.accept(1_000_000), Ok(()));
    assert_eq!(w.accept(1_000_000 - 1), Ok(()), "never seen, inside the new window");
    assert_eq!(w.accept(11 + REPLAY_WINDOW), Err(Replay::TooOld));
}

#[test]
fn a_slide_clears_exactly_the_numbers_that_enter() {
    let mut w = ReplayWindow::default();
    w.accept(1).unwrap();
    w.accept(3).unwrap();
    // Slide by 2 from top 3 to 5: 4 and 5 become new; 3 stays seen.
    w.accept(5).unwrap();
    assert_eq!(w.accept(3), Err(Replay::Duplicate));
    assert_eq!(w.accept(4), Ok(()));
    assert_eq!(w.accept(2), Ok(()));
}

#[test]
fn lanes_have_separate_windows() {
    let mut lanes = LaneWindows::default();
    let lane = |l: u64, c: u64| (l << 48) | c;
    assert_eq!(lanes.accept(lane(0, 5000)), Ok(()));
    assert_eq!(lanes.accept(lane(1, 10)), Ok(()), "lane 1 is not behind lane 0");
    assert_eq!(lanes.accept(lane(0, 10)), Err(Replay::TooOld));
    assert_eq!(lanes.accept(lane(1, 10)), Err(Replay::Duplicate));
    assert_eq!(lanes.accept(lane(MAX_LANES as u64, 1)), Err(Replay::BadLane));
}

#[test]
fn open_and_accept_moves_the_window_only_for_good_tags() {
    let key = Key([3; 16]);
    let other = Key([4; 16]);
    let mut sealer = Sealer::new(key, 0, 77);
    let mut out = VecTransmit::new();
    let join = [0xfa, 0x17, 0x01, 0x04, 0, 0, 0, 1];
    for _ in 0..2 {
        sealer.push(&mut out, 0u16, join.len(), |b| b.copy_from_slice(&join));
    }
    let first = out.datagrams[0].1.clone();
    let second = out.datagrams[1].1.clone();
    let mut window = LaneWindows::default();
    // a forgery (other key) with a far-ahead number must not move the window
    let mut forged = second.clone();
    auth::seal(&other, 1 << 40, &mut forged).unwrap();
    assert_eq!(open_and_accept(&key, &mut window, &forged), Err(Refusal::Auth(AuthError::BadTag)));
    let inner = open_and_accept(&key, &mut window, &first).unwrap();
    assert_eq!(inner, &[0xfa, 0x17, 0x01, 0x84, 0, 0, 0, 1], "the unsealed part, sealed bit still set");
    assert_eq!(open_and_accept(&key, &mut window, &first), Err(Refusal::Replay(Replay::Duplicate)));
    assert!(open_and_accept(&key, &mut window, &second).is_ok());
    assert_eq!(open_and_accept(&key, &mut window, &join), Err(Refusal::Auth(AuthError::Unsealed)));
}

#[test]
fn unsealed_push_clears_a_stale_sealed_bit() {
    let mut out = VecTransmit::new();
    push_sealed(&mut out, 0u16, 4, None, |b| b.copy_from_slice(&[0xfa, 0x17, 0x01, 0x83]));
    assert_eq!(out.datagrams[0].1, vec![0xfa, 0x17, 0x01, 0x03]);
}
