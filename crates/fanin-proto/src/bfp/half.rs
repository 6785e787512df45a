//! Block floating point for 16-bit floats (float16, bfloat16): 2 bytes per
//! element on the wire each way, summed exactly by the switch.
//!
//! The scheme is float32's ([`super`]) with int16 lanes: with `e` the
//! block's shared exponent (every |x| < 2^e) and `N` sources, a value is
//! quantised as `q = round(x * 2^(B - e))` with `B = 14 - ceil(log2 N)`, so
//! |q| <= 2^B and the sum of N of them is at most 2^14: **it always fits
//! the int16 lane the switch writes the result in** (it adds in int32).
//! The result is `sum * 2^(e - B)`, exact in f64, rounded once to the
//! tensor's type (round to nearest, ties to even).
//!
//! Error bound (docs/protocol.md §3.3, checked by the tests):
//! |result - exact_sum| <= N * 2^(e - B - 1) + ulp(result), the last term
//! the rounding to 16 bits (half an ulp for float16; bfloat16 rounds
//! through float32, which can add a rounding of that size again).
//! For 4 sources B = 12: 12 bits of the block maximum, one more than
//! float16 carries and four more than bfloat16.
//!
//! The conversions are written out here (round to nearest even, subnormals,
//! infinities, NaN) rather than taken from a crate; the tests check them
//! against every one of the 65 536 bit patterns. On a CPU with AVX2 and F16C
//! the per-element loops run eight lanes at a time (`simd` below: the scalar
//! conversions made a float16 allreduce cost more host CPU per element than
//! a float32 one), and tests check them bit for bit against these.

use fanin_wire::value::{Dtype, EXP_NONE, EXP_NON_FINITE};

use super::{block_exponent, is_pow2, pow2, quantize_one, quantize_scale, OutOfRange};

/// Which 16-bit float a tensor holds (its elements are passed as their bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Half {
    /// IEEE 754 binary16: 5 exponent bits, 10 fraction bits.
    F16,
    /// bfloat16: float32's 8 exponent bits, 7 fraction bits.
    BF16,
}

impl Half {
    pub fn dtype(self) -> Dtype {
        match self {
            Half::F16 => Dtype::Float16,
            Half::BF16 => Dtype::BFloat16,
        }
    }

    /// The value of `bits` (exact).
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::F16 => f16_to_f32(bits),
            Half::BF16 => f32::from_bits((bits as u32) << 16),
        }
    }

    /// `x` rounded to this type, to nearest with ties to even (bfloat16:
    /// through float32).
    pub fn from_f64(self, x: f64) -> u16 {
        match self {
            Half::F16 => f16_from_f64(x),
            Half::BF16 => bf16_from_f32(x as f32),
        }
    }
}

/// Fraction bits of a 16-bit lane for `n_sources` sources (may be small or
/// negative for thousands of sources: see [`check_sources`]).
pub fn frac_bits(n_sources: usize) -> i32 {
    Dtype::Float16.lane_bits() - ceil_log2(n_sources)
}

/// Most sources a 16-bit allreduce may sum: 2^13 leaves one bit of the
/// lane per value (B = 1); beyond that every value would round to 0 or 2^e.
pub const MAX_SOURCES: usize = 1 << 13;

/// Refuse a 16-bit allreduce over more sources than its lanes can carry.
pub fn check_sources(n_sources: usize) -> Result<(), String> {
    if n_sources > MAX_SOURCES {
        return Err(format!(
            "a 16-bit allreduce over {n_sources} workers leaves no fraction bit in its int16 lanes \
             (at most {MAX_SOURCES}); reduce in float32"
        ));
    }
    Ok(())
}

fn ceil_log2(n: usize) -> i32 {
    let n = n.max(1) as u64;
    64 - (n - 1).leading_zeros() as i32
}

/// The exponent of a block of 16-bit values (as [`block_exponent`] for
/// float32: every |x| < 2^e, [`EXP_NONE`] for an all-zero block,
/// [`EXP_NON_FINITE`] for a block holding a NaN or an infinity), or the
/// first value it cannot carry (a bfloat16 of 2^126 or more).
pub fn block_exponent_half(kind: Half, values: &[u16]) -> Result<i8, OutOfRange> {
    // Sign cleared, the bits of either format order like the magnitudes.
    let max = values.iter().map(|v| v & 0x7fff).max().unwrap_or(0);
    let exp = block_exponent(&[kind.to_f32(max)]);
    exp.map_err(|e| {
        let index = values.iter().position(|v| v & 0x7fff == max).unwrap_or(0);
        OutOfRange { index, value: e.value }
    })
}

/// Quantise `values` (bits of `kind`) straight into a big-endian int16
/// payload with shared exponent `exp`. Values larger than the exponent
/// allows saturate at +-2^B, as for float32.
pub fn quantize_into_payload(kind: Half, values: &[u16], exp: i8, n_sources: usize, payload: &mut [u8]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE {
        payload.iter_mut().for_each(|b| *b = 0);
        return;
    }
    let (scale, limit) = quantize_scale(frac_bits(n_sources), exp);
    let n = values.len().min(payload.len() / 2);
    let (values, payload) = (&values[..n], &mut payload[..2 * n]);
    #[cfg(target_arch = "x86_64")]
    if simd::available() && simd::F32_NORMAL_POW2.contains(&scale) {
        // SAFETY: the CPU has AVX2 and F16C (checked above).
        let done = unsafe { simd::quantize_be(kind, values, scale as f32, limit as f32, payload) };
        return quantize_portable(kind, &values[done..], scale, limit, &mut payload[2 * done..]);
    }
    quantize_portable(kind, values, scale, limit, payload);
}

fn quantize_portable(kind: Half, values: &[u16], scale: f64, limit: f64, payload: &mut [u8]) {
    for (dst, &v) in payload.chunks_exact_mut(2).zip(values) {
        // |q| <= 2^B <= 2^14: an int16
        let q = quantize_one(kind.to_f32(v), scale, limit) as i16;
        dst.copy_from_slice(&q.to_be_bytes());
    }
}

/// Turn a big-endian int16 payload of sums back into values of `kind`
/// (NaN everywhere for a block with a non-finite source), divided by
/// `divisor` (1 for the sum; the sources summed for a mean, 0 for a block
/// that summed none, which stays zero). The division happens before the one
/// rounding to `kind`: a mean that fits is never infinite, though its sum
/// would be.
pub fn dequantize_from_payload(kind: Half, payload: &[u8], exp: i8, n_sources: usize, divisor: u16, out: &mut [u16]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE || divisor == 0 {
        let fill = if exp == EXP_NON_FINITE { kind.from_f64(f64::NAN) } else { 0 };
        out.iter_mut().for_each(|x| *x = fill);
        return;
    }
    let scale = pow2(exp as i32 - frac_bits(n_sources)) / divisor as f64;
    let n = out.len().min(payload.len() / 2);
    let (payload, out) = (&payload[..2 * n], &mut out[..n]);
    // int16 -> f32 is exact and so is a product by a power of two, so the
    // eight-wide f32 loop rounds once only for such a scale (a sum, or a
    // mean over 2^k sources); any other mean goes through f64
    #[cfg(target_arch = "x86_64")]
    if simd::available() && is_pow2(scale) && simd::F32_NORMAL_POW2.contains(&scale) {
        // SAFETY: the CPU has AVX2 and F16C (checked above).
        let done = unsafe { simd::dequantize_be(kind, payload, scale as f32, out) };
        return dequantize_portable(kind, &payload[2 * done..], scale, &mut out[done..]);
    }
    dequantize_portable(kind, payload, scale, out);
}

fn dequantize_portable(kind: Half, payload: &[u8], scale: f64, out: &mut [u16]) {
    for (x, src) in out.iter_mut().zip(payload.chunks_exact(2)) {
        *x = kind.from_f64(i16::from_be_bytes([src[0], src[1]]) as f64 * scale);
    }
}

/// The loops between 16-bit floats and big-endian int16 payloads, eight
/// elements at a time with AVX2 and F16C (`vcvtph2ps`, `vcvtps2ph`), in
/// single precision. They give the portable loops' bits because, for a
/// `scale` that is a normal f32 (the caller checks):
///
/// * quantising: a 16-bit value is exact in f32 and so is its product by a
///   power of two while it is a normal number; a subnormal product is below
///   2^-126 and rounds to 0 either way, an infinite one clamps to the bound
///   as the larger f64 does; NaN clamps to the lower bound in both
///   (`maxps` returns its second operand, `f64::max` the non-NaN one);
///   rounding to an integer is to nearest even in both.
/// * dequantising: a lane `q` (|q| <= 2^15) times a power of two is exact in
///   f32 unless it is below 2^-149 (where it rounds to 0 in float16 either
///   way, and f32 rounding of an exact f64 product is what the portable
///   bfloat16 path does too), so converting it once to 16 bits (round to
///   nearest even; `vcvtps2ph` with the immediate 0, bfloat16 with the
///   integer rounding of `bf16_from_f32`) is the portable loop's single
///   rounding of the exact f64 product. No NaN can arise from finite lanes.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::Half;

    /// Powers of two an f32 holds as a normal number.
    pub(super) const F32_NORMAL_POW2: std::ops::RangeInclusive<f64> =
        1.0 / (1u128 << 126) as f64..=(1u128 << 127) as f64;

    /// AVX2 and F16C, and `FANIN_SIMD` not `portable` (decided once).
    pub(super) fn available() -> bool {
        use std::sync::OnceLock;
        static F16C: OnceLock<bool> = OnceLock::new();
        *F16C.get_or_init(|| fanin_wire::simd::avx2() && std::is_x86_feature_detected!("f16c"))
    }

    /// `pshufb` mask swapping the two bytes of each 16-bit lane.
    #[inline(always)]
    unsafe fn bswap16_mask() -> __m128i {
        _mm_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
    }

    /// Eight 16-bit floats as f32.
    #[inline(always)]
    unsafe fn widen(kind: Half, bits: __m128i) -> __m256 {
        match kind {
            Half::F16 => _mm256_cvtph_ps(bits),
            Half::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits))),
        }
    }

    /// Eight f32 rounded to 16-bit floats, to nearest even.
    #[inline(always)]
    unsafe fn narrow(kind: Half, x: __m256) -> __m128i {
        match kind {
            Half::F16 => _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
            Half::BF16 => {
                let b = _mm256_castps_si256(x);
                let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
                let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)));
                _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
            }
        }
    }

    /// Quantise the whole eights of `values` into `payload`; returns how many
    /// elements it did.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `payload.len() == 2 * values.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn quantize_be(kind: Half, values: &[u16], scale: f32, limit: f32, payload: &mut [u8]) -> usize {
        let (s, lo, hi) = (_mm256_set1_ps(scale), _mm256_set1_ps(-limit), _mm256_set1_ps(limit));
        let mask = bswap16_mask();
        let whole = values.len() / 8 * 8;
        let (src, dst) = (values.as_ptr(), payload.as_mut_ptr());
        let mut i = 0;
        while i < whole {
            let x = widen(kind, _mm_loadu_si128(src.add(i) as *const __m128i));
            // maxps returns its second operand when either is NaN: the bound
            let q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, s), lo), hi));
            // |q| <= 2^14: packing to int16 never saturates
            let q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            _mm_storeu_si128(dst.add(2 * i) as *mut __m128i, _mm_shuffle_epi8(q16, mask));
            i += 8;
        }
        whole
    }

    /// Dequantise the whole eights of `payload` into `out`; returns how many
    /// elements it did.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `payload.len() == 2 * out.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dequantize_be(kind: Half, payload: &[u8], scale: f32, out: &mut [u16]) -> usize {
        let s = _mm256_set1_ps(scale);
        let mask = bswap16_mask();
        let whole = out.len() / 8 * 8;
        let (src, dst) = (payload.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < whole {
            let q = _mm_shuffle_epi8(_mm_loadu_si128(src.add(2 * i) as *const __m128i), mask);
            let x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(q)), s);
            _mm_storeu_si128(dst.add(i) as *mut __m128i, narrow(kind, x));
            i += 8;
        }
        whole
    }
}

/// The documented worst-case absolute error of a 16-bit block floating point
/// sum before the final rounding to 16 bits (infinite for a non-finite
/// block, whose result is NaN).
pub fn error_bound(exp: i8, n_sources: usize) -> f64 {
    if exp == EXP_NONE {
        return 0.0;
    }
    if exp == EXP_NON_FINITE {
        return f64::INFINITY;
    }
    n_sources as f64 * pow2(exp as i32 - frac_bits(n_sources) - 1)
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = (h >> 10) & 0x1f;
    let frac = (h & 0x3ff) as u32;
    match exp {
        // subnormal: frac * 2^-24, exact in f32
        0 => sign * frac as f32 * f32::from_bits(0x3380_0000),
        31 => f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7f80_0000 | (frac << 13)),
        _ => f32::from_bits(((h as u32 & 0x8000) << 16) | ((exp as u32 + 112) << 23) | (frac << 13)),
    }
}

fn f16_from_f64(x: f64) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7e00;
    }
    // 65520 is halfway between the largest float16 (65504, odd fraction)
    // and 2^16: ties to even round it up, to infinity.
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    // At most half the smallest subnormal (2^-24): ties to even give 0.
    if a <= pow2(-25) {
        return sign;
    }
    let exp = ((a.to_bits() >> 52) as i32) - 1023; // a is a normal f64 here
    // The unit of the last place at this magnitude: subnormals share 2^-24.
    let ulp_exp = if exp < -14 { -24 } else { exp - 10 };
    // Exact (a power-of-two scaling), then rounded once, ties to even.
    let units = (a * pow2(-ulp_exp)).round_ties_even() as u32;
    // A carry out of the fraction (units == 2048, or 1024 for the largest
    // subnormal) lands on the next exponent by itself.
    let bits = if exp < -14 { units } else { (((exp + 15) as u32) << 10) + (units - 1024) };
    sign | bits as u16
}

fn bf16_from_f32(f: f32) -> u16 {
    let b = f.to_bits();
    if f.is_nan() {
        return ((b >> 16) | 0x0040) as u16; // stays a (quiet) NaN
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float16_converts_exactly_and_back() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                assert!(f16_to_f32(f16_from_f64(x as f64)).is_nan());
                continue;
            }
            assert_eq!(f16_from_f64(x as f64), bits, "{bits:#06x} = {x}");
        }
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    }

    #[test]
    fn float16_rounds_to_nearest_with_ties_to_even() {
        // Between every two neighbours (positive finite): just below, at and
        // just above the midpoint.
        for bits in 0..0x7bffu16 {
            let (lo, hi) = (f16_to_f32(bits) as f64, f16_to_f32(bits + 1) as f64);
            let mid = (lo + hi) / 2.0;
            let even = if bits % 2 == 0 { bits } else { bits + 1 };
            assert_eq!(f16_from_f64(mid), even, "tie at {mid}");
            assert_eq!(f16_from_f64(mid - (hi - lo) / 8.0), bits);
            assert_eq!(f16_from_f64(mid + (hi - lo) / 8.0), bits + 1);
            assert_eq!(f16_from_f64(-mid), even | 0x8000);
        }
        assert_eq!(f16_from_f64(65519.99), 0x7bff);
        assert_eq!(f16_from_f64(65520.0), 0x7c00, "the tie above the largest rounds to infinity");
        assert_eq!(f16_from_f64(1e300), 0x7c00);
        assert_eq!(f16_from_f64(2f64.powi(-25)), 0, "the tie below the smallest subnormal rounds to 0");
        assert_eq!(f16_from_f64(2f64.powi(-25) * 1.01), 1);
    }

    #[test]
    fn every_bfloat16_converts_exactly_and_back_and_rounds_to_even() {
        for bits in 0..=u16::MAX {
            let x = Half::BF16.to_f32(bits);
            if x.is_nan() {
                assert!(Half::BF16.to_f32(Half::BF16.from_f64(x as f64)).is_nan());
                continue;
            }
            assert_eq!(Half::BF16.from_f64(x as f64), bits);
        }
        // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: to even (1.0)
        assert_eq!(Half::BF16.from_f64(1.0 + 2f64.powi(-8)), 0x3f80);
        assert_eq!(Half::BF16.from_f64(1.0 + 3.0 * 2f64.powi(-8)), 0x3f82, "tie to even upwards");
    }

    /// The AVX2/F16C loops against the portable ones, bit for bit: every
    /// 16-bit pattern (NaN, infinities, subnormals included) quantised, and
    /// every int16 lane dequantised, for exponents from the smallest the
    /// vector path takes to ones whose products overflow or underflow f32
    /// and float16, with 1 to 8192 sources.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_loops_give_the_portable_bits() {
        if !simd::available() {
            eprintln!("skipped: this CPU has no AVX2 and F16C");
            return;
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let lanes: Vec<u8> = all.iter().flat_map(|v| v.to_be_bytes()).collect();
        for kind in [Half::F16, Half::BF16] {
            for n in [1usize, 3, 4, 8192] {
                for exp in [-127i8, -120, -100, -30, -20, -14, -1, 0, 1, 5, 16, 17, 40, 100, 125, 126] {
                    let (scale, limit) = quantize_scale(frac_bits(n), exp);
                    let (mut fast, mut slow) = (vec![0u8; lanes.len()], vec![0u8; lanes.len()]);
                    quantize_into_payload(kind, &all, exp, n, &mut fast);
                    quantize_portable(kind, &all, scale, limit, &mut slow);
                    assert_eq!(fast, slow, "quantise {kind:?} exp {exp} n {n}");
                    // a sum, and means (divided by a power of two in the
                    // vector loop, by 3 in f64)
                    for divisor in [1u16, 2, 3, 4] {
                        let scale = pow2(exp as i32 - frac_bits(n)) / divisor as f64;
                        let (mut fast, mut slow) = (vec![0u16; all.len()], vec![0u16; all.len()]);
                        dequantize_from_payload(kind, &lanes, exp, n, divisor, &mut fast);
                        dequantize_portable(kind, &lanes, scale, &mut slow);
                        assert_eq!(fast, slow, "dequantise {kind:?} exp {exp} n {n} divisor {divisor}");
                    }
                }
            }
            // a length that is not a multiple of eight: the tail is portable
            let (mut fast, mut slow) = (vec![0u8; 2 * 13], vec![0u8; 2 * 13]);
            quantize_into_payload(kind, &all[1000..1013], 3, 4, &mut fast);
            let (scale, limit) = quantize_scale(frac_bits(4), 3);
            quantize_portable(kind, &all[1000..1013], scale, limit, &mut slow);
            assert_eq!(fast, slow);
        }
    }

    /// docs/protocol.md §9: float16 1.5 and bfloat16 -0.75 with exponent 1
    /// for 4 sources (B = 12) are the lanes 3072 and -1536, and back.
    #[test]
    fn golden_quantisation_vectors() {
        let mut payload = [0u8; 4];
        quantize_into_payload(Half::F16, &[0x3e00, 0x0000], 1, 4, &mut payload);
        assert_eq!(payload, [0x0c, 0x00, 0x00, 0x00]);
        quantize_into_payload(Half::BF16, &[0xbf40, 0x3f80], 1, 4, &mut payload);
        assert_eq!(payload, [0xfa, 0x00, 0x08, 0x00]);
        let mut out = [0u16; 2];
        dequantize_from_payload(Half::BF16, &payload, 1, 4, 1, &mut out);
        assert_eq!(out, [0xbf40, 0x3f80]);
        dequantize_from_payload(Half::F16, &[0x0c, 0x00, 0x00, 0x00], 1, 4, 1, &mut out);
        assert_eq!(out, [0x3e00, 0x0000]);
    }

    #[test]
    fn exponents_of_16_bit_blocks_and_what_is_refused() {
        let f16 = |x: f64| f16_from_f64(x);
        assert_eq!(block_exponent_half(Half::F16, &[f16(0.75), f16(-3.0)]), Ok(2));
        assert_eq!(block_exponent_half(Half::F16, &[0, 0x8000]), Ok(EXP_NONE));
        // NaN and infinity (either sign) mark the block; its result is NaN
        for v in [0x7c00, 0xfc00, 0x7e00, 0x7c01] {
            assert_eq!(block_exponent_half(Half::F16, &[f16(1.0), v]), Ok(EXP_NON_FINITE), "{v:#x}");
        }
        for v in [0x7f80, 0xff80, 0x7fc0] {
            assert_eq!(block_exponent_half(Half::BF16, &[0x3f80, v]), Ok(EXP_NON_FINITE), "{v:#x}");
        }
        assert_eq!(block_exponent_half(Half::F16, &[0x7bff]), Ok(16), "float16's largest finite value");
        assert_eq!(block_exponent_half(Half::BF16, &[0x3f80]), Ok(1));
        let err = block_exponent_half(Half::BF16, &[0x3f80, 0x7e80]).unwrap_err();
        assert_eq!((err.index, err.value), (1, 2f32.powi(126)), "bfloat16 of 2^126 and above");
        assert!(block_exponent_half(Half::BF16, &[0x7f7f]).is_err());
        for kind in [Half::F16, Half::BF16] {
            let mut payload = [0xffu8; 4];
            quantize_into_payload(kind, &[0x3c00, 0x7c00], EXP_NON_FINITE, 2, &mut payload);
            assert_eq!(payload, [0; 4]);
            let mut out = [0u16; 2];
            dequantize_from_payload(kind, &[0, 1, 0, 2], EXP_NON_FINITE, 2, 1, &mut out);
            assert!(out.iter().all(|&x| kind.to_f32(x).is_nan()), "{kind:?}: {out:?}");
        }
        assert!(check_sources(MAX_SOURCES).is_ok() && check_sources(MAX_SOURCES + 1).is_err());
        assert_eq!(frac_bits(1), 14);
        assert_eq!(frac_bits(4), 12);
        assert_eq!(frac_bits(5), 11);
    }

    #[test]
    fn sums_fit_the_lane_and_stay_within_the_bound() {
        // N sources at the largest magnitude the exponent allows, with the
        // same sign: the int16 sum is at most 2^14.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for kind in [Half::F16, Half::BF16] {
            for n in [1usize, 2, 3, 4, 7, 8, 64, 256] {
                for _ in 0..200 {
                    let blocks: Vec<Vec<u16>> = (0..n)
                        .map(|_| {
                            (0..16)
                                .map(|_| {
                                    let mag = (next() % 60_000) as f64 / 1000.0 * [1.0, 1e-3, 1e-6][next() as usize % 3];
                                    kind.from_f64(if next() % 2 == 0 { mag } else { -mag })
                                })
                                .collect()
                        })
                        .collect();
                    let exp = blocks.iter().map(|b| block_exponent_half(kind, b).unwrap()).max().unwrap();
                    let mut sum = [0i32; 16];
                    for block in &blocks {
                        let mut payload = [0u8; 32];
                        quantize_into_payload(kind, block, exp, n, &mut payload);
                        for (s, q) in sum.iter_mut().zip(payload.chunks_exact(2)) {
                            *s += i16::from_be_bytes([q[0], q[1]]) as i32;
                        }
                    }
                    assert!(sum.iter().all(|s| s.abs() <= 1 << 14), "{kind:?} n={n}: {sum:?}");
                    let payload: Vec<u8> = sum.iter().flat_map(|s| (*s as i16).to_be_bytes()).collect();
                    let mut out = [0u16; 16];
                    dequantize_from_payload(kind, &payload, exp, n, 1, &mut out);
                    for (i, &got) in out.iter().enumerate() {
                        let exact: f64 = blocks.iter().map(|b| kind.to_f32(b[i]) as f64).sum();
                        let got = kind.to_f32(got) as f64;
                        let ulp = match kind {
                            Half::F16 => 2f64.powi((exact.abs().max(6.2e-5).log2().floor() as i32) - 10),
                            Half::BF16 => 2f64.powi((exact.abs().max(1e-30).log2().floor() as i32) - 7),
                        };
                        let bound = error_bound(exp, n) + ulp;
                        assert!((got - exact).abs() <= bound, "{kind:?} n={n} i={i}: {got} vs {exact} (bound {bound})");
                    }
                }
            }
        }
    }
}
