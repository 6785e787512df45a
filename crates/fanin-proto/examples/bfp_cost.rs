//! Host CPU per element of block floating point, without sockets: the
//! quantising and dequantising loops a worker runs on every element it
//! sends and receives. `cargo run --release -p fanin-proto --example
//! bfp_cost [M elements]` prints one JSON object: ns per element (quantise +
//! dequantise, best of several rounds, interleaved) for float32, float16 and
//! bfloat16. Run it once as is and once with `FANIN_SIMD=portable` to see
//! what the vector loops gain (the choice is made once per process).

use std::hint::black_box;
use std::time::Instant;

use fanin_proto::bfp::half::{self, Half};
use fanin_proto::bfp::{dequantize_from_payload, quantize_into_payload};

const SOURCES: usize = 8;
const EXP: i8 = 2;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse::<f64>().ok()).map_or(4 << 20, |m| (m * 1e6) as usize);
    // values of a gradient's size, the same for every format
    let f32s: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.618).fract() - 0.5) * 3.0).collect();
    let f16s: Vec<u16> = f32s.iter().map(|&x| Half::F16.from_f64(x as f64)).collect();
    let bf16s: Vec<u16> = f32s.iter().map(|&x| Half::BF16.from_f64(x as f64)).collect();
    let (mut p32, mut out32) = (vec![0u8; 4 * n], vec![0f32; n]);
    let (mut p16, mut out16) = (vec![0u8; 2 * n], vec![0u16; n]);
    let mut best = [f64::MAX; 3];
    for _ in 0..5 {
        let t = Instant::now();
        quantize_into_payload(black_box(&f32s), EXP, SOURCES, &mut p32);
        dequantize_from_payload(black_box(&p32), EXP, SOURCES, 1, &mut out32);
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        for (i, (kind, values)) in [(Half::F16, &f16s), (Half::BF16, &bf16s)].into_iter().enumerate() {
            let t = Instant::now();
            half::quantize_into_payload(kind, black_box(values), EXP, SOURCES, &mut p16);
            half::dequantize_from_payload(kind, black_box(&p16), EXP, SOURCES, 1, &mut out16);
            best[i + 1] = best[i + 1].min(t.elapsed().as_secs_f64());
        }
    }
    let ns = |s: f64| s * 1e9 / n as f64;
    let simd = std::env::var("FANIN_SIMD").map_or("auto".to_string(), |v| v);
    println!(
        "{{\"elements\": {n}, \"fanin_simd\": \"{simd}\", \"ns_per_element\": {{\"float32\": {:.3}, \"float16\": {:.3}, \
         \"bfloat16\": {:.3}}}}}",
        ns(best[0]),
        ns(best[1]),
        ns(best[2])
    );
    eprintln!(
        "quantise + dequantise, ns per element ({simd}): float32 {:.2}, float16 {:.2}, bfloat16 {:.2}",
        ns(best[0]),
        ns(best[1]),
        ns(best[2])
    );
}
