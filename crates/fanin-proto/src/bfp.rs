//! Block floating point, as SwitchML carries float32 through an integer
//! switch: all sources scale a block with one shared exponent, negotiated as
//! the maximum of their local exponents, so the switch only adds int32s.
//!
//! With `e` the shared exponent (every |x| < 2^e) and `N` sources, values are
//! quantised as `q = round(x * 2^(B - e))` with `B = 30 - ceil(log2 N)`, so
//! |q| <= 2^B and the sum of N of them is at most 2^30: **the int32 sum can
//! never overflow**. Dequantisation is `sum * 2^(e - B)`, exact in f64 and
//! rounded once to f32.
//!
//! Error bound (documented in docs/protocol.md and checked by the tests):
//! |result - exact_sum| <= N * 2^(e - B - 1) + ulp(result)
//! (the final rounding to f32 is half an ulp; the tests allow one).
//! For 4 sources B = 28: 28 bits of the block maximum, more than f32 carries.

use fanin_wire::value::{EXP_NONE, EXP_NON_FINITE};

pub mod half;

/// Fraction bits used for `n_sources` sources.
pub fn frac_bits(n_sources: usize) -> i32 {
    let n = n_sources.max(1) as u64;
    let ceil_log2 = 64 - (n - 1).leading_zeros() as i32; // 0 for n == 1
    30 - ceil_log2
}

/// A finite value too large for block floating point (|x| >= 2^126): the
/// exponent byte's top value is [`EXP_NON_FINITE`]. NaN and infinity are
/// carried (the block's result is NaN), not refused.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("element {index} is {value}: block floating point carries finite values below 2^126 in magnitude (NaN and infinity are carried as a non-finite block)")]
pub struct OutOfRange {
    pub index: usize,
    pub value: f32,
}

/// 2^126 as f32 bits: the smallest finite magnitude refused.
const OUT_OF_RANGE_BITS: u32 = 0x7e80_0000;
/// +infinity as f32 bits: this or above (NaN) makes a non-finite block.
const INFINITY_BITS: u32 = 0x7f80_0000;

/// The exponent `e` with every |x| < 2^e (frexp's exponent of the largest
/// magnitude), [`EXP_NONE`] for an all-zero block, or [`EXP_NON_FINITE`]
/// for a block holding a NaN or an infinity (its result is NaN in every
/// element on every rank, as a sum with a NaN would be in Gloo for the
/// elements concerned; AMP's loss scaler skips such a step).
///
/// The exponent travels in one signed byte whose top value is the
/// non-finite marker, so finite blocks are kept in `-127..=126`: blocks
/// whose largest magnitude is below 2^-127 use -127 (their values are below
/// the quantum and round to zero, an error far under the bound), and a
/// finite magnitude of 2^126 or more is refused ([`OutOfRange`]).
///
/// Works on the bit patterns: for non-negative floats the integer order of
/// the bits is the numeric order (infinity above every finite value, NaN
/// above infinity), so the maximum is an integer `max` that the compiler
/// vectorises.
pub fn block_exponent(values: &[f32]) -> Result<i8, OutOfRange> {
    let max_bits = max_abs_bits(values);
    if max_bits >= INFINITY_BITS {
        return Ok(EXP_NON_FINITE);
    }
    if max_bits >= OUT_OF_RANGE_BITS {
        let index = values.iter().position(|v| v.to_bits() & 0x7fff_ffff >= OUT_OF_RANGE_BITS).unwrap_or(0);
        return Err(OutOfRange { index, value: values[index] });
    }
    if max_bits == 0 {
        return Ok(EXP_NONE);
    }
    let biased = (max_bits >> 23) as i32;
    let e = if biased == 0 {
        // subnormal: value = mantissa * 2^-149, mantissa < 2^23
        let mantissa = max_bits & 0x007f_ffff;
        (32 - mantissa.leading_zeros() as i32) - 149
    } else {
        biased - 126
    };
    Ok(e.max(-127) as i8)
}

/// The largest `|v|` of `values` as IEEE bits (sign cleared; NaN and
/// infinity above every finite value), 0 for an empty slice. A pass over the
/// whole tensor before anything is sent (exponents are announced a window
/// ahead), so it has an AVX2 loop: the baseline build cannot vectorise an
/// unsigned max (SSE2 has none), and a profile had this pass at 10 % of a
/// worker's CPU.
pub fn max_abs_bits(values: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if fanin_wire::simd::avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { simd::max_abs_bits_avx2(values) };
    }
    max_abs_bits_portable(values)
}

fn max_abs_bits_portable(values: &[f32]) -> u32 {
    values.iter().map(|v| v.to_bits() & 0x7fff_ffff).max().unwrap_or(0)
}

/// Adding and subtracting 1.5 * 2^52 rounds an f64 below 2^51 in magnitude to
/// the nearest integer, ties to even (IEEE default rounding), with plain
/// arithmetic the compiler vectorises, unlike a call to `rint`.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

#[inline(always)]
fn quantize_one(x: f32, scale: f64, limit: f64) -> i32 {
    // max/min (unlike clamp) turn NaN into a bound, so `v` is always finite
    // and within +-2^30.
    let v = (x as f64 * scale).max(-limit).min(limit);
    let rounded = (v + ROUND_MAGIC) - ROUND_MAGIC;
    // SAFETY: `rounded` is finite and |rounded| <= 2^30 < 2^31, so it is
    // representable as i32; the unchecked conversion lets the loop vectorise
    // (the checked `as` adds NaN and saturation handling per element).
    unsafe { rounded.to_int_unchecked::<i32>() }
}

/// `(scale, limit)` of a quantisation with `b` fraction bits and shared
/// exponent `exp`: `q = clamp(x * scale, -limit, limit)`, rounded.
fn quantize_scale(b: i32, exp: i8) -> (f64, f64) {
    (pow2(b - exp as i32), pow2(b))
}

/// 2^k as f64 for the range block floating point needs (|k| < 400).
fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `x` is a (normal) power of two: multiplying by it is exact.
fn is_pow2(x: f64) -> bool {
    x.is_normal() && x > 0.0 && x.to_bits() & ((1u64 << 52) - 1) == 0
}

/// Quantise `values` with shared exponent `exp` for `n_sources` sources.
/// Values larger than the exponent allows (a source that announced a smaller
/// exponent, or none) saturate at +-2^B instead of overflowing the sum. A
/// block without an exponent or with a non-finite one sends zeros (its
/// result is 0, or NaN from the exponent alone).
pub fn quantize(values: &[f32], exp: i8, n_sources: usize, out: &mut [i32]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE {
        out.iter_mut().for_each(|q| *q = 0);
        return;
    }
    let (scale, limit) = quantize_scale(frac_bits(n_sources), exp);
    for (q, &x) in out.iter_mut().zip(values) {
        *q = quantize_one(x, scale, limit);
    }
}

/// Quantise straight into a big-endian packet payload.
pub fn quantize_into_payload(values: &[f32], exp: i8, n_sources: usize, payload: &mut [u8]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE {
        payload.iter_mut().for_each(|b| *b = 0);
        return;
    }
    let (scale, limit) = quantize_scale(frac_bits(n_sources), exp);
    let n = values.len().min(payload.len() / 4);
    let (values, payload) = (&values[..n], &mut payload[..4 * n]);
    #[cfg(target_arch = "x86_64")]
    if fanin_wire::simd::avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { simd::quantize_be_avx2(values, scale, limit, payload) };
        return;
    }
    quantize_be_portable(values, scale, limit, payload);
}

fn quantize_be_portable(values: &[f32], scale: f64, limit: f64, payload: &mut [u8]) {
    for (dst, &x) in payload.chunks_exact_mut(4).zip(values) {
        dst.copy_from_slice(&quantize_one(x, scale, limit).to_be_bytes());
    }
}

fn dequantize_be_portable(payload: &[u8], scale: f64, out: &mut [f32]) {
    for (x, src) in out.iter_mut().zip(payload.chunks_exact(4)) {
        let s = i32::from_be_bytes([src[0], src[1], src[2], src[3]]);
        *x = (s as f64 * scale) as f32;
    }
}

/// AVX2 versions of the per-element loops between floats and big-endian
/// int32 payloads, chosen at run time ([`fanin_wire::simd`]; a perf
/// profile of the allreduce machines put the baseline SSE2 quantising loop
/// at ~40 % of their CPU). They compute the same thing (the same IEEE
/// operations, rounding to nearest even), eight elements at a time; a test
/// checks they are bit-identical to the portable loops.
#[cfg(target_arch = "x86_64")]
mod simd {
    use fanin_wire::simd::x86::bswap32_mask;
    use std::arch::x86_64::*;

    /// `quantize_one` on four doubles: scale, clamp (max/min return the
    /// bound for NaN, as `f64::max`/`min` do), round to nearest even.
    #[inline(always)]
    unsafe fn quantize4(x: __m128, scale: __m256d, lo: __m256d, hi: __m256d) -> __m128i {
        let v = _mm256_mul_pd(_mm256_cvtps_pd(x), scale);
        // maxpd returns its second operand when either is NaN: the bound.
        let v = _mm256_min_pd(_mm256_max_pd(v, lo), hi);
        // The rounding mode is the default (nearest even) in Rust code.
        _mm256_cvtpd_epi32(v)
    }

    /// Powers of two an f32 holds as a normal number.
    const F32_NORMAL_POW2: std::ops::RangeInclusive<f64> = 1.0 / (1u128 << 126) as f64..=(1u128 << 127) as f64;

    /// # Safety
    /// The CPU must support AVX2; `payload.len() == 4 * values.len()`.
    ///
    /// For a `scale` an f32 holds (every scale but those of exponents near
    /// -128), it works in single precision, eight lanes at once instead of
    /// four, and gives the same integers: `x * scale` is exact in f32
    /// whenever the product is a normal number (a power of two only moves
    /// the exponent); a subnormal product is below 2^-126 and rounds to 0
    /// either way, and one beyond the f32 range (infinity) clamps to the
    /// bound as the larger f64 does; `limit` (2^B, B <= 30) is exact in f32.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_be_avx2(values: &[f32], scale: f64, limit: f64, payload: &mut [u8]) {
        debug_assert_eq!(payload.len(), 4 * values.len());
        let single = F32_NORMAL_POW2.contains(&scale);
        let (s, lo, hi) = (_mm256_set1_pd(scale), _mm256_set1_pd(-limit), _mm256_set1_pd(limit));
        let (s32, lo32, hi32) = (_mm256_set1_ps(scale as f32), _mm256_set1_ps(-limit as f32), _mm256_set1_ps(limit as f32));
        let mask = bswap32_mask();
        let whole = values.len() / 8 * 8;
        let (src, dst) = (values.as_ptr(), payload.as_mut_ptr());
        let mut i = 0;
        while i < whole {
            let x = _mm256_loadu_ps(src.add(i));
            let q = if single {
                // maxps returns its second operand when either is NaN: the bound.
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, s32), lo32), hi32))
            } else {
                let q0 = quantize4(_mm256_castps256_ps128(x), s, lo, hi);
                let q1 = quantize4(_mm256_extractf128_ps::<1>(x), s, lo, hi);
                _mm256_set_m128i(q1, q0)
            };
            _mm256_storeu_si256(dst.add(4 * i) as *mut __m256i, _mm256_shuffle_epi8(q, mask));
            i += 8;
        }
        super::quantize_be_portable(&values[whole..], scale, limit, &mut payload[4 * whole..]);
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_abs_bits_avx2(values: &[f32]) -> u32 {
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        // two accumulators, so consecutive maxes do not wait on each other
        let (mut m0, mut m1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        let whole = values.len() / 16 * 16;
        let src = values.as_ptr();
        let mut i = 0;
        while i < whole {
            let a = _mm256_and_si256(_mm256_loadu_si256(src.add(i) as *const __m256i), abs);
            let b = _mm256_and_si256(_mm256_loadu_si256(src.add(i + 8) as *const __m256i), abs);
            m0 = _mm256_max_epu32(m0, a);
            m1 = _mm256_max_epu32(m1, b);
            i += 16;
        }
        let mut lanes = [0u32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, _mm256_max_epu32(m0, m1));
        let tail = super::max_abs_bits_portable(&values[whole..]);
        lanes.into_iter().fold(tail, u32::max)
    }

    /// # Safety
    /// The CPU must support AVX2; `payload.len() == 4 * out.len()`.
    ///
    /// When every product of an int32 (|s| <= 2^31) and `scale` is a normal
    /// f32, it works in single precision (eight lanes instead of four) and
    /// gives the same floats: rounding an int32 to f32 and then scaling by a
    /// power of two is exact scaling and then the same rounding as long as
    /// nothing leaves the normal range; 0 stays +0.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dequantize_be_avx2(payload: &[u8], scale: f64, out: &mut [f32]) {
        debug_assert_eq!(payload.len(), 4 * out.len());
        // one f32 multiply rounds once only by an exact power of two (the
        // mean's scale, divided by the sources, is not)
        let single = super::is_pow2(scale) && F32_NORMAL_POW2.contains(&scale) && scale <= (1u128 << 96) as f64;
        let (s, s32) = (_mm256_set1_pd(scale), _mm256_set1_ps(scale as f32));
        let mask = bswap32_mask();
        let whole = out.len() / 8 * 8;
        let (src, dst) = (payload.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < whole {
            let q = _mm256_shuffle_epi8(_mm256_loadu_si256(src.add(4 * i) as *const __m256i), mask);
            let f = if single {
                _mm256_mul_ps(_mm256_cvtepi32_ps(q), s32)
            } else {
                // int32 -> f64 is exact, the product by a power of two too;
                // cvtpd2ps rounds to nearest even, as `as f32` does.
                let f0 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(q)), s));
                let f1 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256::<1>(q)), s));
                _mm256_set_m128(f1, f0)
            };
            _mm256_storeu_ps(dst.add(i), f);
            i += 8;
        }
        super::dequantize_be_portable(&payload[4 * whole..], scale, &mut out[whole..]);
    }
}

/// Turn aggregated int32 sums back into floats (NaN everywhere for a
/// block with a non-finite source).
pub fn dequantize(sums: &[i32], exp: i8, n_sources: usize, out: &mut [f32]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE {
        out.iter_mut().for_each(|x| *x = if exp == EXP_NONE { 0.0 } else { f32::NAN });
        return;
    }
    let scale = pow2(exp as i32 - frac_bits(n_sources));
    for (x, &s) in out.iter_mut().zip(sums) {
        *x = (s as f64 * scale) as f32;
    }
}

/// Dequantise straight from a big-endian packet payload, divided by
/// `divisor` (1 for the sum; the sources summed for a mean, 0 for a block
/// that summed none, which stays zero). The division happens in f64 before
/// the one rounding to f32.
pub fn dequantize_from_payload(payload: &[u8], exp: i8, n_sources: usize, divisor: u16, out: &mut [f32]) {
    if exp == EXP_NONE || exp == EXP_NON_FINITE || divisor == 0 {
        out.iter_mut().for_each(|x| *x = if exp == EXP_NON_FINITE { f32::NAN } else { 0.0 });
        return;
    }
    let scale = pow2(exp as i32 - frac_bits(n_sources)) / divisor as f64;
    let n = out.len().min(payload.len() / 4);
    let (payload, out) = (&payload[..4 * n], &mut out[..n]);
    #[cfg(target_arch = "x86_64")]
    if fanin_wire::simd::avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { simd::dequantize_be_avx2(payload, scale, out) };
        return;
    }
    dequantize_be_portable(payload, scale, out);
}

/// The documented worst-case absolute error of a block-floating-point sum of
/// `n_sources` blocks with shared exponent `exp`, before the final rounding
/// of the result to f32 (infinite for a non-finite block, whose result is
/// NaN).
pub fn error_bound(exp: i8, n_sources: usize) -> f64 {
    if exp == EXP_NONE {
        return 0.0;
    }
    if exp == EXP_NON_FINITE {
        return f64::INFINITY;
    }
    n_sources as f64 * pow2(exp as i32 - frac_bits(n_sources) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frac_bits_leave_room_for_the_sum() {
        assert_eq!(frac_bits(1), 30);
        assert_eq!(frac_bits(2), 29);
        assert_eq!(frac_bits(4), 28);
        assert_eq!(frac_bits(5), 27);
        assert_eq!(frac_bits(256), 22);
        for n in [1usize, 2, 3, 4, 7, 16, 255, 256, 1000, 4096] {
            assert!((n as i64) << frac_bits(n) <= 1 << 30);
        }
    }

    #[test]
    fn exponent_matches_frexp() {
        assert_eq!(block_exponent(&[0.0, -0.0]).unwrap(), EXP_NONE);
        assert_eq!(block_exponent(&[1.0]).unwrap(), 1); // 1 < 2^1
        assert_eq!(block_exponent(&[0.5]).unwrap(), 0);
        assert_eq!(block_exponent(&[-3.0, 0.1]).unwrap(), 2);
        assert_eq!(block_exponent(&[f32::from_bits(0x7e7f_ffff)]).unwrap(), 126, "just below 2^126");
        assert_eq!(block_exponent(&[f32::from_bits(1)]).unwrap(), -127);
        assert_eq!(block_exponent(&[f32::MIN_POSITIVE]).unwrap(), -125);
    }

    #[test]
    fn nan_and_infinity_mark_the_block_and_huge_finite_values_are_refused() {
        for v in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x7f80_0001)] {
            assert_eq!(block_exponent(&[1.0, v, 3.0e38]), Ok(EXP_NON_FINITE), "{v}");
        }
        // 2^126 and above (finite) would need the marker's byte: refused,
        // named by index
        for v in [f32::from_bits(OUT_OF_RANGE_BITS), -1.0e38, f32::MAX] {
            assert_eq!(block_exponent(&[0.5, 2.0, v]), Err(OutOfRange { index: 2, value: v }));
        }
        // a marked block sends zeros and comes back NaN in every element
        let mut q = [7i32; 3];
        quantize(&[1.0, f32::NAN, 2.0], EXP_NON_FINITE, 3, &mut q);
        assert_eq!(q, [0; 3]);
        let mut payload = [0xffu8; 12];
        quantize_into_payload(&[1.0, f32::INFINITY, 2.0], EXP_NON_FINITE, 3, &mut payload);
        assert_eq!(payload, [0; 12]);
        let mut out = [1.0f32; 3];
        dequantize(&[5, 6, 7], EXP_NON_FINITE, 3, &mut out);
        assert!(out.iter().all(|x| x.is_nan()));
        let mut out = [1.0f32; 3];
        dequantize_from_payload(&[1u8; 12], EXP_NON_FINITE, 3, 1, &mut out);
        assert!(out.iter().all(|x| x.is_nan()));
        assert_eq!(error_bound(EXP_NON_FINITE, 3), f64::INFINITY);
        // the marker is the largest exponent byte: a switch's `max` keeps it
        assert_eq!(EXP_NON_FINITE, i8::MAX);
    }

    #[test]
    fn nan_inputs_to_quantize_stay_defined() {
        // callers check for NaN first (block_exponent); quantize itself must
        // still never hit undefined behaviour
        let mut q = [7i32; 2];
        quantize(&[f32::NAN, -f32::NAN], 0, 1, &mut q);
        assert!(q.iter().all(|v| v.unsigned_abs() <= 1 << 30));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_loops_equal_the_portable_ones_bit_for_bit() {
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let mut rng = crate::fault::SplitMix64::new(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.next_u64();
        let specials = [0.5f32, 1.5, 2.5, -0.5, -2.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-40, 3.0e38];
        for len in 0..40usize {
            // both precisions: the f32 loops take scales an f32 holds; the
            // last ones are just inside and just outside their ranges
            for (exp, n) in [(1i8, 4usize), (-20, 3), (30, 1), (0, 1024), (-127, 2), (-97, 1), (-98, 1), (126, 1), (127, 1)] {
                let values: Vec<f32> = (0..len)
                    .map(|i| match next() % 4 {
                        0 => specials[i % specials.len()],
                        1 => f32::from_bits(next() as u32),
                        // halves land on exact ties after scaling
                        2 => (next() % 1000) as f32 * 0.5 * pow2(exp as i32 - frac_bits(n)) as f32,
                        _ => ((next() % 2000) as f32 - 1000.0) / 1000.0 * pow2(exp as i32) as f32,
                    })
                    .collect();
                let b = frac_bits(n);
                let (scale, limit) = (pow2(b - exp as i32), pow2(b));
                let mut portable = vec![0u8; 4 * len];
                let mut simd = vec![0u8; 4 * len];
                quantize_be_portable(&values, scale, limit, &mut portable);
                unsafe { simd::quantize_be_avx2(&values, scale, limit, &mut simd) };
                assert_eq!(portable, simd, "quantize, len {len}, exp {exp}, n {n}");
                let raw: Vec<u8> = (0..4 * len).map(|_| next() as u8).collect();
                // the sum's scale, and a mean's over three sources (not a
                // power of two: the f32 loop would round twice)
                for divisor in [1.0, 3.0] {
                    let inv = pow2(exp as i32 - b) / divisor;
                    let (mut a, mut c) = (vec![0f32; len], vec![0f32; len]);
                    dequantize_be_portable(&raw, inv, &mut a);
                    unsafe { simd::dequantize_be_avx2(&raw, inv, &mut c) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&c), "dequantize, len {len}, exp {exp}, n {n}, divisor {divisor}");
                }
                let wide: Vec<f32> = (0..len * 3).map(|i| values.get(i).copied().unwrap_or(-(i as f32))).collect();
                for v in [&values[..], &wide[..]] {
                    assert_eq!(max_abs_bits_portable(v), unsafe { simd::max_abs_bits_avx2(v) }, "max, len {}", v.len());
                }
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        let mut q = [0i32; 6];
        // exponent 1 with one source: scale 2^29, so x = k * 2^-29 maps to k
        let unit = 2f32.powi(-29);
        quantize(&[0.5 * unit, 1.5 * unit, 2.5 * unit, -0.5 * unit, -1.5 * unit, 1.0], 1, 1, &mut q);
        assert_eq!(q, [0, 2, 2, 0, -2, 1 << 29]);
    }

    #[test]
    fn extreme_values_never_overflow_the_sum() {
        let n = 16;
        let vals = [8.0e37, -8.0e37, 8.0e37]; // just below 2^126
        let e = block_exponent(&vals).unwrap();
        let mut q = [0i32; 3];
        quantize(&vals, e, n, &mut q);
        let mut acc = [0i32; 3];
        for _ in 0..n {
            for (a, v) in acc.iter_mut().zip(q) {
                *a = a.checked_add(v).expect("no overflow");
            }
        }
        let mut out = [0f32; 3];
        dequantize(&acc, e, n, &mut out);
        // 16 * 8e37 exceeds the f32 range: the float result is honestly infinite
        assert_eq!(out, [f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY]);
    }

    proptest! {
        #[test]
        fn sum_within_documented_bound(
            n in 1usize..20,
            seed in proptest::collection::vec(-1.0e6f32..1.0e6, 1..50),
            scale_exp in -60i32..60,
        ) {
            let scale = 2f32.powi(scale_exp);
            let blocks: Vec<Vec<f32>> = (0..n)
                .map(|w| seed.iter().map(|v| v * scale * (1.0 + w as f32 * 0.37)).collect())
                .collect();
            let e = blocks.iter().map(|b| block_exponent(b).unwrap()).max().unwrap();
            let mut acc = vec![0i32; seed.len()];
            for b in &blocks {
                let mut q = vec![0; b.len()];
                quantize(b, e, n, &mut q);
                for (a, v) in acc.iter_mut().zip(q) { *a = a.checked_add(v).expect("sum fits int32"); }
            }
            let mut out = vec![0f32; seed.len()];
            dequantize(&acc, e, n, &mut out);
            let bound = error_bound(e, n);
            for i in 0..seed.len() {
                let exact: f64 = blocks.iter().map(|b| b[i] as f64).sum();
                let ulp = (out[i].abs() * f32::EPSILON) as f64;
                prop_assert!((out[i] as f64 - exact).abs() <= bound + ulp,
                    "i={} got {} exact {} bound {}", i, out[i], exact, bound);
            }
        }
    }
}
