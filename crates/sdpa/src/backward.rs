//! The backward's way in: a problem planned for its gradients ([`BackwardPlan::new`]: the same
//! [`Problem`], the same checks and the same [`Backend`] choice as the forward's [`crate::Plan`])
//! and run on the caller's memory ([`BackwardPlan::run`]): Q, K, V, the forward's output O and
//! its log-sum-exp, and dO in; dQ, dK, dV (and the sinks' gradient) out. Masks, softcap, ALiBi,
//! sinks, GQA and packed sequences are the problem's, as in the forward: no entry point per
//! variant. [`crate::backward`] is both in one call.

use crate::backend::{Backend, auto, sm_of};
use crate::device::Device;
use crate::error::{Error, Result, invalid};
use crate::extras::Extras;
use crate::footprint::{apart, rows_distinct, span};
use crate::problem::{Checked, DType, KvRows, Problem, Strides};
use crate::tensor::{Element, Tensor};
use crate::view::{View, ViewMut};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use sdpa_sys::args::{BwdArgs, BwdGrads, KernelPlan};

/// How dQ is summed over the key tiles that contribute to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DqReduction {
    /// With f32 atomics from the dK/dV pass: the fastest, its order (and so dQ's last bits)
    /// varying between runs.
    #[default]
    Atomic,
    /// In a fixed order: dQ bitwise the same every run.
    Deterministic,
}

/// A problem checked for its backward on a device, with the backend that runs it there.
///
/// ```no_run
/// # fn main() -> sdpa::Result<()> {
/// use half::bf16;
/// use sdpa::{Backend, BackwardPlan, BackwardViews, DType, Device, DqReduction, Extras};
/// use sdpa::{Problem, View, ViewMut};
/// let dev = Device::new(0)?;
/// let p = Problem::new(2, 8, 512, 512, 64).with_causal(true).with_dtype(DType::Bf16);
/// let s = dev.stream();
/// let (ql, kl) = (p.q_len().unwrap(), p.k_len().unwrap());
/// // Q, K, V, the forward's output and log-sum-exp (`Problem::with_lse`), and dO.
/// let (q, k, v) = (s.alloc_zeros::<bf16>(ql)?, s.alloc_zeros::<bf16>(kl)?, s.alloc_zeros::<bf16>(kl)?);
/// let (o, d_o) = (s.alloc_zeros::<bf16>(ql)?, s.alloc_zeros::<bf16>(ql)?);
/// let lse = s.alloc_zeros::<f32>(p.lse_len())?;
/// let (mut dq, mut dk, mut dv) =
///     (s.alloc_zeros::<bf16>(ql)?, s.alloc_zeros::<bf16>(kl)?, s.alloc_zeros::<bf16>(kl)?);
/// let plan = BackwardPlan::new(&dev, &p, Backend::Auto, DqReduction::Atomic)?;
/// let (qs, ks) = (p.q_strides(), p.k_strides());
/// plan.run(
///     BackwardViews {
///         q: View::new(q.as_view(), qs),
///         k: View::new(k.as_view(), ks),
///         v: View::new(v.as_view(), ks),
///         out: View::new(o.as_view(), qs),
///         d_out: View::new(d_o.as_view(), qs),
///         lse: lse.as_view(),
///         dq: ViewMut::new(dq.as_view_mut(), qs),
///         dk: ViewMut::new(dk.as_view_mut(), ks),
///         dv: ViewMut::new(dv.as_view_mut(), ks),
///         dsinks: None,
///     },
///     Extras::default(),
/// )?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct BackwardPlan {
    dev: Device,
    p: Checked,
    backend: Backend,
    kernel: KernelPlan,
    reduction: DqReduction,
}

impl BackwardPlan {
    /// Checks `p` and which backend runs its backward on `dev`: `backend` itself (an error
    /// where it has no backward for `p` there), or for `Auto` the first of the forward's order
    /// that has. The problem's `lse` flag is the forward's business: the backward always reads
    /// the log-sum-exp.
    pub fn new(
        dev: &Device,
        p: &Problem,
        backend: Backend,
        reduction: DqReduction,
    ) -> Result<BackwardPlan> {
        let p = p.with_lse(false).checked()?;
        refuse_what_no_backward_takes(&p, backend)?;
        let args = problem_args(&p, reduction);
        let info = dev.info();
        let chosen = if backend == Backend::Auto {
            let mut reasons = Vec::new();
            let mut chosen = None;
            for b in auto::candidates(sm_of(Some(dev))?, &p) {
                let Some(kernel) = b.fused_kernel() else {
                    continue;
                };
                let why = sdpa_sys::ffi::can_implement_backward(kernel, &args, &info)?;
                if why.is_empty() && b.supports_checked(Some(dev), &p).is_ok() {
                    chosen = Some(b);
                    break;
                }
                reasons.push(format!("{b}: {why}"));
            }
            chosen.ok_or_else(|| Error::Unsupported {
                backend: Backend::Auto.name(),
                reason: format!(
                    "no backend has a backward for {p} here ({})",
                    reasons.join("; ")
                ),
            })?
        } else {
            backend
        };
        let Some(kernel) = chosen.fused_kernel() else {
            return Err(Error::Unsupported {
                backend: chosen.name(),
                reason: "has no GPU backward (the float64 reference gradient is \
                         sdpa::reference_backward)"
                    .to_string(),
            });
        };
        let kernel =
            sdpa_sys::ffi::plan_backward(kernel, &args, &info).map_err(|e| Error::Unsupported {
                backend: chosen.name(),
                reason: e.to_string(),
            })?;
        Ok(BackwardPlan {
            dev: dev.clone(),
            p,
            backend: chosen,
            kernel,
            reduction,
        })
    }

    /// The problem, as checked.
    pub fn problem(&self) -> &Problem {
        &self.p
    }
    /// The backend that runs the backward.
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// How dQ is summed.
    pub fn reduction(&self) -> DqReduction {
        self.reduction
    }

    /// Grows the device's scratch to what a run needs, so that later runs (one captured into a
    /// CUDA graph, say) allocate nothing.
    pub fn reserve(&self) -> Result<&BackwardPlan> {
        crate::backend::fused::reserve(&self.kernel, &self.dev)?;
        Ok(self)
    }

    /// Writes dQ, dK and dV (and, where the problem has sinks and `dsinks` is given, the sinks'
    /// gradient) for the gradient `d_out` of the loss against the forward's output, queued on
    /// the plan's device stream. Every operand is checked first (its GPU, alignment, and extent
    /// at its strides; each gradient's elements at addresses of their own, apart from every
    /// input and from each other); nothing is written on error. `extras` are the forward's
    /// ALiBi slopes, sinks and sequence metadata (not its `lse`: the backward reads it from
    /// `ops`).
    pub fn run<O: BackwardOperands>(&self, ops: O, extras: Extras<'_>) -> Result<()> {
        ops.run(self, extras)
    }

    /// The run on views, which every storage comes to.
    fn run_views<T: Element>(
        &self,
        ops: BackwardViews<'_, '_, T>,
        mut extras: Extras<'_>,
    ) -> Result<()> {
        let (dev, p) = (&self.dev, &self.p);
        if T::DTYPE != p.dtype {
            return Err(invalid!(
                "the views are {}, the problem's inputs {}",
                T::DTYPE,
                p.dtype
            ));
        }
        if extras.lse.is_some() {
            return Err(invalid!(
                "the backward reads the forward's log-sum-exp from its operands (BackwardViews::lse), \
                 not from Extras::lse"
            ));
        }
        let BackwardViews {
            q,
            k,
            v,
            out,
            d_out,
            lse,
            mut dq,
            mut dk,
            mut dv,
            mut dsinks,
        } = ops;
        let [qs, ks, vs, os] = p.operand_shapes();
        let spans = [
            span("q", dev, &q.data, q.strides, qs)?,
            span("k", dev, &k.data, k.strides, ks)?,
            span("v", dev, &v.data, v.strides, vs)?,
            span("out", dev, &out.data, out.strides, os)?,
            span("d_out", dev, &d_out.data, d_out.strides, os)?,
        ];
        let grad_spans = [
            span("dq", dev, &dq.data, dq.strides, qs)?,
            span("dk", dev, &dk.data, dk.strides, ks)?,
            span("dv", dev, &dv.data, dv.strides, vs)?,
        ];
        for (name, s, shape) in [
            ("dq", dq.strides, qs),
            ("dk", dk.strides, ks),
            ("dv", dv.strides, vs),
        ] {
            rows_distinct(name, s, shape)?;
        }
        let stream = dev.stream().clone();
        if lse.stream().context() != dev.ctx() {
            return Err(invalid!("lse lives on another GPU than the device handle"));
        }
        if lse.len() < p.lse_len() {
            return Err(invalid!(
                "lse holds {} values, {p} needs {} (the forward's, Problem::lse_len)",
                lse.len(),
                p.lse_len()
            ));
        }
        let lse_span = {
            let (ptr, _g) = lse.device_ptr(&stream);
            ptr..ptr + 4 * p.lse_len() as u64
        };
        let dsinks_span = match (p.sinks, &dsinks) {
            (_, None) => None,
            (false, Some(_)) => {
                return Err(invalid!(
                    "dsinks given for a problem without sinks (Problem::with_sinks)"
                ));
            }
            (true, Some(d)) => {
                if d.stream().context() != dev.ctx() {
                    return Err(invalid!(
                        "dsinks lives on another GPU than the device handle"
                    ));
                }
                if d.len() < p.heads {
                    return Err(invalid!(
                        "dsinks holds {} values, {p} has {} query heads",
                        d.len(),
                        p.heads
                    ));
                }
                let (ptr, _g) = d.device_ptr(&stream);
                Some(ptr..ptr + 4 * p.heads as u64)
            }
        };
        // Every written operand apart from everything else the call reads or writes.
        let names = ["q", "k", "v", "out", "d_out"];
        let mut all: Vec<(&str, &std::ops::Range<u64>)> =
            names.iter().copied().zip(spans.iter()).collect();
        all.push(("lse", &lse_span));
        all.extend(["dq", "dk", "dv"].into_iter().zip(grad_spans.iter()));
        if let Some(s) = &dsinks_span {
            all.push(("dsinks", s));
        }
        for (i, (name, s)) in all.iter().enumerate().skip(names.len() + 1) {
            let others: Vec<_> = all
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, x)| *x)
                .collect();
            apart(name, s, &others)?;
        }
        extras.check(
            dev,
            p,
            &[
                spans[0].clone(),
                spans[1].clone(),
                spans[2].clone(),
                spans[3].clone(),
            ],
        )?;

        let [qst, kst, vst, ost] =
            p.effective_strides([q.strides, k.strides, v.strides, out.strides]);
        let [dqst, dkst, dvst, dost] =
            p.effective_strides([dq.strides, dk.strides, dv.strides, d_out.strides]);
        let streams: Vec<_> = [
            q.data.stream(),
            k.data.stream(),
            v.data.stream(),
            out.data.stream(),
            d_out.data.stream(),
            lse.stream(),
            dq.data.stream(),
            dk.data.stream(),
            dv.data.stream(),
        ]
        .into_iter()
        .chain(dsinks.as_ref().map(|d| d.stream()))
        .chain(extras.streams())
        .cloned()
        .collect();
        let order = dev.order_after(streams.iter())?;

        // The guards record cudarc's read/write events (where tracking is on) once dropped,
        // after the launch is queued.
        let (qp, _qg) = q.data.device_ptr(&stream);
        let (kp, _kg) = k.data.device_ptr(&stream);
        let (vp, _vg) = v.data.device_ptr(&stream);
        let (op, _og) = out.data.device_ptr(&stream);
        let (dop, _dog) = d_out.data.device_ptr(&stream);
        let (lp, _lg) = lse.device_ptr(&stream);
        let (dqp, _dqg) = dq.data.device_ptr_mut(&stream);
        let (dkp, _dkg) = dk.data.device_ptr_mut(&stream);
        let (dvp, _dvg) = dv.data.device_ptr_mut(&stream);
        let dsinks_guard = dsinks.as_mut().map(|d| d.device_ptr_mut(&stream));
        let dsinks_ptr = dsinks_guard.as_ref().map_or(0, |(ptr, _)| *ptr);
        let ptrs = extras.pointers(&stream);
        let b = crate::buffers::Buffers {
            q: qp,
            k: kp,
            v: vp,
            o: op,
            scales: [0; 3],
            strides: [qst, kst, vst, ost],
            alibi_slopes: 0,
            sinks: 0,
            lse: 0,
            seqs: [0; 4],
        }
        .with_extras(&ptrs);
        let mut fwd = crate::backend::fused::fwd_args(p, &b);
        fwd.out.has_lse = true;
        fwd.out.lse = lp;
        let packed_q = p.seqs.packed_q.is_some();
        let packed_kv = p.seqs.kv != KvRows::Dense;
        let strides = |s: Strides, packed: bool| {
            let s = s.as_i64();
            sdpa_sys::args::Strides::from([if packed { 0 } else { s[0] }, s[1], s[2]])
        };
        let args = BwdArgs {
            fwd,
            grads: BwdGrads {
                d_o: dop,
                do_stride: strides(dost, packed_q),
                dq: dqp,
                dk: dkp,
                dv: dvp,
                dq_stride: strides(dqst, packed_q),
                dk_stride: strides(dkst, packed_kv),
                dv_stride: strides(dvst, packed_kv),
                dsinks: dsinks_ptr,
                deterministic: self.reduction == DqReduction::Deterministic,
                workspace: 0,
            },
        };
        let ran = crate::backend::fused::backward(&self.kernel, dev, args);
        order.finish(ran)
    }
}

/// The operands of a backward run, views of the caller's device memory (each at its own element
/// strides, head_dim contiguous, as [`crate::Views`] takes them): Q, K, V, the forward's output
/// and log-sum-exp, and dO read; dQ, dK, dV (and dsinks) written. Of packed tensors, rows
/// outside every sequence (past the last offset) are not written, as the forward leaves its
/// output's; dense K/V rows past a sequence's `seqused_k` get zero gradients.
#[derive(Debug)]
pub struct BackwardViews<'a, 'g, T> {
    /// Queries, `[batch, heads, seq_q, head_dim]`.
    pub q: View<'a, T>,
    /// Keys, `[batch, kv_heads, seq_k, head_dim]`.
    pub k: View<'a, T>,
    /// Values, as the keys with V's head dim.
    pub v: View<'a, T>,
    /// The forward's output, as the queries with V's head dim.
    pub out: View<'a, T>,
    /// The loss's gradient against the output, as the output.
    pub d_out: View<'a, T>,
    /// The forward's log-sum-exp ([`Problem::with_lse`]; [`Problem::lse_len`] values).
    pub lse: CudaView<'a, f32>,
    /// dL/dQ, as the queries; written only on success.
    pub dq: ViewMut<'g, T>,
    /// dL/dK, as the keys (summed over each K/V head's query heads).
    pub dk: ViewMut<'g, T>,
    /// dL/dV, as the values (summed likewise).
    pub dv: ViewMut<'g, T>,
    /// dL/d(sink logit), f32 `[heads]` (summed over the batch), for a problem with sinks;
    /// `None`: not computed.
    pub dsinks: Option<CudaViewMut<'g, f32>>,
}

/// The operands of a backward run, by name, whatever their storage: [`BackwardViews`] (views of
/// the caller's memory at any strides) and [`BackwardTensors`] (owned tensors in the problem's
/// layout). Sealed: the crate checks each kind.
pub trait BackwardOperands: sealed::Sealed {
    #[doc(hidden)]
    fn run(self, plan: &BackwardPlan, extras: Extras<'_>) -> Result<()>;
}

impl<T: Element> BackwardOperands for BackwardViews<'_, '_, T> {
    fn run(self, plan: &BackwardPlan, extras: Extras<'_>) -> Result<()> {
        plan.run_views(self, extras)
    }
}

/// The operands of a backward run as owned tensors ([`Tensor`]), in the problem's layout: the
/// forward's Q, K, V and output, dO; dQ, dK and dV written (each of the problem's dtype, f16 or
/// bf16, and length). The log-sum-exp and dsinks as in [`BackwardViews`].
#[derive(Debug)]
pub struct BackwardTensors<'a> {
    /// Queries, `p.q_len()` elements.
    pub q: &'a Tensor,
    /// Keys, `p.k_len()` elements.
    pub k: &'a Tensor,
    /// Values, `p.v_len()` elements.
    pub v: &'a Tensor,
    /// The forward's output, `p.out_len()` elements.
    pub out: &'a Tensor,
    /// The loss's gradient against the output, as the output.
    pub d_out: &'a Tensor,
    /// The forward's log-sum-exp ([`Problem::lse_len`] values).
    pub lse: CudaView<'a, f32>,
    /// dL/dQ, as Q; written only on success.
    pub dq: &'a mut Tensor,
    /// dL/dK, as K.
    pub dk: &'a mut Tensor,
    /// dL/dV, as V.
    pub dv: &'a mut Tensor,
    /// dL/d(sink logit), f32 `[heads]`, for a problem with sinks; `None`: not computed.
    pub dsinks: Option<CudaViewMut<'a, f32>>,
}

impl BackwardOperands for BackwardTensors<'_> {
    fn run(self, plan: &BackwardPlan, extras: Extras<'_>) -> Result<()> {
        match plan.p.dtype {
            DType::F16 => tensors_as_views::<half::f16>(plan, self, extras),
            DType::Bf16 => tensors_as_views::<half::bf16>(plan, self, extras),
            d => Err(invalid!(
                "the backward takes f16 or bf16 tensors, the problem is {d}"
            )),
        }
    }
}

/// Owned tensors run as views of their buffers at the problem's own strides (each tensor's
/// dtype checked first).
fn tensors_as_views<T: Element>(
    plan: &BackwardPlan,
    t: BackwardTensors<'_>,
    extras: Extras<'_>,
) -> Result<()> {
    let p = &plan.p;
    let named = [
        ("q", t.q),
        ("k", t.k),
        ("v", t.v),
        ("out", t.out),
        ("d_out", t.d_out),
    ];
    for (name, x) in named
        .into_iter()
        .chain([("dq", &*t.dq), ("dk", &*t.dk), ("dv", &*t.dv)])
    {
        if x.dtype() != T::DTYPE {
            return Err(invalid!(
                "{name} is {}, the problem says {}",
                x.dtype(),
                T::DTYPE
            ));
        }
    }
    let [qs, ks, vs, os] = [p.q_strides(), p.k_strides(), p.v_strides(), p.out_strides()];
    let (dq, dk, dv) = (
        t.dq.typed_mut::<T>()?,
        t.dk.typed_mut::<T>()?,
        t.dv.typed_mut::<T>()?,
    );
    let views = BackwardViews {
        q: View::new(t.q.typed::<T>()?, qs),
        k: View::new(t.k.typed::<T>()?, ks),
        v: View::new(t.v.typed::<T>()?, vs),
        out: View::new(t.out.typed::<T>()?, os),
        d_out: View::new(t.d_out.typed::<T>()?, os),
        lse: t.lse,
        dq: ViewMut::new(dq, qs),
        dk: ViewMut::new(dk, ks),
        dv: ViewMut::new(dv, vs),
        dsinks: t.dsinks,
    };
    plan.run_views(views, extras)
}

mod sealed {
    pub trait Sealed {}
    impl<T: crate::tensor::Element> Sealed for super::BackwardViews<'_, '_, T> {}
    impl Sealed for super::BackwardTensors<'_> {}
}

/// What no backward takes yet, refused with a typed error before any backend is asked.
fn refuse_what_no_backward_takes(p: &Checked, backend: Backend) -> Result<()> {
    let reason = if !matches!(p.dtype, DType::F16 | DType::Bf16) || p.is_fp8_kv() {
        Some(format!(
            "the backward takes f16 or bf16 inputs, {p} has {}",
            p.dtype
        ))
    } else if p.output_dtype() != p.dtype {
        Some("the backward takes the forward's output in Q's dtype".to_string())
    } else if p.v_in_k {
        Some("the backward takes V in a tensor of its own (with_v_in_k is decode's)".to_string())
    } else if matches!(p.seqs.kv, KvRows::Paged { .. }) {
        Some("the backward takes dense or packed sequences, not a paged K/V cache".to_string())
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Error::Unsupported {
            backend: backend.name(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The argument block of `p`'s backward with no buffers (what planning asks the core with).
fn problem_args(p: &Checked, reduction: DqReduction) -> BwdArgs {
    let mut fwd = crate::backend::fused::problem_args(p);
    fwd.out.has_lse = true;
    let zero = sdpa_sys::args::Strides::default();
    BwdArgs {
        fwd,
        grads: BwdGrads {
            d_o: 0,
            do_stride: zero,
            dq: 0,
            dk: 0,
            dv: 0,
            dq_stride: zero,
            dk_stride: zero,
            dv_stride: zero,
            dsinks: 0,
            deterministic: reduction == DqReduction::Deterministic,
            workspace: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Alibi, Mask};
    use sdpa_sys::args::DeviceInfo;

    /// What the core says of `b`'s backward for `p`, asked without a GPU ("" where it runs it).
    fn ask(b: Backend, p: &Problem) -> String {
        let p = p.checked().unwrap();
        let args = problem_args(&p, DqReduction::Atomic);
        sdpa_sys::ffi::can_implement_backward(
            b.fused_kernel().unwrap(),
            &args,
            &DeviceInfo::default(),
        )
        .unwrap()
    }

    /// The scalar backward takes every variant the forward has, at every head dim up to 256;
    /// cutlass-sm80 and cutlass take them at their head dims; wmma has none yet; what no
    /// backward takes is refused before any backend is asked.
    #[test]
    fn which_backward_runs_what() {
        let p = Problem::new(2, 8, 100, 130, 64).with_dtype(DType::Bf16);
        let variants = [
            p,
            p.with_dtype(DType::F16),
            p.with_causal(true),
            p.with_mask(Mask::Window {
                left: Some(20),
                right: Some(0),
            }),
            p.with_softcap(20.0).with_alibi(Alibi::PerBatchHead),
            p.with_sinks(true),
            p.with_kv_heads(2),
            Problem { head_dim: 96, ..p },
            Problem { head_dim: 128, ..p }.with_causal(true),
            Problem { head_dim: 192, ..p }.with_head_dim_v(128),
            Problem { head_dim: 256, ..p },
            p.with_packed_q(300).with_packed_kv(400),
        ];
        for v in &variants {
            assert_eq!(ask(Backend::Scalar, v), "", "{v}");
        }
        let mla = Problem::new(1, 16, 1, 64, 576)
            .with_kv_heads(1)
            .with_head_dim_v(512)
            .with_dtype(DType::Bf16);
        let why = ask(Backend::Scalar, &mla);
        assert!(why.contains("not instantiated as wide"), "{why}");
        // cutlass-sm80's tensor-core backward: head dim 64, with every variant the scalar one
        // takes there; the other head dims go to scalar.
        for v in variants
            .iter()
            .filter(|v| v.head_dim == 64 && v.v_dim() == 64)
        {
            assert_eq!(ask(Backend::CutlassSm80, v), "", "{v}");
        }
        let why = ask(Backend::CutlassSm80, &Problem { head_dim: 32, ..p });
        assert!(why.contains("head_dim = head_dim_v = 64"), "{why}");
        let why = ask(Backend::CutlassSm80, &Problem { head_dim: 128, ..p });
        assert!(why.contains("not instantiated as wide"), "{why}");
        // cutlass's sm_90a backward: head dims 64 and 128 exactly, with every variant the
        // scalar one takes there (the sm_90a check passes on a device it does not know).
        for v in variants
            .iter()
            .filter(|v| matches!(v.head_dim, 64 | 128) && v.v_dim() == v.head_dim)
        {
            assert_eq!(ask(Backend::Cutlass, v), "", "{v}");
        }
        let why = ask(Backend::Cutlass, &Problem { head_dim: 96, ..p });
        assert!(why.contains("head_dim = head_dim_v = 128"), "{why}");
        let why = ask(Backend::Cutlass, &Problem { head_dim: 256, ..p });
        assert!(why.contains("not instantiated as wide"), "{why}");
        let why = ask(Backend::Wmma, &p);
        assert!(why.contains("has no backward yet"), "{why}");
        let refused = |q: &Problem, fragment: &str| {
            let e =
                refuse_what_no_backward_takes(&q.checked().unwrap(), Backend::Auto).unwrap_err();
            assert!(e.to_string().contains(fragment), "{q}: {e}");
        };
        refused(
            &p.with_dtype(DType::E4m3).with_out_dtype(DType::Bf16),
            "f16 or bf16",
        );
        refused(&p.with_kv_dtype(DType::E4m3), "f16 or bf16");
        refused(&p.with_out_dtype(DType::F32), "output in Q's dtype");
        let paged = Problem::new(2, 8, 1, 64, 64)
            .with_dtype(DType::Bf16)
            .with_paged_kv(16, 16, 4);
        refused(&paged, "paged");
        for v in &variants {
            refuse_what_no_backward_takes(&v.checked().unwrap(), Backend::Auto).unwrap();
        }
    }
}
