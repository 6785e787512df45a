//! `auth::Sealed::split` / `verify` / `open` on untrusted datagrams.
//!
//! Oracles: split accepts exactly the sealed datagrams long enough for a
//! preamble and the trailer; `inner` + trailer is the input; a random tag
//! never verifies under a fixed key unless it is the real one; sealing the
//! inner part again and opening it round-trips; nothing panics.
#![no_main]

use fanin_wire::auth::{self, AuthError, Key, Sealed, TRAILER_LEN};
use fanin_wire::PREAMBLE_LEN;
use libfuzzer_sys::fuzz_target;

const KEY: Key = Key([7; 16]);

fuzz_target!(|data: &[u8]| {
    match Sealed::split(data) {
        Ok(sealed) => {
            assert!(auth::is_sealed(data));
            assert!(data.len() >= PREAMBLE_LEN + TRAILER_LEN);
            assert_eq!(sealed.inner.len() + TRAILER_LEN, data.len());
            // Re-seal: the trailer is rewritten with the real tag (the one
            // definition of the tag, protocol.md §2.4), and opens under the key.
            let mut buf = data.to_vec();
            auth::seal(&KEY, sealed.seq, &mut buf).expect("long enough");
            let real = u64::from_be_bytes(buf[buf.len() - 8..].try_into().expect("8 bytes"));
            assert_eq!(sealed.verify(&KEY).is_ok(), real == sealed.tag);
            let (inner, seq) = auth::open(&KEY, &buf).expect("just sealed");
            assert_eq!((inner, seq), (sealed.inner, sealed.seq));
        }
        Err(AuthError::Unsealed) => assert!(!auth::is_sealed(data)),
        Err(AuthError::Truncated(n)) => assert_eq!(n, data.len()),
        Err(AuthError::BadTag) => unreachable!("split does not check tags"),
    }
    let _ = auth::open(&KEY, data);
});
