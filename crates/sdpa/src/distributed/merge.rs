//! The running result of one rank's queries across ring steps: f32 output and log-sum-exp on the
//! device, each step's partial result folded in through the LSE (sdpa-sys/cpp/src/merge/merge.cu,
//! sdpa/merge.h has the formula), rounded into the caller's output once at the end. Partial results
//! in f32 (where the kernel writes them so) and an f32 running result round the output once, as one
//! GPU does; 16-bit partial results add one rounding each.

use crate::device::Device;
use crate::error::Result;
use crate::problem::{DType, Strides};
use cudarc::driver::{CudaViewMut, DevicePtr, DevicePtrMut};
use sdpa_sys::args::{Dtype, MergeArgs, MergeFinishArgs};

/// A `[batch, heads, seq, head_dim]` f32 output and `[batch, heads, seq]` log-sum-exp, dense,
/// on one device's stream, in buffers it borrows.
pub(crate) struct Accumulator<'a> {
    o: CudaViewMut<'a, f32>,
    lse: CudaViewMut<'a, f32>,
    batch: usize,
    heads: usize,
    seq: usize,
    head_dim: usize,
}

/// A partial result in device memory: `rows` query positions from `row0` of each (batch, head),
/// its output (`dtype`: the problem's, or f32) at `strides`, its log-sum-exp dense `[batch,
/// heads, rows]`.
pub(crate) struct Partial {
    pub(crate) o: u64,
    pub(crate) strides: Strides,
    pub(crate) lse: u64,
    pub(crate) row0: usize,
    pub(crate) rows: usize,
    pub(crate) dtype: Dtype,
}

impl<'a> Accumulator<'a> {
    /// An accumulator in `o` and `lse` (of `batch·heads·seq` rows) set to "no key seen" (output
    /// 0, log-sum-exp -inf) on `dev`'s stream.
    pub(crate) fn new(
        dev: &Device,
        (o, lse): (CudaViewMut<'a, f32>, CudaViewMut<'a, f32>),
        batch: usize,
        heads: usize,
        seq: usize,
        head_dim: usize,
    ) -> Result<Accumulator<'a>> {
        let rows = batch * heads * seq;
        debug_assert!(o.len() >= rows * head_dim && lse.len() >= rows);
        let acc = Accumulator {
            o,
            lse,
            batch,
            heads,
            seq,
            head_dim,
        };
        let stream = dev.raw_stream()?;
        {
            let (op, _og) = acc.o.device_ptr(dev.stream());
            let (lp, _lg) = acc.lse.device_ptr(dev.stream());
            // SAFETY: both buffers hold `rows` rows on this context.
            unsafe { sdpa_sys::ffi::merge_init(op, lp, rows as i64, head_dim as i64, stream)? };
        }
        Ok(acc)
    }

    /// Folds `part` in, on `dev`'s stream (after the work that wrote it there).
    ///
    /// # Safety
    /// `part` must describe live device buffers on `dev`'s GPU holding what its rows and strides
    /// address, with `part.row0 + part.rows <= seq`.
    pub(crate) unsafe fn fold(&mut self, dev: &Device, part: &Partial) -> Result<()> {
        debug_assert!(part.row0 + part.rows <= self.seq);
        let stream = dev.raw_stream()?;
        let (op, _og) = self.o.device_ptr_mut(dev.stream());
        let (lp, _lg) = self.lse.device_ptr_mut(dev.stream());
        let args = MergeArgs {
            acc_o: op,
            acc_lse: lp,
            part_o: part.o,
            part_lse: part.lse,
            part_stride: part.strides.as_i64().into(),
            batch: self.batch as i64,
            heads: self.heads as i64,
            rows: part.rows as i64,
            head_dim: self.head_dim as i64,
            acc_seq: self.seq as i64,
            row0: part.row0 as i64,
            dtype: part.dtype,
        };
        // SAFETY: the accumulator's buffers are live; the caller vouches for the part's.
        unsafe { sdpa_sys::ffi::merge_partial(&args, stream)? };
        Ok(())
    }

    /// Writes the output, rounded to `dtype`, at `out` with `strides`, and copies the
    /// log-sum-exp to `lse` (an f32 buffer of `batch·heads·seq`) where given.
    ///
    /// # Safety
    /// `out` and `lse` must be live device buffers on `dev`'s GPU holding what they address.
    pub(crate) unsafe fn finish(
        &self,
        dev: &Device,
        out: u64,
        strides: Strides,
        dtype: DType,
        lse: Option<u64>,
    ) -> Result<()> {
        let stream = dev.raw_stream()?;
        let (op, _og) = self.o.device_ptr(dev.stream());
        let args = MergeFinishArgs {
            acc_o: op,
            out,
            out_stride: strides.as_i64().into(),
            batch: self.batch as i64,
            heads: self.heads as i64,
            seq: self.seq as i64,
            head_dim: self.head_dim as i64,
            dtype: crate::ffi::dtype(dtype),
        };
        // SAFETY: the accumulator is live; the caller vouches for `out`.
        unsafe { sdpa_sys::ffi::merge_finish(&args, stream)? };
        if let Some(dst) = lse {
            let (lp, _lg) = self.lse.device_ptr(dev.stream());
            let bytes = 4 * self.batch * self.heads * self.seq;
            // SAFETY: both hold `bytes` on this context; the caller vouches for `dst`.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, lp, bytes, dev.stream().cu_stream())?
            };
        }
        Ok(())
    }
}
