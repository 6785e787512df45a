//! Value-stream (gradient) aggregation messages: Trio-ML's header, widened,
//! plus what SwitchML-style loss recovery and block floating point need.
//!
//! ```text
//!  0               1               2               3
//!  +---------------+---------------+---------------+---------------+
//!  |          magic 0xFA17         |    version    |   msg_type    |  preamble
//!  +-------+-+-+-+-+---------------+---------------+---------------+
//!  |age_op |F|D|E|N|     dtype     |            src_id             |  4
//!  +-------+-+-+-+-+---------------+---------------+---------------+
//!  |            src_cnt            |            gen_id             |  8
//!  +---------------+---------------+---------------+---------------+
//!  |                            job_id                             | 12
//!  +---------------------------------------------------------------+
//!  |                           block_id                            | 16
//!  +---------------+---------------+---------------+---------------+
//!  |           grad_cnt            |      exp      |   next_exp    | 20
//!  +---------------+---------------+---------------+---------------+
//!  |  payload: grad_cnt lanes (int32, or int16 for 16-bit dtypes)  | 24
//!  |  or a message body ...                                        |
//! ```
//! F = `final`, D = `degraded`, E = `exp_only`, N = `no_data`. See `docs/protocol.md`.

use crate::preamble::{MessageType, Preamble};
use crate::{WireError, MAX_DATAGRAM};

mod field {
    use core::ops::Range;
    pub const FLAGS: usize = 4;
    pub const DTYPE: usize = 5;
    pub const SRC_ID: Range<usize> = 6..8;
    pub const SRC_CNT: Range<usize> = 8..10;
    pub const GEN_ID: Range<usize> = 10..12;
    pub const JOB_ID: Range<usize> = 12..16;
    pub const BLOCK_ID: Range<usize> = 16..20;
    pub const GRAD_CNT: Range<usize> = 20..22;
    pub const EXP: usize = 22;
    pub const NEXT_EXP: usize = 23;
    pub const PAYLOAD: usize = 24;
}

/// Bytes before the payload.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Bytes per element on the wire for int32 and float32 (an int32 lane);
/// float16 and bfloat16 travel in int16 lanes ([`Dtype::lane_len`]).
pub const ELEM_LEN: usize = 4;
/// Most elements one packet can carry and still fit one UDP datagram.
pub const MAX_GRAD_CNT: usize = (MAX_DATAGRAM - HEADER_LEN) / ELEM_LEN;
/// Bytes of one word of a `ResultAck`'s bitmap.
pub const RESULT_ACK_WORD_LEN: usize = 8;
/// Most bitmap words a `ResultAck` may carry (one datagram).
pub const RESULT_ACK_MAX_WORDS: usize = (MAX_DATAGRAM - HEADER_LEN) / RESULT_ACK_WORD_LEN;

/// Does the body of a `ResultAck` say its sender holds the block `offset`
/// blocks after the header's `block_id`? (Bits past the body: no.)
pub fn result_ack_holds(body: &[u8], offset: u32) -> bool {
    let (word, bit) = (offset as usize / 64, offset % 64);
    body.get(word * RESULT_ACK_WORD_LEN..(word + 1) * RESULT_ACK_WORD_LEN)
        .is_some_and(|w| u64::from_be_bytes(w.try_into().expect("8 bytes")) >> bit & 1 == 1)
}

/// Write a `ResultAck` body: `holds(offset)` for each of its
/// `body.len() / 8 * 64` offsets.
pub fn write_result_ack(body: &mut [u8], mut holds: impl FnMut(u32) -> bool) {
    for (k, chunk) in body.chunks_exact_mut(RESULT_ACK_WORD_LEN).enumerate() {
        let word = (0..64).filter(|&j| holds(k as u32 * 64 + j)).fold(0u64, |w, j| w | 1 << j);
        chunk.copy_from_slice(&word.to_be_bytes());
    }
}

/// `exp` / `next_exp` value meaning "no exponent" (all-zero block, or no
/// exponent announced). Smaller than every real exponent, so `max` ignores it.
pub const EXP_NONE: i8 = i8::MIN;

/// `exp` / `next_exp` value meaning "a source's block holds a NaN or an
/// infinity": the result of the block is NaN in every element, on every
/// rank. Larger than every finite exponent (finite blocks use at most 126),
/// so the switch's `max` carries it through exponent rounds, lookahead and
/// trees without knowing it.
pub const EXP_NON_FINITE: i8 = i8::MAX;

const FLAG_FINAL: u8 = 0b0000_1000;
const FLAG_DEGRADED: u8 = 0b0000_0100;
const FLAG_EXP_ONLY: u8 = 0b0000_0010;
/// Contribution or Retransmission: the sender does not need this block's
/// sum (a reduce-scatter block another rank owns). Result: the sum was
/// withheld from this receiver, whose contribution it contains; no body.
const FLAG_NO_DATA: u8 = 0b0000_0001;
const AGE_OP_SHIFT: u8 = 4;

/// The element type the worker reduces. int32 travels exactly in int32
/// lanes; floating types as block floating point (a per-block shared
/// exponent, see `exp`): float32 in int32 lanes, float16 and bfloat16 in
/// int16 lanes, so a 16-bit tensor puts 2 bytes per element on the link.
/// The switch sums every lane in an int32 accumulator, writes a 16-bit
/// dtype's sums back as int16 (workers scale so that they fit,
/// docs/protocol.md §3.3), and refuses mixing dtypes inside one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    Int32 = 0,
    Float32 = 1,
    Float16 = 2,
    BFloat16 = 3,
}

impl Dtype {
    pub fn from_u8(code: u8) -> Result<Self, WireError> {
        Ok(match code {
            0 => Self::Int32,
            1 => Self::Float32,
            2 => Self::Float16,
            3 => Self::BFloat16,
            other => return Err(WireError::UnknownDtype(other)),
        })
    }

    /// Floating types need an exponent negotiated before data is sent.
    pub fn is_block_floating_point(self) -> bool {
        !matches!(self, Self::Int32)
    }

    /// Bytes per element on the wire: 4 (int32 lanes) or 2 (int16 lanes).
    pub const fn lane_len(self) -> usize {
        match self {
            Self::Int32 | Self::Float32 => 4,
            Self::Float16 | Self::BFloat16 => 2,
        }
    }

    /// The bits a lane's value may use: a sum of `n` contributions of
    /// `|q| <= 2^(lane_bits - ceil(log2 n))` fits the lane (30 for int32
    /// lanes, 14 for int16 lanes; one bit of headroom below the sign).
    pub const fn lane_bits(self) -> i32 {
        match self {
            Self::Int32 | Self::Float32 => 30,
            Self::Float16 | Self::BFloat16 => 14,
        }
    }
}

/// Byte length of the message body that follows the header.
fn body_len(msg_type: MessageType, grad_cnt: u16, age_op: u8, dtype: Dtype) -> usize {
    match msg_type {
        MessageType::Contribution | MessageType::Retransmission | MessageType::Result => {
            grad_cnt as usize * dtype.lane_len()
        }
        MessageType::Join if age_op == JOIN_RECOVER => RecoverAnchor::LEN,
        MessageType::Join | MessageType::Membership => 0,
        MessageType::JoinAck => JoinParams::LEN,
        MessageType::Sync => SyncRequest::LEN,
        MessageType::ResultAck => grad_cnt as usize * RESULT_ACK_WORD_LEN,
        MessageType::Nack => Nack::LEN,
        // Rejected as WrongService by `Packet::check` before this is asked.
        _ => 0,
    }
}

/// Zero-copy view of a value-stream datagram.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a buffer without checks, for emission into a buffer the caller
    /// sized with [`Repr::buffer_len`].
    pub fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wrap an untrusted buffer. On success, no accessor of the view panics and
    /// the datagram length equals the length the header implies.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let packet = Self { buffer };
        packet.check()?;
        Ok(packet)
    }

    fn check(&self) -> Result<(), WireError> {
        let bytes = self.buffer.as_ref();
        let preamble = Preamble::parse(bytes)?;
        if preamble.msg_type.is_kv() {
            return Err(WireError::WrongService(preamble.msg_type as u8));
        }
        if bytes.len() < HEADER_LEN {
            return Err(WireError::Truncated { needed: HEADER_LEN, got: bytes.len() });
        }
        let flags = bytes[field::FLAGS];
        if flags & FLAG_NO_DATA != 0 && !preamble.msg_type.carries_block() {
            return Err(WireError::ReservedBits(flags));
        }
        let dtype = Dtype::from_u8(bytes[field::DTYPE])?;
        let grad_cnt = self.grad_cnt();
        if grad_cnt as usize > MAX_GRAD_CNT {
            return Err(WireError::TooManyElements { grad_cnt: grad_cnt as usize, max: MAX_GRAD_CNT });
        }
        let carries_block = preamble.msg_type.carries_block();
        let ack = preamble.msg_type == MessageType::ResultAck;
        if ack && (grad_cnt as usize > RESULT_ACK_MAX_WORDS || flags != 0) {
            return Err(if flags != 0 {
                WireError::ReservedBits(flags)
            } else {
                WireError::TooManyElements { grad_cnt: grad_cnt as usize, max: RESULT_ACK_MAX_WORDS }
            });
        }
        if grad_cnt != 0 && !ack && (!carries_block || flags & FLAG_EXP_ONLY != 0) {
            return Err(WireError::ExpOnlyWithPayload(grad_cnt));
        }
        if grad_cnt != 0 && preamble.msg_type == MessageType::Result && flags & FLAG_NO_DATA != 0 {
            return Err(WireError::NoDataWithPayload(grad_cnt));
        }
        let expected = HEADER_LEN + body_len(preamble.msg_type, grad_cnt, flags >> AGE_OP_SHIFT, dtype);
        if bytes.len() != expected {
            return Err(WireError::LengthMismatch { expected, got: bytes.len() });
        }
        if preamble.msg_type == MessageType::Nack {
            NackReason::from_u16(u16::from_be_bytes([bytes[HEADER_LEN], bytes[HEADER_LEN + 1]]))?;
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// A datagram that a trimming link cut to its header (NDP; docs/protocol.md
    /// §4.14): a Contribution, Retransmission or Result whose header is valid
    /// and announces `grad_cnt` > 0 lanes, but which is exactly
    /// [`HEADER_LEN`] bytes long. Its header fields may be read; its payload
    /// is empty. Any other length mismatch stays malformed: only a cut at the
    /// header boundary is a trim.
    pub fn trimmed_header(buffer: T) -> Option<Self> {
        if buffer.as_ref().len() != HEADER_LEN {
            return None;
        }
        let packet = Self { buffer };
        // `check` passed every test before the length, so the header is
        // sound; a LengthMismatch at exactly HEADER_LEN with a nonzero
        // grad_cnt can only be a data message without its lanes.
        let cut = matches!(packet.check(), Err(WireError::LengthMismatch { got: HEADER_LEN, .. }))
            && MessageType::from_u8(packet.msg_type_code()).is_ok_and(|t| t.carries_block())
            && packet.grad_cnt() > 0;
        cut.then_some(packet)
    }

    fn u16_at(&self, range: core::ops::Range<usize>) -> u16 {
        let b = &self.buffer.as_ref()[range];
        u16::from_be_bytes([b[0], b[1]])
    }

    fn u32_at(&self, range: core::ops::Range<usize>) -> u32 {
        let b = &self.buffer.as_ref()[range];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Message type code (validated by `new_checked`), without the sealed
    /// bit: the caller verified and stripped the trailer ([`crate::auth`]).
    pub fn msg_type_code(&self) -> u8 {
        self.buffer.as_ref()[3] & !crate::auth::SEALED
    }
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    pub fn age_op(&self) -> u8 {
        self.flags() >> AGE_OP_SHIFT
    }
    pub fn final_block(&self) -> bool {
        self.flags() & FLAG_FINAL != 0
    }

    /// In a Join, the `final` bit means something else: the worker receives
    /// on the job's result group, so the switch may send it completion
    /// results there (docs/protocol.md §2.3).
    pub fn listens_on_group(&self) -> bool {
        self.final_block()
    }

    /// In a Join, `src_cnt` (unused there otherwise) is the low 16 bits of
    /// the worker's **member incarnation**: a number each session draws
    /// afresh, so the switch tells a new process of a rank from the old
    /// one's repeated or probing Joins (docs/protocol.md §4.12); a plain
    /// Join carries the high 32 bits in `block_id`. 0: a worker that does
    /// not say (it is answered as before rounds existed).
    pub fn member_incarnation(&self) -> u16 {
        self.src_cnt()
    }
    pub fn degraded(&self) -> bool {
        self.flags() & FLAG_DEGRADED != 0
    }
    pub fn exp_only(&self) -> bool {
        self.flags() & FLAG_EXP_ONLY != 0
    }
    /// `no_data`: a contribution whose sender wants no sum back, or a
    /// result without one ([`Repr::no_data`]).
    pub fn no_data(&self) -> bool {
        self.flags() & FLAG_NO_DATA != 0
    }
    pub fn dtype_code(&self) -> u8 {
        self.buffer.as_ref()[field::DTYPE]
    }
    pub fn src_id(&self) -> u16 {
        self.u16_at(field::SRC_ID)
    }
    pub fn src_cnt(&self) -> u16 {
        self.u16_at(field::SRC_CNT)
    }
    pub fn gen_id(&self) -> u16 {
        self.u16_at(field::GEN_ID)
    }
    pub fn job_id(&self) -> u32 {
        self.u32_at(field::JOB_ID)
    }
    pub fn block_id(&self) -> u32 {
        self.u32_at(field::BLOCK_ID)
    }
    pub fn grad_cnt(&self) -> u16 {
        self.u16_at(field::GRAD_CNT)
    }
    pub fn exp(&self) -> i8 {
        self.buffer.as_ref()[field::EXP] as i8
    }
    pub fn next_exp(&self) -> i8 {
        self.buffer.as_ref()[field::NEXT_EXP] as i8
    }
    /// Everything after the header: `grad_cnt` big-endian lanes (int32, or
    /// int16 for 16-bit dtypes) for block messages, the message body
    /// otherwise.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD..]
    }
    /// Element `i` of a block payload (an int16 lane sign-extended).
    pub fn element(&self, i: usize) -> i32 {
        let b = self.buffer.as_ref();
        if Dtype::from_u8(b[field::DTYPE]).map_or(4, Dtype::lane_len) == 2 {
            let at = field::PAYLOAD + i * 2;
            return i16::from_be_bytes([b[at], b[at + 1]]) as i32;
        }
        let at = field::PAYLOAD + i * ELEM_LEN;
        i32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn put_u16(&mut self, range: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[range].copy_from_slice(&v.to_be_bytes());
    }
    fn put_u32(&mut self, range: core::ops::Range<usize>, v: u32) {
        self.buffer.as_mut()[range].copy_from_slice(&v.to_be_bytes());
    }
    pub fn set_msg_type(&mut self, t: MessageType) {
        Preamble::emit(t, self.buffer.as_mut());
    }
    pub fn set_flags(&mut self, age_op: u8, final_block: bool, degraded: bool, exp_only: bool, no_data: bool) {
        let mut flags = (age_op & 0x0f) << AGE_OP_SHIFT;
        if no_data {
            flags |= FLAG_NO_DATA;
        }
        if final_block {
            flags |= FLAG_FINAL;
        }
        if degraded {
            flags |= FLAG_DEGRADED;
        }
        if exp_only {
            flags |= FLAG_EXP_ONLY;
        }
        self.buffer.as_mut()[field::FLAGS] = flags;
    }
    /// Rewrite `age_op` alone, keeping the other flags (a contribution
    /// copied from a capture that now carries a congestion echo).
    pub fn set_age_op(&mut self, age_op: u8) {
        let flags = &mut self.buffer.as_mut()[field::FLAGS];
        *flags = (*flags & !(0x0f << AGE_OP_SHIFT)) | (age_op & 0x0f) << AGE_OP_SHIFT;
    }
    pub fn set_dtype(&mut self, d: Dtype) {
        self.buffer.as_mut()[field::DTYPE] = d as u8;
    }
    pub fn set_src_id(&mut self, v: u16) {
        self.put_u16(field::SRC_ID, v)
    }
    pub fn set_src_cnt(&mut self, v: u16) {
        self.put_u16(field::SRC_CNT, v)
    }
    pub fn set_gen_id(&mut self, v: u16) {
        self.put_u16(field::GEN_ID, v)
    }
    pub fn set_job_id(&mut self, v: u32) {
        self.put_u32(field::JOB_ID, v)
    }
    pub fn set_block_id(&mut self, v: u32) {
        self.put_u32(field::BLOCK_ID, v)
    }
    pub fn set_grad_cnt(&mut self, v: u16) {
        self.put_u16(field::GRAD_CNT, v)
    }
    pub fn set_exp(&mut self, v: i8) {
        self.buffer.as_mut()[field::EXP] = v as u8;
    }
    pub fn set_next_exp(&mut self, v: i8) {
        self.buffer.as_mut()[field::NEXT_EXP] = v as u8;
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::PAYLOAD..]
    }
}

/// Parsed header of a value-stream message (the payload stays in the buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub msg_type: MessageType,
    /// Trio-ML `age_op`: non-zero when the block was emitted by the aging
    /// scanner rather than by completion.
    pub age_op: u8,
    /// Trio-ML `final`: last block of a generation (tensor).
    pub final_block: bool,
    /// Trio-ML `degraded`: the result sums fewer sources than the job has.
    pub degraded: bool,
    /// Exponent negotiation only: no payload, `exp` carries the sender's
    /// block exponent (or, in a result, the negotiated maximum).
    pub exp_only: bool,
    /// Owner-only results (reduce-scatter, docs/protocol.md §4.13). In a
    /// data contribution: the sender does not need this block's sum. In a
    /// result: the sum went to the block's owners only; this header (no
    /// body) tells a member that its contribution is in it.
    pub no_data: bool,
    pub dtype: Dtype,
    pub src_id: u16,
    /// In a result: how many sources the sum contains.
    pub src_cnt: u16,
    pub gen_id: u16,
    pub job_id: u32,
    pub block_id: u32,
    pub grad_cnt: u16,
    /// Shared block exponent the int32 values are scaled with (float dtypes).
    pub exp: i8,
    /// Piggybacked exponent announcement for block `block_id + lookahead`.
    pub next_exp: i8,
}

impl Repr {
    /// A header with every optional field at its neutral value (no flags,
    /// int32, counters 0, no exponents, no payload); set what the message needs.
    pub fn new(msg_type: MessageType, job_id: u32, src_id: u16) -> Self {
        Self {
            msg_type,
            age_op: 0,
            final_block: false,
            degraded: false,
            exp_only: false,
            no_data: false,
            dtype: Dtype::Int32,
            src_id,
            src_cnt: 0,
            gen_id: 0,
            job_id,
            block_id: 0,
            grad_cnt: 0,
            exp: EXP_NONE,
            next_exp: EXP_NONE,
        }
    }

    /// Parse a header from a checked packet.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, WireError> {
        packet.check()?;
        Ok(Self {
            msg_type: MessageType::from_u8(packet.msg_type_code())?,
            age_op: packet.age_op(),
            final_block: packet.final_block(),
            degraded: packet.degraded(),
            exp_only: packet.exp_only(),
            no_data: packet.no_data(),
            dtype: Dtype::from_u8(packet.dtype_code())?,
            src_id: packet.src_id(),
            src_cnt: packet.src_cnt(),
            gen_id: packet.gen_id(),
            job_id: packet.job_id(),
            block_id: packet.block_id(),
            grad_cnt: packet.grad_cnt(),
            exp: packet.exp(),
            next_exp: packet.next_exp(),
        })
    }

    /// Length of the whole datagram this header describes.
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + body_len(self.msg_type, self.grad_cnt, self.age_op, self.dtype)
    }

    /// Write the header (not the payload) into a buffer of at least
    /// `buffer_len()` bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_msg_type(self.msg_type);
        packet.set_flags(self.age_op, self.final_block, self.degraded, self.exp_only, self.no_data);
        packet.set_dtype(self.dtype);
        packet.set_src_id(self.src_id);
        packet.set_src_cnt(self.src_cnt);
        packet.set_gen_id(self.gen_id);
        packet.set_job_id(self.job_id);
        packet.set_block_id(self.block_id);
        packet.set_grad_cnt(self.grad_cnt);
        packet.set_exp(self.exp);
        packet.set_next_exp(self.next_exp);
    }
}

/// Decode a block payload of big-endian int32s into `out` (as many
/// elements as both hold): AVX2 where the CPU has it ([`crate::simd`]),
/// then a plain loop for what is left.
pub fn read_elements(payload: &[u8], out: &mut [i32]) {
    let done = crate::simd::read_be(payload, out);
    for (dst, src) in out[done..].iter_mut().zip(payload[ELEM_LEN * done..].chunks_exact(ELEM_LEN)) {
        *dst = i32::from_be_bytes([src[0], src[1], src[2], src[3]]);
    }
}

/// Encode int32s as a big-endian block payload (as many as both hold).
pub fn write_elements(values: &[i32], payload: &mut [u8]) {
    let done = crate::simd::write_be(values, payload);
    for (dst, v) in payload[ELEM_LEN * done..].chunks_exact_mut(ELEM_LEN).zip(&values[done..]) {
        dst.copy_from_slice(&v.to_be_bytes());
    }
}

/// Add a block payload of big-endian int32s into `sum`, wrapping (the
/// switch's aggregation loop; as many elements as both hold).
pub fn add_elements(sum: &mut [i32], payload: &[u8]) {
    let done = crate::simd::add_be(sum, payload);
    for (acc, src) in sum[done..].iter_mut().zip(payload[ELEM_LEN * done..].chunks_exact(ELEM_LEN)) {
        *acc = acc.wrapping_add(i32::from_be_bytes([src[0], src[1], src[2], src[3]]));
    }
}

/// Decode a block payload of `dtype`'s lanes into `out` (int16 lanes
/// sign-extended; as many elements as both hold).
pub fn read_lanes(dtype: Dtype, payload: &[u8], out: &mut [i32]) {
    if dtype.lane_len() == 4 {
        return read_elements(payload, out);
    }
    for (dst, src) in out.iter_mut().zip(payload.chunks_exact(2)) {
        *dst = i16::from_be_bytes([src[0], src[1]]) as i32;
    }
}

/// Encode sums as a block payload of `dtype`'s lanes (as many as both
/// hold). An int16 lane saturates: honest workers scale so that every sum
/// fits ([`Dtype::lane_bits`]), so only a job's own misbehaving member can
/// reach the limit, and a saturated lane is still that job's own garbage,
/// never another job's data.
pub fn write_lanes(dtype: Dtype, values: &[i32], payload: &mut [u8]) {
    if dtype.lane_len() == 4 {
        return write_elements(values, payload);
    }
    for (dst, v) in payload.chunks_exact_mut(2).zip(values) {
        dst.copy_from_slice(&((*v).clamp(i16::MIN as i32, i16::MAX as i32) as i16).to_be_bytes());
    }
}

/// Add a block payload of `dtype`'s lanes into `sum` (int32 accumulators,
/// wrapping; as many elements as both hold).
pub fn add_lanes(dtype: Dtype, sum: &mut [i32], payload: &[u8]) {
    if dtype.lane_len() == 4 {
        return add_elements(sum, payload);
    }
    for (acc, src) in sum.iter_mut().zip(payload.chunks_exact(2)) {
        *acc = acc.wrapping_add(i16::from_be_bytes([src[0], src[1]]) as i32);
    }
}

/// Body of a `JoinAck`: everything a worker needs to stream into the job.
///
/// ```text
///  0 block_cnt_max u32 | 4 block_grad_max u32 | 8 block_exp_ms u32
/// 12 incarnation u32   | 16 shard_count u16   | 18 flags u16 | 20 next_block u32
/// 24 packet_elems u32 | 28 result_key [u8; 16] | 44 result_epoch u32
/// ```
///
/// `packet_elems` is the job's packet size: the elements per packet every
/// member sends unless it was told otherwise (`block_grad_max`, capped to
/// what one unfragmented datagram carries over the switch's data port; see
/// [`elems_fitting_mtu`]).
///
/// `flags` bit 0 ([`JOINACK_RESULTS_ON_GROUP`]): the switch sends this
/// worker the job's completion results on the job's result group (the Join
/// carried [`Packet::listens_on_group`]); bit 1 ([`JOINACK_PARTIAL_RESULTS`]):
/// the job opted into partial results (straggler aging, `on_failure =
/// degrade`, or forward mode), so a degraded or missed block is a result the
/// caller asked for, not an error; bit 2 ([`JOINACK_RESULT_KEY`]):
/// `result_key` holds the keyed job's result key, wrapped for this member,
/// and `result_epoch` the epoch it belongs to (zeros otherwise); bits 8..15: `order_shards` (see the field); the
/// other bits are sent as 0 and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinParams {
    /// Concurrent blocks (slots) the job may hold; also the exponent lookahead.
    pub block_cnt_max: u32,
    /// Most elements per block.
    pub block_grad_max: u32,
    /// Block timeout (aging) in milliseconds, 0 = never.
    pub block_exp_ms: u32,
    /// Changes every time the switch (re)starts.
    pub incarnation: u32,
    /// Number of data-plane ports (shards); block b goes to port base + shard(b).
    pub shard_count: u16,
    /// The block offset a joining worker starts from (SwitchML++ sync).
    pub next_block: u32,
    /// Completion results come on the job's result group (multicast), not
    /// to this worker's own address (docs/protocol.md §4.5).
    pub results_on_group: bool,
    /// The job opted into partial results: blocks may complete without
    /// every member (docs/protocol.md §6.2). Without it a worker raises on
    /// a degraded or missed block instead of returning it.
    pub partial_results: bool,
    /// Elements per packet of the job's members (at most `block_grad_max`):
    /// the same for every member, since a block's elements must line up.
    pub packet_elems: u32,
    /// In how many classes of blocks (`shard_of` with this count) results
    /// come back in the order their blocks were sent (docs/protocol.md §6.3,
    /// what fast retransmission relies on): 0 = `shard_count`'s (one switch,
    /// each shard in order); a tree whose root is spread over several
    /// switches sends results of different root shards on different paths,
    /// so a child says how many (the lcm with its own shard count);
    /// [`ORDER_ANY`] = no order to rely on. Old switches send 0.
    pub order_shards: u8,
    /// A keyed job's result key, wrapped under the receiving member's key
    /// (`fanin_wire::auth::wrap_result_key`), when this member's results
    /// come on the job's result group sealed once for all listeners.
    pub result_key: Option<WrappedResultKey>,
}

/// A keyed job's result key as a JoinAck carries it: the key of one
/// *epoch* (the switch starts a new one, with a new key, whenever a member
/// leaves the job, so a member that left cannot check or forge the results
/// sealed after it left), XORed with a pad only the receiving member can
/// compute (`fanin_wire::auth::wrap_result_key`; docs/protocol.md §2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrappedResultKey {
    pub epoch: u32,
    pub wrapped: [u8; 16],
}

/// `order_shards` of a JoinAck whose results may come in any order.
pub const ORDER_ANY: u8 = 255;

/// Most elements a value packet may carry so that its datagram (sealed,
/// in a keyed job) fits one frame of a link with this `mtu`, over IPv4 or
/// IPv6: no IP fragmentation, where losing one fragment loses the whole
/// datagram. At least 1; at most [`MAX_GRAD_CNT`].
pub fn elems_fitting_mtu(mtu: u32, ipv6: bool) -> u32 {
    let ip = if ipv6 { 40 } else { 20 };
    let overhead = ip + 8 + HEADER_LEN + crate::auth::TRAILER_LEN;
    let elems = (mtu as usize).saturating_sub(overhead) / ELEM_LEN;
    elems.clamp(1, MAX_GRAD_CNT) as u32
}

/// JoinAck `flags` bit: results come on the job's result group.
pub const JOINACK_RESULTS_ON_GROUP: u16 = 0x0001;
/// JoinAck `flags` bit: the job opted into partial results.
pub const JOINACK_PARTIAL_RESULTS: u16 = 0x0002;
/// JoinAck `flags` bit: `result_key` carries the wrapped result key.
pub const JOINACK_RESULT_KEY: u16 = 0x0004;

impl JoinParams {
    pub const LEN: usize = 48;

    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        let u32_at = |at: usize| u32::from_be_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
        Ok(Self {
            block_cnt_max: u32_at(0),
            block_grad_max: u32_at(4),
            block_exp_ms: u32_at(8),
            incarnation: u32_at(12),
            shard_count: u16::from_be_bytes([body[16], body[17]]),
            next_block: u32_at(20),
            results_on_group: u16::from_be_bytes([body[18], body[19]]) & JOINACK_RESULTS_ON_GROUP != 0,
            partial_results: u16::from_be_bytes([body[18], body[19]]) & JOINACK_PARTIAL_RESULTS != 0,
            packet_elems: u32_at(24),
            order_shards: body[18],
            result_key: (u16::from_be_bytes([body[18], body[19]]) & JOINACK_RESULT_KEY != 0).then(|| WrappedResultKey {
                wrapped: body[28..44].try_into().expect("16 bytes"),
                epoch: u32_at(44),
            }),
        })
    }

    /// The classes of blocks within which results come back in order
    /// (`shard_of` with this count), None when in no order at all.
    pub fn order_classes(&self) -> Option<u16> {
        match self.order_shards {
            ORDER_ANY => None,
            0 => Some(self.shard_count.max(1)),
            n => Some(n as u16),
        }
    }

    /// `order_shards` for the children of a switch with `shard_count`
    /// shards that got these parameters from its parent: results come in
    /// order only within both its own shard and the parent's class, i.e.
    /// in lcm(both) classes (`shard_of` is a residue of the block's slot).
    pub fn order_below(&self, shard_count: u16) -> u8 {
        order_shards_below(self.order_classes(), shard_count)
    }

    pub fn emit(&self, body: &mut [u8]) {
        body[0..4].copy_from_slice(&self.block_cnt_max.to_be_bytes());
        body[4..8].copy_from_slice(&self.block_grad_max.to_be_bytes());
        body[8..12].copy_from_slice(&self.block_exp_ms.to_be_bytes());
        body[12..16].copy_from_slice(&self.incarnation.to_be_bytes());
        body[16..18].copy_from_slice(&self.shard_count.to_be_bytes());
        let flags = if self.results_on_group { JOINACK_RESULTS_ON_GROUP } else { 0 }
            | if self.partial_results { JOINACK_PARTIAL_RESULTS } else { 0 }
            | if self.result_key.is_some() { JOINACK_RESULT_KEY } else { 0 }
            | (self.order_shards as u16) << 8;
        body[18..20].copy_from_slice(&flags.to_be_bytes());
        body[20..24].copy_from_slice(&self.next_block.to_be_bytes());
        body[24..28].copy_from_slice(&self.packet_elems.to_be_bytes());
        let key = self.result_key.unwrap_or(WrappedResultKey { epoch: 0, wrapped: [0; 16] });
        body[28..44].copy_from_slice(&key.wrapped);
        body[44..48].copy_from_slice(&key.epoch.to_be_bytes());
    }
}

/// `order_shards` for the members of a switch with `shard_count` shards
/// whose results come from upstream in `upstream` classes (None: in any
/// order): the lcm of both, 0 when that is `shard_count` itself.
pub fn order_shards_below(upstream: Option<u16>, shard_count: u16) -> u8 {
    let Some(up) = upstream else { return ORDER_ANY };
    let up = up.max(1);
    let own = shard_count.max(1) as u64;
    let (mut a, mut b) = (up as u64, own);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    let lcm = up as u64 / a * own;
    if lcm == own {
        0
    } else if lcm < ORDER_ANY as u64 {
        lcm as u8
    } else {
        ORDER_ANY
    }
}

/// Why the switch refused a worker's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum NackReason {
    UnknownJob = 1,
    NotMember = 2,
    /// grad_cnt above the job's `block_grad_max` (detail = the cap).
    TooManyElements = 3,
    /// A block received two dtypes (detail = dtype of the block).
    DtypeMismatch = 4,
    /// A float block arrived scaled with another exponent than negotiated.
    ExponentMismatch = 5,
    /// The block lies outside the job's window (detail = next expected block).
    BlockOutOfWindow = 6,
    /// The job runs in forwarding (NoAggr) mode and cannot take this message.
    WrongMode = 7,
    /// grad_cnt differs from the other contributions to this block
    /// (detail = the block's grad_cnt): workers disagree on the tensor layout.
    ShapeMismatch = 8,
    /// The block's result is no longer held: the job moved on without this
    /// source (a straggler) and the slot was reused (detail = the block the
    /// slot holds now). Not fatal: the worker records the block as missed.
    BlockExpired = 9,
    /// Back-pressure, NDP's return-to-sender: the switch did not process the
    /// contribution because it is overloaded (detail = a [`TrimCause`] code).
    /// Not fatal: the worker sends the block again at once and shrinks its
    /// window. The header echoes the trimmed contribution's `exp_only` flag
    /// so the worker can tell which phase was cut.
    Trimmed = 10,
    /// The job failed (its failure policy is `fail` and a member went
    /// silent past the job's member timeout; detail = that member's source
    /// id). Fatal: the switch takes nothing more for the job until the
    /// control plane re-admits it.
    JobFailed = 11,
    /// The contribution is tagged with another incarnation of this switch
    /// than the current one (the switch restarted and forgot the job's
    /// blocks; detail = the switch's current incarnation, all 32 bits).
    /// Not fatal: the worker rejoins and recovers (docs/restart.md).
    StaleIncarnation = 12,
    /// A plain Join from a new process of a rank that already joined this
    /// switch of an aggregation tree (detail = the rank). A tree has no
    /// rounds (docs/trees.md): started again at the stream's start, the new
    /// process would be handed the old run's results that the switches
    /// above still hold. Fatal: the job's ranks must be subscribed afresh.
    RerunInTree = 13,
    /// A plain Join to a switch of an aggregation tree that restarted while
    /// the job ran (the control plane installed the job again, `resumed`),
    /// from a worker rank that has not joined this life (detail = the
    /// switch's incarnation, all 32 bits). The switches above may hold
    /// results of the stream this life never saw. Not fatal for a worker of
    /// the running job — it was probing for the restart and recovers, as on
    /// `StaleIncarnation` — fatal for a new process (a new run): the job's
    /// ranks must be subscribed afresh.
    TreeSwitchRestarted = 14,
}

impl NackReason {
    pub fn from_u16(code: u16) -> Result<Self, WireError> {
        Ok(match code {
            1 => Self::UnknownJob,
            2 => Self::NotMember,
            3 => Self::TooManyElements,
            4 => Self::DtypeMismatch,
            5 => Self::ExponentMismatch,
            6 => Self::BlockOutOfWindow,
            7 => Self::WrongMode,
            8 => Self::ShapeMismatch,
            9 => Self::BlockExpired,
            10 => Self::Trimmed,
            11 => Self::JobFailed,
            12 => Self::StaleIncarnation,
            13 => Self::RerunInTree,
            14 => Self::TreeSwitchRestarted,
            other => return Err(WireError::UnknownNackReason(other)),
        })
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::UnknownJob => "unknown job",
            Self::NotMember => "source is not a member of the job",
            Self::TooManyElements => "more elements per packet than the job's block_grad_max",
            Self::DtypeMismatch => "dtype differs from the other contributions to this block",
            Self::ExponentMismatch => "block exponent differs from the negotiated one",
            Self::BlockOutOfWindow => "block lies outside the job's window",
            Self::WrongMode => "message not valid for the job's mode",
            Self::ShapeMismatch => "grad_cnt differs from the other contributions to this block",
            Self::BlockExpired => "the block's result expired: the job moved on without this source",
            Self::Trimmed => "the switch is overloaded and returned the contribution unprocessed (send it again, slower)",
            Self::JobFailed => "the job failed: a member stopped sending (the job's failure policy is `fail`; detail = its rank)",
            Self::StaleIncarnation => "the switch restarted since this worker joined (rejoin and resend)",
            Self::RerunInTree => {
                "this rank (the detail) already ran in this job's aggregation tree as another process, and a tree's \
                 stream cannot start again where it began (the switches above still hold that run's results): \
                 unsubscribe every rank of the job, then subscribe them again, or delete and re-create the job, so \
                 the controller programs the tree afresh (a rank joining a running tree on purpose uses sync_join=True)"
            }
            Self::TreeSwitchRestarted => {
                "this switch of the job's aggregation tree restarted after the job was installed on it (its \
                 incarnation is the detail), and the switches above it may still hold results of the job's stream \
                 that it never saw (the job may have run; the control plane cannot tell): only a worker of a run \
                 in progress may join it again, to recover. A new run must start afresh: unsubscribe every rank \
                 of the job, then subscribe them again (a rank joining a running job on purpose uses \
                 sync_join=True)"
            }
        }
    }
}

/// Why the switch trimmed a contribution: the `detail` of a
/// [`NackReason::Trimmed`] nack. Workers react to every cause the same way
/// (retransmit, shrink the window); the cause is for counters and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum TrimCause {
    /// The shard's processing queue (its socket receive queue) is above the
    /// configured watermark.
    ProcessingQueue = 1,
    /// Aggregation memory is exhausted: the job's block table has no free
    /// slot for this block (the slot still aggregates the block
    /// `block_cnt_max` earlier).
    MemoryExhausted = 2,
    /// The sender exceeded its per-source rate limit (a token bucket per
    /// job and source).
    RateLimited = 3,
    /// A trimming link on the way cut the contribution to its header
    /// ([`trimmed_header`]): the network, not the switch, was congested.
    Network = 4,
}

impl TrimCause {
    /// The cause of a `Trimmed` nack's detail; unknown codes are kept as
    /// `None` rather than rejected so a newer switch can add causes.
    pub fn from_detail(detail: u32) -> Option<Self> {
        match detail {
            1 => Some(Self::ProcessingQueue),
            2 => Some(Self::MemoryExhausted),
            3 => Some(Self::RateLimited),
            4 => Some(Self::Network),
            _ => None,
        }
    }
}

/// Body of a `Sync`: `origin u16 | flags u16 | align_blocks u32`: the
/// worker whose join the request forwards, [`SYNC_NEWCOMER`] or 0, and the
/// blocks per allreduce of the job's stream, so the root answers an
/// allreduce boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncRequest {
    pub origin: u16,
    pub flags: u16,
    pub align_blocks: u32,
}

/// [`SyncRequest::flags`] bit: the origin is a newcomer somewhere on its
/// path (a switch holds it, or the child switch added for it, as awaiting),
/// so blocks there do not wait for it until its start: the root answers a
/// window beyond its offset, past every block any shard may have begun.
/// Without it (a member that blocks already wait for, syncing again) the
/// root answers from the offset itself. Unknown bits are ignored.
pub const SYNC_NEWCOMER: u16 = 0x0001;

impl SyncRequest {
    pub const LEN: usize = 8;

    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        Ok(Self {
            origin: u16::from_be_bytes([body[0], body[1]]),
            flags: u16::from_be_bytes([body[2], body[3]]),
            align_blocks: u32::from_be_bytes([body[4], body[5], body[6], body[7]]),
        })
    }

    pub fn emit(&self, body: &mut [u8]) {
        body[0..2].copy_from_slice(&self.origin.to_be_bytes());
        body[2..4].copy_from_slice(&self.flags.to_be_bytes());
        body[4..8].copy_from_slice(&self.align_blocks.to_be_bytes());
    }
}

/// Body of a `JOIN_RECOVER` Join: where an allreduce of the recovering
/// worker's stream begins, so a restarted switch knows the job's allreduce
/// boundaries again (a round need not start at block 0, docs/protocol.md
/// §4.12) and can answer a later sync join on one of them.
///
/// ```text
/// 0 block u32 | 4 gen_id u16 | 6 reserved u16 (0)
/// ```
///
/// `block`: the first block of the worker's running allreduce, or of its
/// next one when none runs; `gen_id`: that allreduce's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoverAnchor {
    pub block: u32,
    pub gen_id: u16,
}

impl RecoverAnchor {
    pub const LEN: usize = 8;

    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        Ok(Self {
            block: u32::from_be_bytes([body[0], body[1], body[2], body[3]]),
            gen_id: u16::from_be_bytes([body[4], body[5]]),
        })
    }

    pub fn emit(&self, body: &mut [u8]) {
        body[0..4].copy_from_slice(&self.block.to_be_bytes());
        body[4..6].copy_from_slice(&self.gen_id.to_be_bytes());
        body[6..8].fill(0);
    }
}

/// Status carried in `age_op` of a [`MessageType::Membership`] notice.
pub const MEMBERSHIP_SLOW: u8 = 1;
/// See [`MEMBERSHIP_SLOW`].
pub const MEMBERSHIP_READMITTED: u8 = 2;
/// The notice's `src_id` went silent past the job's member timeout and the
/// job's failure policy is `fail`: the job failed (see [`NackReason::JobFailed`]).
pub const MEMBERSHIP_FAILED: u8 = 3;
/// The notice's `src_id` joined again as a new incarnation (a new process
/// took its rank) while the job's round ran: the round cannot complete, and
/// every member of it must start a new session (docs/protocol.md §4.12).
pub const MEMBERSHIP_RESTARTED: u8 = 4;
/// The notice's `src_id` sent a block that does not line up with the
/// others' contributions to it (another element count, or it is the last
/// block of one rank's tensor and not of another's): the members disagree
/// on the allreduce's length, the round ends and every member raises
/// (docs/protocol.md §4.12).
pub const MEMBERSHIP_MISMATCH: u8 = 5;
/// `age_op` of a `Join` from a worker joining a running job: it asks for the
/// job's current block offset (the SwitchML++ sync, answered by the tree's
/// root) instead of the start of the stream (0: joining with the others).
/// Its `block_id` carries the blocks per allreduce of the job's stream, so
/// the answer is an allreduce boundary.
pub const JOIN_SYNC: u8 = 1;
/// `age_op` of a `Join` from a worker recovering after a switch restart
/// (docs/restart.md): its `block_id` is the lowest block of the job's stream
/// it has no result for, and its body a [`RecoverAnchor`]. The switch answers (with the same `age_op`) only
/// once every member reported; the JoinAck's `next_block` is then the
/// recovery floor, the lowest block any member still needs.
pub const JOIN_RECOVER: u8 = 2;
/// `age_op` of a `Join` from a member that finished its last allreduce and
/// lingers (docs/restart.md, "Idle members"): its `block_id` is the end of
/// its stream (it has every result before it), `src_cnt` the low 16 bits
/// of its member incarnation. It is also a probe: the switch answers as to
/// a plain Join, or with [`JOIN_ALL_DONE`] once every member said it is
/// done at the same block. A child switch sends one from its tree rank once
/// all of its own members are done. No body.
pub const JOIN_DONE: u8 = 3;
/// `age_op` of a `JoinAck` that answers a Join held at the job's join
/// barrier (docs/protocol.md §4.12): the switch heard the worker, but the
/// round starts only when every member joined. `next_block` carries how many
/// members have joined so far. The worker keeps asking.
pub const JOIN_WAIT: u8 = 3;
/// `age_op` of the `JoinAck` that releases a Join from the barrier: a round
/// starts at `next_block` for every member, at its first generation (a
/// worker that asked with `JOIN_SYNC` starts there too, unaligned).
pub const JOIN_ROUND_START: u8 = 4;
/// `age_op` of a `JoinAck` the switch sends unasked, to each member that
/// listens on a keyed job's result group, when a member left and the job's
/// result key moved to a new epoch (docs/protocol.md §2.4): the worker takes
/// the key it carries and nothing else (its other fields are the job's, but
/// answer no Join).
pub const JOIN_KEY_UPDATE: u8 = 5;
/// `age_op` of the `JoinAck` answering a [`JOIN_DONE`] Join once every
/// member of the job (below a tree's root: every worker of the tree) said
/// it is done at `next_block`: nobody can need a recovery any more, and a
/// lingering member may stop.
pub const JOIN_ALL_DONE: u8 = 6;

/// The 16-bit tag of a switch incarnation carried in the data plane: in
/// `src_id` of Results, in the reserved field of Nacks, and by workers in
/// `src_cnt` of their Contributions (docs/restart.md). Incarnations are odd,
/// so a tag is never 0.
pub fn incarnation_tag(incarnation: u32) -> u16 {
    incarnation as u16
}

/// Offset of the Nack body's reserved field (the incarnation tag) in a Nack
/// datagram.
pub const NACK_TAG: std::ops::Range<usize> = HEADER_LEN + 2..HEADER_LEN + 4;
/// `age_op` of a result the switch emitted because the block aged out.
pub const AGE_OP_AGED: u8 = 1;
/// `age_op` of a (not aged) result whose block waited for a contribution
/// that had been lost on its way: a member's retransmission filled the
/// block's hole. Congestion experienced, marked by the switch so that every
/// member learns it from the same result (docs/congestion.md).
pub const AGE_OP_CONGESTED: u8 = 2;

/// Body of a `Nack`: `reason u16 | reserved u16 | detail u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nack {
    pub reason: NackReason,
    pub detail: u32,
}

impl Nack {
    pub const LEN: usize = 8;

    pub fn parse(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < Self::LEN {
            return Err(WireError::Truncated { needed: Self::LEN, got: body.len() });
        }
        Ok(Self {
            reason: NackReason::from_u16(u16::from_be_bytes([body[0], body[1]]))?,
            detail: u32::from_be_bytes([body[4], body[5], body[6], body[7]]),
        })
    }

    /// Length of a whole Nack datagram (header and body).
    pub const DATAGRAM_LEN: usize = HEADER_LEN + Self::LEN;

    /// Write the whole Nack answering `request` into `buf` (exactly
    /// [`Nack::DATAGRAM_LEN`] bytes): the header copies the request's
    /// `dtype`, `src_id`, `gen_id`, `job_id` and `block_id` (docs/protocol.md
    /// §2.3), plus its `exp_only` flag when `echo_exp_only` (Trimmed nacks).
    /// The incarnation tag of a Nack datagram (0 if untagged or too short).
    pub fn tag_of(datagram: &[u8]) -> u16 {
        datagram.get(NACK_TAG).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]))
    }

    pub fn emit_reply(&self, request: &Packet<&[u8]>, echo_exp_only: bool, buf: &mut [u8]) {
        let repr = Repr {
            exp_only: echo_exp_only && request.exp_only(),
            dtype: Dtype::from_u8(request.dtype_code()).unwrap_or(Dtype::Int32),
            gen_id: request.gen_id(),
            block_id: request.block_id(),
            ..Repr::new(MessageType::Nack, request.job_id(), request.src_id())
        };
        let mut reply = Packet::new_unchecked(buf);
        repr.emit(&mut reply);
        self.emit(reply.payload_mut());
    }

    pub fn emit(&self, body: &mut [u8]) {
        body[0..2].copy_from_slice(&(self.reason as u16).to_be_bytes());
        body[2..4].copy_from_slice(&[0, 0]);
        body[4..8].copy_from_slice(&self.detail.to_be_bytes());
    }
}

#[cfg(test)]
mod tests;
