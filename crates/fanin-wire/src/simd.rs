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

/// Run an AVX2 prefix loop where [`avx2`] allows it: how many elements it
/// did, 0 elsewhere (the caller's portable loop does the rest).
macro_rules! vector_prefix {
    ($name:ident, $doc:literal, ($($arg:ident: $ty:ty),*)) => {
        #[doc = $doc]
        #[inline]
        pub fn $name($($arg: $ty),*) -> usize {
            #[cfg(target_arch = "x86_64")]
            if avx2() {
                // SAFETY: the CPU has AVX2 (checked just above).
                return unsafe { x86::$name($($arg),*) };
            }
            let _ = ($($arg),*);
            0
        }
    };
}

vector_prefix!(add_be, "`sum[i] += be_i32(payload[4i..])` over a prefix: see [`x86::add_be`].", (sum: &mut [i32], payload: &[u8]));
vector_prefix!(read_be, "Big-endian int32s to native over a prefix: see [`x86::read_be`].", (payload: &[u8], out: &mut [i32]));
vector_prefix!(write_be, "Native int32s to big-endian over a prefix: see [`x86::write_be`].", (values: &[i32], payload: &mut [u8]));

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

    /// `sum[i] += be_i32(payload[4i..])`, wrapping, over the whole groups
    /// of eight elements; returns how many elements it did (the caller's
    /// portable loop does the rest).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn add_be(sum: &mut [i32], payload: &[u8]) -> usize {
        let whole = sum.len().min(payload.len() / 4) / 8 * 8;
        let mask = bswap32_mask();
        let (acc, src) = (sum.as_mut_ptr(), payload.as_ptr());
        let mut i = 0;
        while i < whole {
            let v = _mm256_shuffle_epi8(_mm256_loadu_si256(src.add(4 * i) as *const __m256i), mask);
            let a = _mm256_loadu_si256(acc.add(i) as *const __m256i);
            _mm256_storeu_si256(acc.add(i) as *mut __m256i, _mm256_add_epi32(a, v));
            i += 8;
        }
        whole
    }

    /// Big-endian int32s to native ones, over the whole groups of eight
    /// elements; returns how many it did.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn read_be(payload: &[u8], out: &mut [i32]) -> usize {
        let whole = out.len().min(payload.len() / 4) / 8 * 8;
        swap32(payload.as_ptr(), out.as_mut_ptr() as *mut u8, whole);
        whole
    }

    /// Native int32s to big-endian bytes, over the whole groups of eight
    /// elements; returns how many it did.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn write_be(values: &[i32], payload: &mut [u8]) -> usize {
        let whole = values.len().min(payload.len() / 4) / 8 * 8;
        swap32(values.as_ptr() as *const u8, payload.as_mut_ptr(), whole);
        whole
    }

    /// Reverse the bytes of `elements` (a multiple of 8) 4-byte elements
    /// from `src` into `dst` (either direction: the swap is its own inverse).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn swap32(src: *const u8, dst: *mut u8, elements: usize) {
        let mask = bswap32_mask();
        let mut i = 0;
        while i < 4 * elements {
            let v = _mm256_shuffle_epi8(_mm256_loadu_si256(src.add(i) as *const __m256i), mask);
            _mm256_storeu_si256(dst.add(i) as *mut __m256i, v);
            i += 32;
        }
    }
}
