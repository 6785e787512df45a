use thiserror::Error;

/// Why a buffer is not a valid fanin packet. Every variant says what was
/// wrong so a counter or a log line can name the reason.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("truncated packet: need at least {needed} bytes, got {got}")]
    Truncated { needed: usize, got: usize },
    #[error("bad magic 0x{found:04x} (expected 0x{expected:04x})")]
    BadMagic { found: u16, expected: u16 },
    #[error("unsupported protocol version {found} (this build speaks {supported})")]
    UnsupportedVersion { found: u8, supported: u8 },
    #[error("unknown message type 0x{0:02x}")]
    UnknownMessageType(u8),
    #[error("message type 0x{0:02x} does not belong to this service")]
    WrongService(u8),
    #[error("unknown dtype code {0}")]
    UnknownDtype(u8),
    #[error("reserved bits set in flags byte 0x{0:02x}")]
    ReservedBits(u8),
    #[error("length mismatch: header implies {expected} bytes, datagram has {got}")]
    LengthMismatch { expected: usize, got: usize },
    #[error("grad_cnt {grad_cnt} exceeds the maximum of {max} elements per packet")]
    TooManyElements { grad_cnt: usize, max: usize },
    #[error("exponent-only message carries grad_cnt {0} (must be 0)")]
    ExpOnlyWithPayload(u16),
    #[error("result without data (no_data) carries grad_cnt {0} (must be 0)")]
    NoDataWithPayload(u16),
    #[error("unknown nack reason code {0}")]
    UnknownNackReason(u16),
    #[error("bitmap 0x{bitmap:016x} names slots beyond slot_count {slot_count}")]
    BitmapBeyondSlots { bitmap: u64, slot_count: u8 },
    #[error("key fragment of {len} bytes at offset {offset} does not lie within a key of {total} bytes (or is empty)")]
    FragmentOutOfRange { offset: u64, len: u64, total: u64 },
}

impl WireError {
    /// Short stable label, used as a metrics label for malformed-packet counters.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::BadMagic { .. } => "bad_magic",
            Self::UnsupportedVersion { .. } => "bad_version",
            Self::UnknownMessageType(_) => "unknown_msg_type",
            Self::WrongService(_) => "wrong_service",
            Self::UnknownDtype(_) => "unknown_dtype",
            Self::ReservedBits(_) => "reserved_bits",
            Self::LengthMismatch { .. } => "length_mismatch",
            Self::TooManyElements { .. } => "too_many_elements",
            Self::ExpOnlyWithPayload(_) | Self::NoDataWithPayload(_) => "unexpected_payload",
            Self::UnknownNackReason(_) => "unknown_nack_reason",
            Self::BitmapBeyondSlots { .. } => "bitmap_beyond_slots",
            Self::FragmentOutOfRange { .. } => "fragment_out_of_range",
        }
    }

    /// Every label `kind` can return, for exporting zero-valued counters.
    pub const KINDS: [&'static str; 13] = [
        "truncated",
        "bad_magic",
        "bad_version",
        "unknown_msg_type",
        "wrong_service",
        "unknown_dtype",
        "reserved_bits",
        "length_mismatch",
        "too_many_elements",
        "unexpected_payload",
        "unknown_nack_reason",
        "bitmap_beyond_slots",
        "fragment_out_of_range",
    ];
}
