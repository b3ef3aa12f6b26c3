//! e4m3 operands in the caller's memory: codes at any strides (head_dim contiguous) and their
//! dequantization scales, read in place like the 16-bit views of `view.rs`; all three inputs
//! ([`Fp8Views`]) or K and V alone, an FP8 K/V cache under 16-bit Q ([`Fp8KvViews`]).

use crate::error::{Result, invalid};
use crate::extras::Extras;
use crate::footprint::{rows_distinct, span};
use crate::launch::{Bound, Call, Storage};
use crate::problem::{DType, Scaling, Strides};
use crate::tensor::Element;
use crate::view::{View, ViewMut};
use cudarc::driver::{CudaView, DevicePtr, DeviceSlice};

/// Q, K or V as e4m3 codes in the caller's device memory: a `[batch, heads, seq, head_dim]`
/// tensor of codes at element `strides` inside `codes`, and `scales` (real value = code · scale):
/// one, or one per (batch, head) pair in batch-major order, as the problem's `fp8_scaling` says.
pub struct Fp8View<'a> {
    codes: CudaView<'a, u8>,
    scales: CudaView<'a, f32>,
    strides: Strides,
}

impl<'a> Fp8View<'a> {
    /// The codes at element `strides` inside `codes`, with their `scales`. Checked against the
    /// problem at the call.
    pub fn new(codes: CudaView<'a, u8>, scales: CudaView<'a, f32>, strides: Strides) -> Self {
        Fp8View {
            codes,
            scales,
            strides,
        }
    }
}

impl std::fmt::Debug for Fp8View<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fp8View")
            .field("len", &self.codes.len())
            .field("scales", &self.scales.len())
            .field("strides", &self.strides)
            .finish_non_exhaustive()
    }
}

/// The operands of an e4m3 call on views, by name; the output is f16 or bf16.
///
/// e4m3 codes the caller quantized, one scale a tensor, read in place:
///
/// ```no_run
/// use half::bf16;
/// use sdpa::{Backend, DType, Device, Extras, Fp8View, Fp8Views, Problem, Scaling, ViewMut};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let s = dev.stream();
/// let p = Problem::new(1, 16, 4096, 4096, 128)
///     .with_dtype(DType::E4m3)
///     .with_fp8_scaling(Scaling::PerTensor)
///     .with_out_dtype(DType::Bf16); // f16 (the default) runs on the native kernel only
/// let n = p.q_len().unwrap();
/// // Codes 0x38 (1.0) and 0x30 (0.5); value = code · scale.
/// let (q, k, v) = (s.clone_htod(&vec![0x38u8; n])?, s.clone_htod(&vec![0x30u8; n])?,
///                  s.clone_htod(&vec![0x38u8; n])?);
/// let (q_scale, kv_scale) = (s.clone_htod(&[0.25f32])?, s.clone_htod(&[2.0f32])?);
/// let mut out = s.alloc_zeros::<bf16>(n)?;
/// let views = Fp8Views {
///     q: Fp8View::new(q.as_view(), q_scale.as_view(), p.q_strides()),
///     k: Fp8View::new(k.as_view(), kv_scale.as_view(), p.k_strides()),
///     v: Fp8View::new(v.as_view(), kv_scale.as_view(), p.v_strides()),
///     out: ViewMut::new(out.as_view_mut(), p.out_strides()),
/// };
/// sdpa::forward(&dev, &p, Backend::Auto, views, Extras::default())?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Fp8Views<'a, 'o, T> {
    /// Queries.
    pub q: Fp8View<'a>,
    /// Keys.
    pub k: Fp8View<'a>,
    /// Values.
    pub v: Fp8View<'a>,
    /// The output, `p.output_dtype()`; written only on success.
    pub out: ViewMut<'o, T>,
}

/// A run on e4m3 views ([`Fp8Views`]): codes and scales read in place, the output written in
/// place, nothing copied or allocated (once [`crate::Plan::reserve`] has run).
///
/// Each view is checked as a 16-bit one is (its GPU, rows of 16-byte multiples, that it holds
/// what its strides reach), and its scales hold one value, or one per (batch, head) pair. The
/// native e4m3 kernel (cutlass on sm_90a) takes any strides. The other fused backends
/// dequantize first (the simulated path): they need bf16 output (the scales stay on the GPU,
/// so whether f16 holds code · scale exactly cannot be checked), and per-head scales there need
/// the strides of the problem's layout. cpu and cublas take owned tensors only.
pub(crate) fn run_fp8_views<T: Element>(
    plan: &crate::Plan,
    views: Fp8Views<'_, '_, T>,
    extras: Extras<'_>,
) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let Fp8Views { q, k, v, mut out } = views;
    if p.dtype != DType::E4m3 || p.output_dtype() != T::DTYPE {
        return Err(invalid!(
            "e4m3 views need an e4m3 problem with {} output; the problem's inputs are {} and \
             output {}",
            T::DTYPE,
            p.dtype,
            p.output_dtype()
        ));
    }
    let [qs, ks, vs, os] = p.operand_shapes();
    let spans = [
        span("q", dev, &q.codes, q.strides, qs)?,
        span("k", dev, &k.codes, k.strides, ks)?,
        span("v", dev, &v.codes, v.strides, vs)?,
        span("out", dev, &out.data, out.strides, os)?,
    ];
    rows_distinct("out", out.strides, os)?;
    let groups = |heads: usize| match p.fp8_scaling {
        Scaling::PerTensor => 1,
        Scaling::PerHead => p.batch * heads,
    };
    let mut scale_spans = Vec::with_capacity(3);
    for (name, view, need) in [
        ("q's scales", &q, groups(p.heads)),
        ("k's scales", &k, groups(p.kv_heads)),
        ("v's scales", &v, groups(p.kv_heads)),
    ] {
        if view.scales.len() < need {
            return Err(invalid!(
                "{name}: {} values, {} scaling of {p} needs {need}",
                view.scales.len(),
                p.fp8_scaling.name()
            ));
        }
        if view.scales.stream().context() != dev.ctx() {
            return Err(invalid!(
                "{name} live on another GPU than the device handle"
            ));
        }
        let (sp, _g) = view.scales.device_ptr(view.scales.stream());
        scale_spans.push((name, sp..sp + (view.scales.len() * 4) as u64));
    }
    let strides = p.effective_strides([q.strides, k.strides, v.strides, out.strides]);
    let stream = dev.stream();
    // The guards record cudarc's read/write events (where tracking is on) once dropped, after
    // the launch is queued.
    let (qp, _qg) = q.codes.device_ptr(stream);
    let (kp, _kg) = k.codes.device_ptr(stream);
    let (vp, _vg) = v.codes.device_ptr(stream);
    let (qsp, _qsg) = q.scales.device_ptr(stream);
    let (ksp, _ksg) = k.scales.device_ptr(stream);
    let (vsp, _vsg) = v.scales.device_ptr(stream);
    let out_stream = out.data.stream().clone();
    let (op, _og) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out.data, stream);
    let [qspan, kspan, vspan, ospan] = spans;
    let [qsc, ksc, vsc] = [0, 1, 2].map(|i| scale_spans[i].1.clone());
    let call = Call {
        ops: [
            Bound {
                ptr: qp,
                strides: strides[0],
                span: qspan,
                scales: Some((qsp, qsc)),
            },
            Bound {
                ptr: kp,
                strides: strides[1],
                span: kspan,
                scales: Some((ksp, ksc)),
            },
            Bound {
                ptr: vp,
                strides: strides[2],
                span: vspan,
                scales: Some((vsp, vsc)),
            },
            Bound {
                ptr: op,
                strides: strides[3],
                span: ospan,
                scales: None,
            },
        ],
        streams: [&q, &k, &v]
            .into_iter()
            .flat_map(|x| [x.codes.stream().clone(), x.scales.stream().clone()])
            .chain([out_stream])
            .collect(),
        storage: Storage::Fp8Views { out: T::DTYPE },
    };
    crate::launch::launch(plan, call, extras)
}

/// The operands of a call over an FP8 K/V cache ([`crate::Problem::with_kv_dtype`]) in the
/// caller's memory: Q and the output of `T` (f16 or bf16, the problem's dtype), K and V as e4m3
/// codes with their scales (one, or [`crate::fp8::scale_count`] of the problem's
/// [`crate::Problem::k_shape`] per-head: `[kv_heads]` for a paged cache).
///
/// A decode step of 16 sequences over a paged e4m3 cache with a scale per K/V head:
///
/// ```no_run
/// use half::bf16;
/// use sdpa::{Backend, DType, Device, Extras, Fp8KvViews, Fp8View, Problem, View, ViewMut};
/// # fn main() -> sdpa::Result<()> {
/// let dev = Device::new(0)?;
/// let s = dev.stream();
/// let (batch, kv_heads, d, page) = (16, 8, 128, 64);
/// let pages_per_seq = 8192 / page;
/// let p = Problem::new(batch, 32, 1, 8192, d)
///     .with_kv_heads(kv_heads)
///     .with_dtype(DType::Bf16)
///     .with_kv_dtype(DType::E4m3)
///     .with_paged_kv(batch * pages_per_seq, page, pages_per_seq);
/// let (kc, vc) = (s.alloc_zeros::<u8>(p.k_len().unwrap())?, s.alloc_zeros::<u8>(p.v_len().unwrap())?);
/// let (k_scale, v_scale) = (s.clone_htod(&[0.02f32; 8])?, s.clone_htod(&[0.01f32; 8])?);
/// let q = s.alloc_zeros::<bf16>(p.q_len().unwrap())?;
/// let mut out = s.alloc_zeros::<bf16>(p.out_len().unwrap())?;
/// let table: Vec<i32> = (0..(batch * pages_per_seq) as i32).collect();
/// let (table, used) = (s.clone_htod(&table)?, s.clone_htod(&[8192i32; 16])?);
/// let views = Fp8KvViews {
///     q: View::new(q.as_view(), p.q_strides()),
///     k: Fp8View::new(kc.as_view(), k_scale.as_view(), p.k_strides()),
///     v: Fp8View::new(vc.as_view(), v_scale.as_view(), p.v_strides()),
///     out: ViewMut::new(out.as_view_mut(), p.out_strides()),
/// };
/// let extras = Extras {
///     block_table: Some(table.as_view()),
///     seqused_k: Some(used.as_view()),
///     ..Extras::default()
/// };
/// sdpa::forward(&dev, &p, Backend::Auto, views, extras)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Fp8KvViews<'a, 'o, T> {
    /// Queries, of the problem's dtype.
    pub q: View<'a, T>,
    /// Keys: e4m3 codes and their scales.
    pub k: Fp8View<'a>,
    /// Values: e4m3 codes and their scales.
    pub v: Fp8View<'a>,
    /// The output, of the problem's dtype; written only on success.
    pub out: ViewMut<'o, T>,
}

/// A run on an FP8 K/V cache in views ([`Fp8KvViews`]): Q, the codes and their scales read in
/// place, the output written in place. Each view is checked as a 16-bit one is (its GPU, rows of
/// 16-byte multiples, that it holds what its strides reach); each scale buffer holds what the
/// problem's scaling asks for.
pub(crate) fn run_fp8_kv_views<T: Element>(
    plan: &crate::Plan,
    views: Fp8KvViews<'_, '_, T>,
    extras: Extras<'_>,
) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let Fp8KvViews { q, k, v, mut out } = views;
    if !p.is_fp8_kv() || p.dtype != T::DTYPE {
        return Err(invalid!(
            "e4m3 K/V cache views need a problem with_kv_dtype(e4m3) and {} Q; the problem's Q \
             is {}, its K/V {}",
            T::DTYPE,
            p.dtype,
            p.kv_dtype()
        ));
    }
    let [qs, ks, vs, os] = p.operand_shapes();
    let spans = [
        span("q", dev, &q.data, q.strides, qs)?,
        span("k", dev, &k.codes, k.strides, ks)?,
        span("v", dev, &v.codes, v.strides, vs)?,
        span("out", dev, &out.data, out.strides, os)?,
    ];
    rows_distinct("out", out.strides, os)?;
    let need = crate::fp8::scale_count(&ks, p.fp8_scaling);
    let mut scale_spans = Vec::with_capacity(2);
    for (name, view) in [("k's scales", &k), ("v's scales", &v)] {
        if view.scales.len() < need {
            return Err(invalid!(
                "{name}: {} values, {} scaling of the K/V of {p} needs {need}",
                view.scales.len(),
                p.fp8_scaling.name()
            ));
        }
        if view.scales.stream().context() != dev.ctx() {
            return Err(invalid!(
                "{name} live on another GPU than the device handle"
            ));
        }
        let (sp, _g) = view.scales.device_ptr(view.scales.stream());
        scale_spans.push(sp..sp + (view.scales.len() * 4) as u64);
    }
    let strides = p.effective_strides([q.strides, k.strides, v.strides, out.strides]);
    let stream = dev.stream();
    // The guards record cudarc's read/write events (where tracking is on) once dropped, after
    // the launch is queued.
    let (qp, _qg) = q.data.device_ptr(stream);
    let (kp, _kg) = k.codes.device_ptr(stream);
    let (vp, _vg) = v.codes.device_ptr(stream);
    let (ksp, _ksg) = k.scales.device_ptr(stream);
    let (vsp, _vsg) = v.scales.device_ptr(stream);
    let out_stream = out.data.stream().clone();
    let (op, _og) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out.data, stream);
    let [qspan, kspan, vspan, ospan] = spans;
    let [ksc, vsc] = [scale_spans[0].clone(), scale_spans[1].clone()];
    let bound = |ptr, strides, span, scales| Bound {
        ptr,
        strides,
        span,
        scales,
    };
    let call = Call {
        ops: [
            bound(qp, strides[0], qspan, None),
            bound(kp, strides[1], kspan, Some((ksp, ksc))),
            bound(vp, strides[2], vspan, Some((vsp, vsc))),
            bound(op, strides[3], ospan, None),
        ],
        streams: [
            q.data.stream().clone(),
            k.codes.stream().clone(),
            k.scales.stream().clone(),
            v.codes.stream().clone(),
            v.scales.stream().clone(),
            out_stream,
        ]
        .into(),
        storage: Storage::Fp8KvViews,
    };
    crate::launch::launch(plan, call, extras)
}
