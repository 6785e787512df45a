//! Where an allreduce's input comes from and its results go.
//!
//! By default ([`AllreduceSession::begin`](super::AllreduceSession::begin))
//! the session owns the tensor: each block's result overwrites its block,
//! and the tensor comes back in the `Outcome`. With
//! [`begin_into`](super::AllreduceSession::begin_into) the caller lends an
//! output buffer for the call and the results are written there, leaving
//! the input intact. That saves two copies of the whole tensor for a caller
//! whose output is memory the session cannot own (a numpy `out=` array, a
//! torch tensor): the copy of the result into it, and the copy of every
//! contribution the session retains for a switch restart, which it can
//! emit again from the intact input when (rarely) it is needed
//! (docs/restart.md). The input itself may be lent as well
//! ([`Prepared::borrow`](super::Prepared::borrow)), which saves the third
//! copy: staging it into memory the session owns. It is then only read,
//! block by block as each goes out.

use std::ptr::NonNull;

use super::Tensor;
use crate::bfp::half::Half;

/// A tensor to reduce that the caller lends ([`Prepared::borrow`](super::Prepared::borrow)).
/// 16-bit floats are passed as their bits, with which format they are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TensorRef<'a> {
    I32(&'a [i32]),
    F32(&'a [f32]),
    Half(Half, &'a [u16]),
}

impl TensorRef<'_> {
    pub fn len(&self) -> usize {
        match self {
            TensorRef::I32(v) => v.len(),
            TensorRef::F32(v) => v.len(),
            TensorRef::Half(_, v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> fanin_wire::value::Dtype {
        match self {
            TensorRef::I32(_) => fanin_wire::value::Dtype::Int32,
            TensorRef::F32(_) => fanin_wire::value::Dtype::Float32,
            TensorRef::Half(kind, _) => kind.dtype(),
        }
    }

    pub fn to_owned(self) -> Tensor {
        match self {
            TensorRef::I32(v) => Tensor::I32(v.to_vec()),
            TensorRef::F32(v) => Tensor::F32(v.to_vec()),
            TensorRef::Half(kind, v) => Tensor::Half(kind, v.to_vec()),
        }
    }

    /// The bytes it spans, to tell whether an output overlaps it.
    fn span(&self) -> std::ops::Range<usize> {
        let (p, n) = match self {
            TensorRef::I32(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
            TensorRef::F32(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
            TensorRef::Half(_, v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
        };
        p..p + n
    }
}

impl Tensor {
    pub fn view(&self) -> TensorRef<'_> {
        match self {
            Tensor::I32(v) => TensorRef::I32(v),
            Tensor::F32(v) => TensorRef::F32(v),
            Tensor::Half(kind, v) => TensorRef::Half(*kind, v),
        }
    }
}

/// The input of a running allreduce: owned by the session, or lent by the
/// caller of `begin_into` for the duration of the allreduce (kept as a raw
/// pointer for the reason `Lent` is; the same safety contract covers it).
#[derive(Debug)]
pub(super) enum Input {
    Owned(Tensor),
    Lent(LentIn),
}

#[derive(Debug)]
pub(super) enum LentIn {
    I32(NonNull<i32>, usize),
    F32(NonNull<f32>, usize),
    Half(Half, NonNull<u16>, usize),
}

// SAFETY: as for `Lent`: only read through the session holding it, and
// `begin_into`'s caller guarantees the memory stays valid and unwritten
// until the allreduce ends.
unsafe impl Send for LentIn {}

impl Input {
    pub(super) fn lend(input: TensorRef<'_>) -> Input {
        Input::Lent(match input {
            TensorRef::I32(v) => LentIn::I32(NonNull::from(v).cast(), v.len()),
            TensorRef::F32(v) => LentIn::F32(NonNull::from(v).cast(), v.len()),
            TensorRef::Half(kind, v) => LentIn::Half(kind, NonNull::from(v).cast(), v.len()),
        })
    }

    pub(super) fn view(&self) -> TensorRef<'_> {
        match self {
            Input::Owned(t) => t.view(),
            // SAFETY: `begin_into`'s caller keeps the lent input valid and
            // unwritten while the allreduce runs, and the session drops the
            // `Input` when it ends; the view borrows `self`, so it cannot
            // outlive that.
            Input::Lent(LentIn::I32(p, n)) => TensorRef::I32(unsafe { std::slice::from_raw_parts(p.as_ptr(), *n) }),
            Input::Lent(LentIn::F32(p, n)) => TensorRef::F32(unsafe { std::slice::from_raw_parts(p.as_ptr(), *n) }),
            Input::Lent(LentIn::Half(kind, p, n)) => {
                TensorRef::Half(*kind, unsafe { std::slice::from_raw_parts(p.as_ptr(), *n) })
            }
        }
    }

    /// What the outcome hands back: the owned tensor, or an empty one of
    /// the same dtype for a lent input (the caller has it).
    pub(super) fn into_outcome_tensor(self) -> Tensor {
        match self {
            Input::Owned(t) => t,
            Input::Lent(LentIn::I32(..)) => Tensor::I32(Vec::new()),
            Input::Lent(LentIn::F32(..)) => Tensor::F32(Vec::new()),
            Input::Lent(LentIn::Half(kind, ..)) => Tensor::Half(kind, Vec::new()),
        }
    }
}

/// A caller's output buffer for one allreduce, or one block of a result.
#[derive(Debug)]
pub enum TensorMut<'a> {
    I32(&'a mut [i32]),
    F32(&'a mut [f32]),
    Half(Half, &'a mut [u16]),
}

impl TensorMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            TensorMut::I32(v) => v.len(),
            TensorMut::F32(v) => v.len(),
            TensorMut::Half(_, v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn same_dtype(&self, tensor: TensorRef<'_>) -> bool {
        match (self, tensor) {
            (TensorMut::I32(_), TensorRef::I32(_)) | (TensorMut::F32(_), TensorRef::F32(_)) => true,
            (TensorMut::Half(a, _), TensorRef::Half(b, _)) => *a == b,
            _ => false,
        }
    }

    fn span(&self) -> std::ops::Range<usize> {
        match self {
            TensorMut::I32(v) => TensorRef::I32(v).span(),
            TensorMut::F32(v) => TensorRef::F32(v).span(),
            TensorMut::Half(kind, v) => TensorRef::Half(*kind, v).span(),
        }
    }
}

/// Whether `out` shares memory with `input` (then the input must be staged:
/// results would overwrite contributions not yet sent or still retained).
pub(super) fn overlaps(out: &TensorMut<'_>, input: TensorRef<'_>) -> bool {
    spans_overlap(out.span(), input.span())
}

fn spans_overlap(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// A lent output as the session keeps it while the allreduce runs: the
/// borrow's lifetime cannot be stored in a session that outlives the call,
/// so `begin_into`'s caller promises it instead (see its safety contract).
#[derive(Debug)]
pub(super) enum Lent {
    I32(NonNull<i32>, usize),
    F32(NonNull<f32>, usize),
    Half(Half, NonNull<u16>, usize),
}

// SAFETY: a `Lent` is only dereferenced through the session that holds it,
// i.e. by whichever single thread drives the session at the time, and
// `begin_into`'s caller guarantees nothing else touches the memory until the
// allreduce ends. Moving the session between threads moves that exclusive
// access with it, as moving a `&mut [T]` would.
unsafe impl Send for Lent {}

impl Lent {
    /// Keep `out` as the output of an allreduce of `input`; `None` if its
    /// dtype or length differs.
    pub(super) fn new(out: TensorMut<'_>, input: TensorRef<'_>) -> Option<Lent> {
        if !out.same_dtype(input) || out.len() != input.len() {
            return None;
        }
        Some(match out {
            TensorMut::I32(v) => Lent::I32(NonNull::from(v).cast(), input.len()),
            TensorMut::F32(v) => Lent::F32(NonNull::from(v).cast(), input.len()),
            TensorMut::Half(kind, v) => Lent::Half(kind, NonNull::from(v).cast(), input.len()),
        })
    }

    /// Elements `start..start + count` of the output (in bounds: the
    /// session only asks for blocks of the tensor, which has this length).
    pub(super) fn block(&mut self, start: usize, count: usize) -> TensorMut<'_> {
        // SAFETY: the range lies inside the lent buffer (asserted), which
        // `begin_into`'s caller keeps valid and unaliased while the
        // allreduce runs; the returned borrow is tied to `&mut self`, so no
        // two blocks are handed out at once.
        unsafe {
            match *self {
                Lent::I32(p, len) => {
                    assert!(start + count <= len, "block {start}+{count} beyond the output ({len})");
                    TensorMut::I32(std::slice::from_raw_parts_mut(p.as_ptr().add(start), count))
                }
                Lent::F32(p, len) => {
                    assert!(start + count <= len, "block {start}+{count} beyond the output ({len})");
                    TensorMut::F32(std::slice::from_raw_parts_mut(p.as_ptr().add(start), count))
                }
                Lent::Half(kind, p, len) => {
                    assert!(start + count <= len, "block {start}+{count} beyond the output ({len})");
                    TensorMut::Half(kind, std::slice::from_raw_parts_mut(p.as_ptr().add(start), count))
                }
            }
        }
    }
}

/// Block `start..start + count` of `tensor`, to write a result into.
pub(super) fn tensor_block(tensor: &mut Tensor, start: usize, count: usize) -> TensorMut<'_> {
    match tensor {
        Tensor::I32(v) => TensorMut::I32(&mut v[start..start + count]),
        Tensor::F32(v) => TensorMut::F32(&mut v[start..start + count]),
        Tensor::Half(kind, v) => TensorMut::Half(*kind, &mut v[start..start + count]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_overlap_when_they_share_a_byte() {
        assert!(spans_overlap(0..8, 4..12));
        assert!(spans_overlap(4..12, 0..8));
        assert!(spans_overlap(0..8, 0..8));
        assert!(spans_overlap(2..4, 0..8), "one inside the other");
        assert!(!spans_overlap(0..8, 8..16), "adjacent halves of one buffer");
        assert!(!spans_overlap(8..16, 0..8));
    }

    #[test]
    fn an_output_is_told_apart_from_an_input_beside_it() {
        let mut buf = [0.0f32; 16];
        let (input, out) = buf.split_at_mut(8);
        assert!(!overlaps(&TensorMut::F32(out), TensorRef::F32(input)));
        let other = vec![0.0f32; 8];
        let mut out = vec![0.0f32; 8];
        assert!(!overlaps(&TensorMut::F32(&mut out), TensorRef::F32(&other)));
    }
}
