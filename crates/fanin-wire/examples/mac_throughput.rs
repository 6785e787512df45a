//! Micro-benchmark of the datagram tag: `cargo run --release -p fanin-wire
//! --example mac_throughput`. Prints GB/s of the tag (NH + SipHash), of NH
//! alone and of SipHash-2-4 over the whole datagram (the previous tag), for
//! a few datagram sizes. For comparison it also times the fastest MACs built
//! on AES instructions, AEGIS-128L and AEGIS-128X2 (the `aegis` crate's
//! runtime-dispatched AES-NI/VAES code, 128-bit tag), on the same bytes: if
//! either were much faster than NH here, the tag should move to it.

use std::hint::black_box;
use std::time::Instant;

use aegis::aegis128l::Aegis128LMac;
use aegis::aegis128x2::Aegis128X2Mac;
use fanin_wire::auth::{mac, mac_expanded, nh_digest, siphash24, Key, NhKey};

fn rate(bytes: usize, mut f: impl FnMut() -> u64) -> f64 {
    let reps = (256 << 20) / bytes.max(1);
    let start = Instant::now();
    let mut acc = 0u64;
    for _ in 0..reps {
        acc ^= f();
    }
    black_box(acc);
    (reps * bytes) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let key = Key([7; 16]);
    let nh = NhKey::new(&key);
    for size in [64, 1024, 1408, 1460, 4120, 8216, 65_491] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31) as u8).collect();
        let tag = rate(size, || mac(&key, 1, black_box(&data)));
        let expanded = rate(size, || mac_expanded(&key, &nh, 1, black_box(&data)));
        let nh_only = rate(size, || nh_digest(&nh, black_box(&data))[0]);
        let sip = rate(size, || siphash24(&key, black_box(&data)));
        // The keyed states are set up once, as NhKey is: each tag clones one.
        let l_state = Aegis128LMac::<16>::new(&key.0);
        let aegis_l = rate(size, || {
            let mut m = l_state.clone();
            m.update(black_box(&data));
            first_word(&m.finalize())
        });
        let x2_state = Aegis128X2Mac::<16>::new(&key.0);
        let aegis_x2 = rate(size, || {
            let mut m = x2_state.clone();
            m.update(black_box(&data));
            first_word(&m.finalize())
        });
        println!(
            "{size:>6} B: tag {tag:6.2} GB/s ({expanded:6.2} pre-expanded)   NH {nh_only:6.2} GB/s   \
             SipHash-2-4 {sip:5.2} GB/s   AEGIS-128L {aegis_l:6.2} GB/s   AEGIS-128X2 {aegis_x2:6.2} GB/s"
        );
    }
}

/// The first 8 bytes of a 16-byte tag, as a value `rate` can fold.
fn first_word(tag: &[u8; 16]) -> u64 {
    u64::from_le_bytes(tag[..8].try_into().expect("8 bytes"))
}
