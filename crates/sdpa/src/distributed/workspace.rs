//! A local rank's device memory for ring calls, kept from call to call: grown when a call needs
//! more, never shrunk, so that once a call of a size has run, later calls of that size allocate
//! nothing (a model calls the ring once a layer with the same sizes).
//!
//! Every buffer is used on the rank's compute stream or, for the K/V shards in flight, on its
//! communication stream after it has joined the compute stream; a call returns only once its
//! compute streams are done, so the next call finds every buffer free.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr};

/// What one call needs of a rank's buffers, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sizes {
    /// Bytes of the K/V shards in flight: two shards of K and V (none in a ring of one).
    pub(crate) kv_bytes: usize,
    /// Bytes of one call's partial output.
    pub(crate) part_bytes: usize,
    /// Query rows of the local shard (batch × heads × positions).
    pub(crate) rows: usize,
    pub(crate) head_dim: usize,
}

impl Sizes {
    /// The bytes these sizes take on the GPU.
    pub(crate) fn bytes(&self) -> usize {
        // The partial output's log-sum-exp, the running output and its log-sum-exp, in f32.
        self.kv_bytes + self.part_bytes + 4 * self.rows * (self.head_dim + 2)
    }
}

/// A rank's buffers; see the module.
#[derive(Default)]
pub(crate) struct RankBuffers {
    kv: Grown<u8>,
    part: Grown<u8>,
    part_lse: Grown<f32>,
    acc_o: Grown<f32>,
    acc_lse: Grown<f32>,
}

/// Views of a rank's buffers for one call, each of the length the call asked for.
pub(crate) struct CallBuffers<'a> {
    /// The K/V shards in flight, bytes: K and V of the first, then of the second.
    pub(crate) kv: CudaView<'a, u8>,
    /// One call's partial output, bytes.
    pub(crate) part: CudaViewMut<'a, u8>,
    pub(crate) part_lse: CudaViewMut<'a, f32>,
    pub(crate) acc_o: CudaViewMut<'a, f32>,
    pub(crate) acc_lse: CudaViewMut<'a, f32>,
}

impl RankBuffers {
    /// Views of at least `s` (grown where shorter; contents undefined: every call writes what it
    /// reads before reading it).
    pub(crate) fn for_call(&mut self, dev: &Device, s: &Sizes) -> Result<CallBuffers<'_>> {
        let rows_d = s.rows * s.head_dim;
        Ok(CallBuffers {
            kv: self.kv.at_least(dev, s.kv_bytes)?.slice(..s.kv_bytes),
            part: self
                .part
                .at_least(dev, s.part_bytes)?
                .slice_mut(..s.part_bytes),
            part_lse: self.part_lse.at_least(dev, s.rows)?.slice_mut(..s.rows),
            acc_o: self.acc_o.at_least(dev, rows_d)?.slice_mut(..rows_d),
            acc_lse: self.acc_lse.at_least(dev, s.rows)?.slice_mut(..s.rows),
        })
    }
}

/// A device buffer at least as long as the longest asked for so far.
struct Grown<T>(Option<CudaSlice<T>>);

impl<T> Default for Grown<T> {
    fn default() -> Self {
        Grown(None)
    }
}

impl<T: DeviceRepr> Grown<T> {
    /// The buffer, reallocated (its contents lost) where shorter than `n` elements; at least one
    /// element, so that an empty request still has a buffer to view.
    fn at_least(&mut self, dev: &Device, n: usize) -> Result<&mut CudaSlice<T>> {
        let n = n.max(1);
        if self.0.as_ref().is_none_or(|b| b.len() < n) {
            self.0 = None; // free the old one before asking for the larger
            // SAFETY: the ring writes every element it reads (see the module) before reading it.
            self.0 = Some(unsafe { dev.alloc::<T>(n)? });
        }
        Ok(self.0.as_mut().expect("just made"))
    }
}
