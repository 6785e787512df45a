//! Where an allreduce's results go.
//!
//! By default ([`AllreduceSession::begin`](super::AllreduceSession::begin))
//! each block's result overwrites the block of the tensor the session owns,
//! and the tensor comes back in the `Outcome`. With
//! [`begin_into`](super::AllreduceSession::begin_into) the caller lends an
//! output buffer for the call and the results are written there, leaving
//! the input intact. That saves two copies of the whole tensor for a caller
//! whose output is memory the session cannot own (a numpy `out=` array, a
//! torch tensor): the copy of the result into it, and the copy of every
//! contribution the session retains for a switch restart, which it can
//! emit again from the intact input when (rarely) it is needed
//! (docs/restart.md).

use std::ptr::NonNull;

use super::Tensor;

/// A caller's output buffer for one allreduce, or one block of a result.
#[derive(Debug)]
pub enum TensorMut<'a> {
    I32(&'a mut [i32]),
    F32(&'a mut [f32]),
}

impl TensorMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            TensorMut::I32(v) => v.len(),
            TensorMut::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn same_dtype(&self, tensor: &Tensor) -> bool {
        matches!((self, tensor), (TensorMut::I32(_), Tensor::I32(_)) | (TensorMut::F32(_), Tensor::F32(_)))
    }
}

/// A lent output as the session keeps it while the allreduce runs: the
/// borrow's lifetime cannot be stored in a session that outlives the call,
/// so `begin_into`'s caller promises it instead (see its safety contract).
#[derive(Debug)]
pub(super) enum Lent {
    I32(NonNull<i32>, usize),
    F32(NonNull<f32>, usize),
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
    pub(super) fn new(out: TensorMut<'_>, input: &Tensor) -> Option<Lent> {
        if !out.same_dtype(input) || out.len() != input.len() {
            return None;
        }
        Some(match out {
            TensorMut::I32(v) => Lent::I32(NonNull::from(v).cast(), input.len()),
            TensorMut::F32(v) => Lent::F32(NonNull::from(v).cast(), input.len()),
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
            }
        }
    }
}

/// Block `start..start + count` of `tensor`, to write a result into.
pub(super) fn tensor_block(tensor: &mut Tensor, start: usize, count: usize) -> TensorMut<'_> {
    match tensor {
        Tensor::I32(v) => TensorMut::I32(&mut v[start..start + count]),
        Tensor::F32(v) => TensorMut::F32(&mut v[start..start + count]),
    }
}
