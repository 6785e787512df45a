//! The tensor an allreduce reduces: owned ([`Tensor`]) or lent, and
//! [`Prepared`] with the block floating point exponent of each of its blocks.

use fanin_wire::value::Dtype;

use super::lending::TensorRef;
use crate::bfp::half::{self, Half};
use crate::bfp::{self, OutOfRange};

/// A tensor to reduce, owned by the session while the allreduce runs.
/// 16-bit floats are held as their bits, with which format they are.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    I32(Vec<i32>),
    F32(Vec<f32>),
    Half(Half, Vec<u16>),
}

impl Tensor {
    pub fn len(&self) -> usize {
        match self {
            Tensor::I32(v) => v.len(),
            Tensor::F32(v) => v.len(),
            Tensor::Half(_, v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> Dtype {
        self.view().dtype()
    }
}

/// A tensor with the local exponent of each of its blocks computed (float32
/// block floating point), ready for [`AllreduceSession::begin_prepared`](super::AllreduceSession::begin_prepared).
/// It owns the tensor, or borrows it ([`borrow`](Self::borrow)) for
/// [`AllreduceSession::begin_into`](super::AllreduceSession::begin_into).
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared<'a> {
    pub(super) input: PreparedInput<'a>,
    pub(super) local_exp: Vec<i8>,
    /// The block size the exponents were computed for.
    pub(super) per: usize,
    /// The result is the mean, not the sum ([`averaged`](Self::averaged)).
    pub(super) average: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum PreparedInput<'a> {
    Owned(Tensor),
    Borrowed(TensorRef<'a>),
}

impl PreparedInput<'_> {
    pub(super) fn view(&self) -> TensorRef<'_> {
        match self {
            PreparedInput::Owned(t) => t.view(),
            PreparedInput::Borrowed(v) => *v,
        }
    }
}

impl Prepared<'static> {
    /// The exponents of `tensor`'s blocks of `per` elements (none for int32).
    /// A value block floating point cannot carry is refused with its index
    /// in the tensor.
    pub fn new(tensor: Tensor, per: usize) -> Result<Self, OutOfRange> {
        let per = per.max(1);
        let local_exp = exponents_of(tensor.view(), per)?;
        Ok(Prepared { input: PreparedInput::Owned(tensor), local_exp, per, average: false })
    }

    /// Copy `values` into `buf` (reusing its memory) a block at a time,
    /// taking each block's exponent while the block is in cache: one pass
    /// over a large input instead of a copy and then a second read.
    pub fn copy_f32(values: &[f32], per: usize, mut buf: Vec<f32>) -> Result<Self, OutOfRange> {
        let per = per.max(1);
        buf.clear();
        buf.reserve(values.len());
        let mut local_exp = Vec::with_capacity(values.len().div_ceil(per));
        for chunk in values.chunks(per) {
            let start = buf.len();
            buf.extend_from_slice(chunk);
            local_exp.push(block_exponent_at(&buf[start..], start)?);
        }
        Ok(Prepared { input: PreparedInput::Owned(Tensor::F32(buf)), local_exp, per, average: false })
    }
}

impl<'a> Prepared<'a> {
    /// Prepare `input` without copying it, for [`AllreduceSession::begin_into`](super::AllreduceSession::begin_into)
    /// (an output other than the input itself): the session then reads each
    /// block from `input` as it goes out, and again only if a switch restart
    /// needs a retained contribution. One read-only pass takes the
    /// exponents, so a refused value is still refused before anything is
    /// sent.
    pub fn borrow(input: TensorRef<'a>, per: usize) -> Result<Self, OutOfRange> {
        let per = per.max(1);
        let local_exp = exponents_of(input, per)?;
        Ok(Prepared { input: PreparedInput::Borrowed(input), local_exp, per, average: false })
    }

    /// Ask for the mean instead of the sum (float tensors; an int32 one is
    /// refused when the allreduce begins). Each block is divided by the
    /// number of sources its result summed (`src_cnt`: a partial result is
    /// the mean of the contributions it has) while its result is decoded,
    /// and rounded once to the tensor's type. Dividing the decoded sum
    /// afterwards would round the sum first: a float16 sum past 65 504 is
    /// infinite even where the mean fits.
    pub fn averaged(self) -> Self {
        Prepared { average: true, ..self }
    }

    pub fn len(&self) -> usize {
        self.input.view().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same tensor prepared for blocks of `per` elements.
    pub(super) fn for_block_size(self, per: usize) -> Result<Self, OutOfRange> {
        let per = per.max(1);
        if self.per == per {
            return Ok(self);
        }
        let local_exp = exponents_of(self.input.view(), per)?;
        Ok(Prepared { local_exp, per, ..self })
    }
}

/// The block exponents of `input` in blocks of `per` (none for int32).
fn exponents_of(input: TensorRef<'_>, per: usize) -> Result<Vec<i8>, OutOfRange> {
    match input {
        TensorRef::F32(values) => block_exponents(values.chunks(per)),
        TensorRef::Half(kind, values) => {
            let mut offset = 0;
            values
                .chunks(per)
                .map(|block| {
                    let e = half::block_exponent_half(kind, block).map_err(|e| OutOfRange { index: offset + e.index, ..e });
                    offset += block.len();
                    e
                })
                .collect()
        }
        TensorRef::I32(_) => Ok(Vec::new()),
    }
}

/// Each block's exponent, in order.
fn block_exponents<'a>(blocks: impl Iterator<Item = &'a [f32]>) -> Result<Vec<i8>, OutOfRange> {
    let mut offset = 0;
    blocks
        .map(|block| {
            let e = block_exponent_at(block, offset);
            offset += block.len();
            e
        })
        .collect()
}

/// The exponent of the block starting at element `offset`; a refused value
/// is reported with its index in the whole tensor, not in its block.
fn block_exponent_at(block: &[f32], offset: usize) -> Result<i8, OutOfRange> {
    bfp::block_exponent(block).map_err(|e| OutOfRange { index: offset + e.index, ..e })
}
