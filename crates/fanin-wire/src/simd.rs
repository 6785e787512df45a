//! Run-time choice of vector loops, and the AVX2 loops over big-endian
//! int32 payloads (the value stream's elements).
//!
//! The build targets baseline x86-64 (SSE2), so LLVM vectorises the plain
//! element loops four lanes at a time and byte-swaps each vector with five
//! shuffles (SSE2 has no `pshufb`). On a CPU with AVX2 the loops here do
//! eight lanes with one `vpshufb`; they compute exactly what the portable
//! loops compute (tests check them against each other).

/// Whether to take the AVX2 loops: the CPU has AVX2 and `FANIN_SIMD` is not
/// `portable` (set it to measure what the vector loops gain). Decided once
/// per process.
pub fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        *AVX2.get_or_init(|| {
            std::env::var("FANIN_SIMD").map_or(true, |v| v != "portable") && std::is_x86_feature_detected!("avx2")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AVX2 loops; callers check [`avx2`] first.
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::arch::x86_64::*;

    /// `vpshufb` mask reversing the bytes of each 32-bit lane
    /// (big-endian <-> little-endian).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn bswap32_mask() -> __m256i {
        _mm256_setr_epi8(
            3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12, 3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
        )
    }

    /// `sum[i] += be_i32(payload[4i..])`, wrapping; `payload.len() == 4 * sum.len()`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn add_be(sum: &mut [i32], payload: &[u8]) {
        assert_eq!(payload.len(), 4 * sum.len());
        let mask = bswap32_mask();
        let whole = sum.len() / 8 * 8;
        let (acc, src) = (sum.as_mut_ptr(), payload.as_ptr());
        let mut i = 0;
        while i < whole {
            let v = _mm256_shuffle_epi8(_mm256_loadu_si256(src.add(4 * i) as *const __m256i), mask);
            let a = _mm256_loadu_si256(acc.add(i) as *const __m256i);
            _mm256_storeu_si256(acc.add(i) as *mut __m256i, _mm256_add_epi32(a, v));
            i += 8;
        }
        for (a, s) in sum[whole..].iter_mut().zip(payload[4 * whole..].chunks_exact(4)) {
            *a = a.wrapping_add(i32::from_be_bytes([s[0], s[1], s[2], s[3]]));
        }
    }

    /// Byte-swap `src` (whole 4-byte elements) into `dst`, either way
    /// (big-endian bytes <-> native int32s); equal lengths.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn swap32(src: &[u8], dst: &mut [u8]) {
        assert!(src.len() == dst.len() && src.len().is_multiple_of(4));
        let mask = bswap32_mask();
        let whole = src.len() / 32 * 32;
        let mut i = 0;
        while i < whole {
            let v = _mm256_shuffle_epi8(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i), mask);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, v);
            i += 32;
        }
        for (d, s) in dst[whole..].chunks_exact_mut(4).zip(src[whole..].chunks_exact(4)) {
            d.copy_from_slice(&[s[3], s[2], s[1], s[0]]);
        }
    }
}
