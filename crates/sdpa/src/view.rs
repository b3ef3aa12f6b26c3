//! Borrowed views of the caller's device memory as operands: no copy, any element strides with a
//! contiguous head_dim (as FlashAttention takes them), checked like owned tensors.

use crate::error::{Result, invalid};
use crate::extras::Extras;
use crate::footprint::{rows_distinct, span};
use crate::launch::{Bound, Call, Storage};
use crate::problem::Strides;
use crate::tensor::Element;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};

/// Q, K or V in the caller's device memory: a `[batch, heads, seq, head_dim]` tensor at element
/// `strides` inside `data` (head_dim contiguous), borrowed for the call.
///
/// Make one from a `CudaSlice` with `slice.as_view()` or `slice.slice(start..)`.
pub struct View<'a, T> {
    pub(crate) data: CudaView<'a, T>,
    pub(crate) strides: Strides,
}

/// The output in the caller's device memory, as [`View`] but written.
pub struct ViewMut<'a, T> {
    pub(crate) data: CudaViewMut<'a, T>,
    pub(crate) strides: Strides,
}

impl<'a, T: Element> View<'a, T> {
    /// The tensor at element `strides` inside `data`. Checked against the problem at the call.
    pub fn new(data: CudaView<'a, T>, strides: Strides) -> Self {
        View { data, strides }
    }
    /// The element strides.
    pub fn strides(&self) -> Strides {
        self.strides
    }
}

impl<'a, T: Element> ViewMut<'a, T> {
    /// The tensor at element `strides` inside `data`. Checked against the problem at the call.
    pub fn new(data: CudaViewMut<'a, T>, strides: Strides) -> Self {
        ViewMut { data, strides }
    }
    /// The element strides.
    pub fn strides(&self) -> Strides {
        self.strides
    }
}

impl<T> std::fmt::Debug for View<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("len", &self.data.len())
            .field("strides", &self.strides)
            .finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for ViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ViewMut")
            .field("len", &self.data.len())
            .field("strides", &self.strides)
            .finish_non_exhaustive()
    }
}

/// The operands of a call on views, by name: Q, K and V of element `T` (f16 or bf16), the
/// output of element `O`, the problem's output dtype: `T` itself by default, or `f32` for a
/// problem made `with_out_dtype(DType::F32)`.
///
/// Q, K and V read in place from one fused projection `[batch, seq, 3, heads, head_dim]` (what a
/// single QKV matmul writes), the output into a buffer of the problem's layout:
///
/// ```no_run
/// use half::bf16;
/// use sdpa::{Backend, DType, Device, Extras, Problem, Strides, View, ViewMut, Views};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let (b, s, h, d) = (2, 1024, 16, 64);
/// let p = Problem::new(b, h, s, s, d).with_dtype(DType::Bf16).with_causal(true);
/// let qkv = dev.stream().alloc_zeros::<bf16>(b * s * 3 * h * d)?;
/// let mut out = dev.stream().alloc_zeros::<bf16>(p.out_len().unwrap())?;
/// // Each row holds Q's heads, then K's, then V's.
/// let strides = Strides { batch: s * 3 * h * d, head: d, seq: 3 * h * d };
/// let part = |i: usize| View::new(qkv.slice(i * h * d..), strides);
/// let out_view = ViewMut::new(out.as_view_mut(), p.out_strides());
/// let views = Views { q: part(0), k: part(1), v: part(2), out: out_view };
/// sdpa::forward(&dev, &p, Backend::Auto, views, Extras::default())?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Views<'a, 'o, T, O = T> {
    /// Queries, `[batch, heads, seq_q, head_dim]`.
    pub q: View<'a, T>,
    /// Keys, `[batch, kv_heads, seq_k, head_dim]`.
    pub k: View<'a, T>,
    /// Values, as the keys.
    pub v: View<'a, T>,
    /// The output, as the queries; written only on success.
    pub out: ViewMut<'o, O>,
}

/// A run on views of the caller's memory ([`Views`]): nothing is copied or allocated (once
/// [`crate::Plan::reserve`] has run), and the work is queued on the plan's stream.
///
/// The problem's layout is not used: each view brings its own strides. Every view must be on the
/// plan's GPU, have the problem's dtype (the output its output dtype), 16-byte aligned rows (base
/// address and every stride a multiple of 16 bytes), and hold every element its strides
/// address; the output's strides must give each element its own address and the output may not
/// overlap an input. The fused backends take any such strides; cublas only the strides of the
/// problem's layout; cpu takes owned tensors only. `Auto` picks among the backends that take
/// these strides.
///
/// Stream order: a view of a buffer made on another stream is ordered like a [`crate::Tensor`]
/// of that stream (the call waits for the work queued there, and that stream waits for the
/// call), and cudarc's own event tracking, where the buffer's context has it on, adds its waits.
/// On the plan's own stream nothing is waited for or recorded, so the call can be captured into
/// a CUDA graph.
pub(crate) fn run_views<T: Element, O: Element>(
    plan: &crate::Plan,
    views: Views<'_, '_, T, O>,
    extras: Extras<'_>,
) -> Result<()> {
    let p = plan.checked();
    if T::DTYPE != p.dtype || O::DTYPE != p.output_dtype() {
        return Err(invalid!(
            "the views are {}, the problem's inputs {}; the output view is {}, the problem's \
             output {}",
            T::DTYPE,
            p.dtype,
            O::DTYPE,
            p.output_dtype()
        ));
    }
    let Views { q, k, v, out } = views;
    launch_views(plan, [q, k, v], out, extras)
}

/// Binds views to the one pipeline ([`crate::launch::launch`]): each checked against the
/// problem (its GPU, alignment and extent; the output's elements distinct), its strides with
/// size-1 dimensions as the layout's own, its address guarded until the launch is queued.
fn launch_views<T: Element, O: Element>(
    plan: &crate::Plan,
    [q, k, v]: [View<'_, T>; 3],
    mut out: ViewMut<'_, O>,
    extras: Extras<'_>,
) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let [qs, ks, vs, os] = p.operand_shapes();
    let spans = [
        span("q", dev, &q.data, q.strides, qs)?,
        span("k", dev, &k.data, k.strides, ks)?,
        span("v", dev, &v.data, v.strides, vs)?,
        span("out", dev, &out.data, out.strides, os)?,
    ];
    rows_distinct("out", out.strides, os)?;
    let strides = p.effective_strides([q.strides, k.strides, v.strides, out.strides]);
    let stream = dev.stream();
    // The guards record cudarc's read/write events (where tracking is on) once dropped, after
    // the launch is queued.
    let (qp, _qg) = q.data.device_ptr(stream);
    let (kp, _kg) = k.data.device_ptr(stream);
    let (vp, _vg) = v.data.device_ptr(stream);
    let out_stream = out.data.stream().clone();
    let (op, _og) = out.data.device_ptr_mut(stream);
    let [qspan, kspan, vspan, ospan] = spans;
    let bound = |ptr, strides, span| Bound {
        ptr,
        strides,
        span,
        scales: None,
    };
    let call = Call {
        ops: [
            bound(qp, strides[0], qspan),
            bound(kp, strides[1], kspan),
            bound(vp, strides[2], vspan),
            bound(op, strides[3], ospan),
        ],
        streams: vec![
            q.data.stream().clone(),
            k.data.stream().clone(),
            v.data.stream().clone(),
            out_stream,
        ],
        storage: Storage::Views,
    };
    crate::launch::launch(plan, call, extras)
}
