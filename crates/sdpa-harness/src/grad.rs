//! Checks of the backward against the float64 reference gradient (`sdpa::reference_backward`),
//! the same way everywhere (tests, `sdpa validate --backward`): fresh random inputs and dO, the
//! forward's output and log-sum-exp from the scalar kernel, every gradient poisoned with NaN
//! before the run, each compared at the bar of [`grad_tolerance`].

use crate::check::{ExtraBuffers, Report, Tolerance, compare_with};
use crate::inputs::{Inputs, normal_bits, random_inputs};
use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use sdpa::{
    Backend, BackwardPlan, BackwardViews, DType, Device, DqReduction, Element, Gradients, Problem,
    Result, Tensor, View, ViewMut, Views,
};
use std::sync::Arc;

/// The bar each gradient is held to, relative to the float64 reference on the same (rounded)
/// inputs and dO: the forward's ([`crate::check::tolerance`]: rel 2u, one element at most 8u of
/// the largest, u the dtype's unit roundoff).
///
/// Why the forward's: the kernels read the forward's output O rounded to the dtype (as every
/// FlashAttention backward and torch's do: D_i = dO_i · O_i from the rounded O), sum in f32 and
/// round each gradient once; dQ and dK carry dS = P (dP − D), where O's rounding shifts D, yet
/// on N(0, 1) inputs that adds little to the gradients' own rounding: dQ, dK and dV come out as
/// close to the reference as the forward's output does (docs/perf.md, "Backward"). torch's own
/// backward (cuDNN and flash) reaches rel 0.58-0.66u on the same kind of inputs, and so do the
/// tensor-core kernels here (scripts/torch_backward_error.py; docs/perf.md): the bar leaves
/// them 3x. An indexing or masking bug gives rel ~ 1.
pub fn grad_tolerance(dtype: DType) -> Tolerance {
    crate::check::tolerance(dtype)
}

/// The 16-bit elements the backward takes, as the harness reads them back.
pub trait Half: Element + Copy + Default + Unpin {
    /// The value.
    fn f64(self) -> f64;
}
impl Half for f16 {
    fn f64(self) -> f64 {
        self.to_f64()
    }
}
impl Half for bf16 {
    fn f64(self) -> f64 {
        self.to_f64()
    }
}

/// `bits` uploaded as elements of `T`.
pub fn upload<T: Half>(dev: &Device, bits: &[u16]) -> Result<CudaSlice<T>> {
    Tensor::from_bits(dev, T::DTYPE, bits)?.into_cuda_slice::<T>()
}

/// A buffer of `n` NaNs of `T` (a gradient left unwritten stays visible).
pub fn poisoned<T: Half>(dev: &Device, n: usize) -> Result<CudaSlice<T>> {
    Tensor::poisoned(dev, T::DTYPE, n)?.into_cuda_slice::<T>()
}

/// The values of a device buffer.
pub fn values<T: Half>(stream: &Arc<CudaStream>, x: &CudaSlice<T>) -> Result<Vec<f64>> {
    Ok(stream.clone_dtoh(x)?.into_iter().map(Half::f64).collect())
}

/// What a backward run wrote: dQ, dK, dV (and dsinks, where the problem has sinks).
#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    /// dQ, in Q's layout.
    pub dq: Vec<f64>,
    /// dK, in K's layout.
    pub dk: Vec<f64>,
    /// dV, in V's layout.
    pub dv: Vec<f64>,
    /// The sinks' gradient, one per query head.
    pub dsinks: Option<Vec<f64>>,
}

/// One problem ready for its backward: its inputs on the GPU, the forward's output and
/// log-sum-exp (the scalar kernel's), and dO, all in the problem's own layout.
pub struct BackwardCase<T> {
    /// The problem (with its log-sum-exp).
    pub p: Problem,
    /// Q, K, V (bits and values), ALiBi slopes, sinks, sequence metadata.
    pub inputs: Inputs,
    /// dO's bits.
    pub dout_bits: Vec<u16>,
    /// Q on the GPU.
    pub q: CudaSlice<T>,
    /// K on the GPU.
    pub k: CudaSlice<T>,
    /// V on the GPU.
    pub v: CudaSlice<T>,
    /// The forward's output.
    pub out: CudaSlice<T>,
    /// dO on the GPU.
    pub d_out: CudaSlice<T>,
    /// The forward's log-sum-exp.
    pub lse: CudaSlice<f32>,
    extras: ExtraBuffers,
}

/// Gradient buffers a timed backward writes into, again and again.
pub struct GradBuffers<T> {
    dq: CudaSlice<T>,
    dk: CudaSlice<T>,
    dv: CudaSlice<T>,
    dsinks: Option<CudaSlice<f32>>,
}

impl<T: Half> BackwardCase<T> {
    /// Fresh N(0, 1) inputs and dO from `seed` for `p` (in `T`'s dtype), and their forward.
    pub fn new(dev: &Device, p: &Problem, seed: u64) -> Result<BackwardCase<T>> {
        let p = p.with_dtype(T::DTYPE).with_lse(true);
        Self::with_inputs(dev, &p, random_inputs(&p, seed)?, seed)
    }

    /// [`BackwardCase::new`] on given inputs of `p` (a named problem's, say), dO from `seed`.
    pub fn with_inputs(
        dev: &Device,
        p: &Problem,
        inputs: Inputs,
        seed: u64,
    ) -> Result<BackwardCase<T>> {
        let p = p.with_dtype(T::DTYPE).with_lse(true);
        let dout_bits = normal_bits(T::DTYPE, p.out_len().unwrap_or_default(), seed ^ 0xd0);
        let [q, k, v] = [0, 1, 2].map(|i| upload::<T>(dev, &inputs.bits[i]));
        let (q, k, v) = (q?, k?, v?);
        let d_out = upload::<T>(dev, &dout_bits)?;
        let mut out = poisoned::<T>(dev, p.out_len().unwrap_or_default())?;
        let mut extras = ExtraBuffers::of_inputs(dev, &p, &inputs)?;
        let views = Views {
            q: View::new(q.as_view(), p.q_strides()),
            k: View::new(k.as_view(), p.k_strides()),
            v: View::new(v.as_view(), p.v_strides()),
            out: ViewMut::new(out.as_view_mut(), p.out_strides()),
        };
        sdpa::forward(dev, &p, Backend::Scalar, views, extras.extras())?;
        let lse: Vec<f32> = extras
            .lse(dev)?
            .unwrap_or_default()
            .iter()
            .map(|&x| x as f32)
            .collect();
        let lse = dev.stream().clone_htod(&lse)?;
        Ok(BackwardCase {
            p,
            inputs,
            dout_bits,
            q,
            k,
            v,
            out,
            d_out,
            lse,
            extras,
        })
    }

    /// Gradient buffers of the problem's sizes, poisoned with NaN.
    pub fn grad_buffers(&self, dev: &Device) -> Result<GradBuffers<T>> {
        let p = self.p;
        let [ql, kl, vl] = [p.q_len(), p.k_len(), p.v_len()].map(Option::unwrap_or_default);
        Ok(GradBuffers {
            dq: poisoned::<T>(dev, ql)?,
            dk: poisoned::<T>(dev, kl)?,
            dv: poisoned::<T>(dev, vl)?,
            dsinks: match p.sinks {
                true => Some(dev.stream().clone_htod(&vec![f32::NAN; p.heads])?),
                false => None,
            },
        })
    }

    /// The backward on `plan` into `g`, queued (what a timing loop repeats).
    pub fn run(&mut self, plan: &BackwardPlan, g: &mut GradBuffers<T>) -> Result<()> {
        let p = self.p;
        let [qs, ks, vs, os] = [p.q_strides(), p.k_strides(), p.v_strides(), p.out_strides()];
        let mut extras = self.extras.extras();
        extras.lse = None; // the forward's output; the backward reads it from its operands
        plan.run(
            BackwardViews {
                q: View::new(self.q.as_view(), qs),
                k: View::new(self.k.as_view(), ks),
                v: View::new(self.v.as_view(), vs),
                out: View::new(self.out.as_view(), os),
                d_out: View::new(self.d_out.as_view(), os),
                lse: self.lse.as_view(),
                dq: ViewMut::new(g.dq.as_view_mut(), qs),
                dk: ViewMut::new(g.dk.as_view_mut(), ks),
                dv: ViewMut::new(g.dv.as_view_mut(), vs),
                dsinks: g.dsinks.as_mut().map(|d| d.as_view_mut()),
            },
            extras,
        )
    }

    /// The backward on `plan`, every gradient poisoned first, read back.
    pub fn backward(&mut self, dev: &Device, plan: &BackwardPlan) -> Result<Grads> {
        let mut g = self.grad_buffers(dev)?;
        self.run(plan, &mut g)?;
        let s = dev.stream();
        let dsinks = match &g.dsinks {
            Some(d) => Some(s.clone_dtoh(d)?.into_iter().map(f64::from).collect()),
            None => None,
        };
        Ok(Grads {
            dq: values(s, &g.dq)?,
            dk: values(s, &g.dk)?,
            dv: values(s, &g.dv)?,
            dsinks,
        })
    }

    /// The float64 reference gradient on the same (rounded) inputs and dO.
    pub fn reference(&self) -> Result<Gradients> {
        let [q, k, v] = &self.inputs.values;
        let dout = sdpa::decode(self.p.dtype, &self.dout_bits);
        let (slopes, sinks) = (
            self.inputs.alibi_slopes.as_deref(),
            self.inputs.sinks.as_deref(),
        );
        match &self.inputs.seq_meta {
            None => sdpa::reference_backward(&self.p, q, k, v, &dout, slopes, sinks),
            Some(meta) => {
                sdpa::reference_backward_seqs(&self.p, q, k, v, &dout, slopes, sinks, meta)
            }
        }
    }
}

/// Each gradient's comparison with the reference.
#[derive(Debug, Clone)]
pub struct GradReport {
    /// The backend that ran.
    pub backend: Backend,
    /// dQ's, dK's and dV's reports, in that order.
    pub reports: [Report; 3],
    /// The sinks' gradient: the largest absolute error, and the bar it is held to (a sum over
    /// every row of a head, so bounded by its rows' scale, not its own: it can cancel to ~0).
    pub dsinks: Option<(f64, f64)>,
}

impl GradReport {
    /// Whether every gradient is within its bar and fully written.
    pub fn pass(&self) -> bool {
        self.reports.iter().all(Report::pass) && self.dsinks.is_none_or(|(err, bar)| err <= bar)
    }
}

/// Runs `backend`'s backward on fresh inputs for `p` (f16 or bf16) and compares each gradient
/// with the reference.
pub fn check_backward(
    dev: &Device,
    p: &Problem,
    backend: Backend,
    reduction: DqReduction,
    seed: u64,
) -> Result<GradReport> {
    match p.dtype {
        DType::F16 => check_backward_t::<f16>(dev, p, backend, reduction, seed),
        DType::Bf16 => check_backward_t::<bf16>(dev, p, backend, reduction, seed),
        d => Err(sdpa::Error::InvalidArgument(format!(
            "the backward takes f16 or bf16, not {d}"
        ))),
    }
}

fn check_backward_t<T: Half>(
    dev: &Device,
    p: &Problem,
    backend: Backend,
    reduction: DqReduction,
    seed: u64,
) -> Result<GradReport> {
    let mut case = BackwardCase::<T>::new(dev, p, seed)?;
    let plan = BackwardPlan::new(dev, &case.p, backend, reduction)?;
    case.check(dev, &plan, seed)
}

impl<T: Half> BackwardCase<T> {
    /// The backward on `plan` against the reference gradient.
    pub fn check(&mut self, dev: &Device, plan: &BackwardPlan, seed: u64) -> Result<GradReport> {
        let p = self.p;
        let got = self.backward(dev, plan)?;
        let want = self.reference()?;
        let tol = grad_tolerance(T::DTYPE);
        let reports = [
            (&got.dq, &want.dq),
            (&got.dk, &want.dk),
            (&got.dv, &want.dv),
        ]
        .map(|(g, w)| compare_with(g, w, tol, seed));
        let dsinks = match (&got.dsinks, &want.dsinks) {
            (Some(g), Some(w)) => {
                let err = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| {
                        if a.is_nan() != b.is_nan() {
                            f64::INFINITY
                        } else {
                            (a - b).abs()
                        }
                    })
                    .fold(0.0, f64::max);
                // Each head's rows contribute terms of size ≤ max |D_i|; the bar is the dtype's
                // relative one over their count.
                let rows = (p.lse_len() / p.heads.max(1)) as f64;
                Some((err, tol.rel * rows.sqrt().max(1.0)))
            }
            _ => None,
        };
        Ok(GradReport {
            backend: plan.backend(),
            reports,
            dsinks,
        })
    }
}
