//! One block of a ring step on one rank: attention of the block's query rows to its keys as a
//! single-GPU call into the rank's partial-result buffer (in f32 where the backend writes it so),
//! then folded into the running result through the log-sum-exp.

use super::merge::{Accumulator, Partial};
use super::problems::block_problem;
use super::schedule::Block;
use super::timeline::{Phase, Timeline};
use crate::backend::Backend;
use crate::device::Device;
use crate::error::Result;
use crate::extras::Extras;
use crate::ffi;
use crate::plan::Plan;
use crate::problem::{DType, Problem, Strides};
use crate::tensor::Element;
use crate::view::{View, ViewMut, Views};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr};
use sdpa_sys::args::Dtype;

/// What one rank's attention calls write: one call's partial output (the problem's dtype, or
/// f32 where `part_f32`) and log-sum-exp, and the running result; and, where asked, where its
/// time goes.
pub(crate) struct Scratch<'a> {
    pub(crate) part: CudaViewMut<'a, u8>,
    pub(crate) part_f32: bool,
    pub(crate) part_lse: CudaViewMut<'a, f32>,
    pub(crate) acc: Accumulator<'a>,
    pub(crate) timeline: Option<Timeline>,
}

/// One block of a step: attention of the block's query rows to its keys, into the partial
/// buffers, then folded into the running result.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend<T: Element>(
    dev: &Device,
    p: &Problem,
    block: &Block,
    q: &CudaView<'_, T>,
    k: &CudaView<'_, T>,
    v: &CudaView<'_, T>,
    (qs, ks): (Strides, Strides),
    wk: &mut Scratch<'_>,
    backend: Backend,
) -> Result<()> {
    let bp = block_problem(p, block);
    let rows = block.q.len();
    let part_strides = bp.with_layout(crate::problem::Layout::Bhsd).q_strides();
    let n_out = bp.q_len().expect("validated");
    let n_lse = bp.lse_len();
    let ins = [
        View::new(q.slice(block.q.start * qs.seq..), qs),
        View::new(k.slice(block.k.start * ks.seq..), ks),
        View::new(v.slice(block.k.start * ks.seq..), ks),
    ];
    let extras = Extras {
        lse: Some(wk.part_lse.slice_mut(..n_lse)),
        ..Extras::default()
    };
    let stream = dev.stream();
    let (o, dtype) = Timeline::span(&mut wk.timeline, Phase::Attention, stream, || {
        let [q, k, v] = ins;
        // SAFETY: the partial buffer holds a whole local shard's output in its element type
        // (Sizes::part_bytes); each call writes the rows it covers before the merge reads them.
        Ok(if wk.part_f32 {
            let mut part = unsafe { wk.part.transmute_mut::<f32>(n_out) }.expect("sized");
            let out = ViewMut::new(part.slice_mut(..), part_strides);
            // A partial result, merged with the others before it is rounded: f32 where cutlass
            // writes it (the ring checked that it does for every block of the rank).
            let plan = Plan::new(dev, &bp.with_out_dtype(DType::F32), Backend::Cutlass)?;
            plan.run(Views { q, k, v, out }, extras)?;
            (part.device_ptr(stream).0, Dtype::F32)
        } else {
            let mut part = unsafe { wk.part.transmute_mut::<T>(n_out) }.expect("sized");
            let out = ViewMut::new(part.slice_mut(..), part_strides);
            crate::forward(dev, &bp, backend, Views { q, k, v, out }, extras)?;
            (part.device_ptr(stream).0, ffi::dtype(p.dtype))
        })
    })?;
    let part = Partial {
        o,
        strides: part_strides,
        lse: wk.part_lse.device_ptr(dev.stream()).0,
        row0: block.q.start,
        rows,
        dtype,
    };
    Timeline::span(&mut wk.timeline, Phase::Merge, stream, || {
        // SAFETY: the partial buffers hold the block's rows, just written on this stream.
        unsafe { wk.acc.fold(dev, &part) }
    })
}
