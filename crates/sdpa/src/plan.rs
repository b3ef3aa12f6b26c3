//! Plan once, run many: a problem checked and its backend chosen once ([`Plan::new`]), then run
//! on any operands of its shape ([`Plan::run`]), which checks only what the operands can change
//! (their GPU, dtype, extent, alignment and overlap) and launches. Operands are stored as owned
//! [`Tensor`]s, views of the caller's memory ([`View`], [`ViewMut`]) or e4m3 views
//! ([`Fp8View`]): one [`Operands`] trait covers them, so there is one way to run attention
//! whatever the storage. [`crate::forward`] is the one-shot form (plan, then run).

use crate::backend::{Backend, auto, none_runs, sm_of};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::extras::Extras;
use crate::fp8_view::{Fp8KvViews, Fp8Views};
use crate::problem::{Checked, DType, Problem};
use crate::tensor::{Element, Tensor};
use crate::view::Views;
use sdpa_sys::args::KernelPlan;

/// A problem checked on a device, with the backends that support it there, ready to run.
///
/// `Send + Sync`, cheap to keep: a decode loop plans once per shape and runs each step.
///
/// ```no_run
/// # fn main() -> sdpa::Result<()> {
/// use sdpa::{Backend, DType, Device, Extras, Plan, Problem, Tensor, Tensors};
/// let dev = Device::new(0)?;
/// let p = Problem::new(2, 8, 256, 256, 64).with_causal(true);
/// let plan = Plan::new(&dev, &p, Backend::Auto)?; // checks p, picks the backend
/// let (ql, kl) = (p.q_len().unwrap(), p.k_len().unwrap());
/// let q = Tensor::zeros(&dev, DType::F16, ql)?;
/// let (k, v) = (Tensor::zeros(&dev, DType::F16, kl)?, Tensor::zeros(&dev, DType::F16, kl)?);
/// let mut out = Tensor::zeros(&dev, DType::F16, ql)?;
/// for _ in 0..3 {
///     plan.run(Tensors { q: &q, k: &k, v: &v, out: &mut out }, Extras::default())?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Plan {
    dev: Device,
    p: Checked,
    /// Whether the plan was asked for `Auto` (a run that no candidate can take is then `Auto`'s
    /// refusal, else the named backend's).
    auto: bool,
    /// The backends that support the problem on the device, in the order a run tries them
    /// (one for a named backend; for `Auto` the measured order's).
    candidates: Vec<Backend>,
    /// Why each backend `Auto` passed over refused (for the error of a run none can take).
    refusals: Vec<String>,
    /// Per candidate, what the core decided for a fused backend (its instantiation and
    /// scratch), once: every run reads it.
    kernels: Vec<Option<KernelPlan>>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("problem", &self.p.to_string())
            .field("candidates", &self.candidates)
            .finish_non_exhaustive()
    }
}

impl Plan {
    /// Checks `p` and which backends run it on `dev`: `backend` itself (an error where it does
    /// not support `p` there), or for `Auto` every backend that does, fastest first.
    pub fn new(dev: &Device, p: &Problem, backend: Backend) -> Result<Plan> {
        let p = p.checked()?;
        let (candidates, refusals) = if backend == Backend::Auto {
            let (mut ok, mut no) = (Vec::new(), Vec::new());
            for b in auto::candidates(sm_of(Some(dev))?, &p) {
                match b.supports_checked(Some(dev), &p) {
                    Ok(()) => ok.push(b),
                    Err(e) => no.push(e.to_string()),
                }
                // A fused backend takes every storage the ones after it take (e4m3 views: the
                // native kernel; the simulated path refuses some): the order ends there, and
                // planning asks no more backends than it must.
                let takes_all = |b: &Backend| {
                    b.fused_kernel().is_some() && (p.dtype != DType::E4m3 || b.native_fp8())
                };
                if ok.last().is_some_and(takes_all) {
                    break;
                }
            }
            if ok.is_empty() {
                return Err(none_runs(&p, &no));
            }
            (ok, no)
        } else {
            backend.supports_checked(Some(dev), &p)?;
            (vec![backend], Vec::new())
        };
        let kernels = candidates
            .iter()
            .map(|b| {
                b.fused_kernel()
                    .map(|k| crate::backend::fused::plan(k, dev, &p))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(Plan {
            dev: dev.clone(),
            p,
            auto: backend == Backend::Auto,
            candidates,
            refusals,
            kernels,
        })
    }

    /// The problem, as checked.
    pub fn problem(&self) -> &Problem {
        &self.p
    }
    /// The device (and stream) the plan runs on.
    pub fn device(&self) -> &Device {
        &self.dev
    }
    /// The backend that runs owned tensors (for views, the first candidate that takes them).
    pub fn backend(&self) -> Backend {
        self.candidates[0]
    }

    /// Runs attention on `ops`, queued on the plan's device stream: `out = softmax(scale·Q·Kᵀ +
    /// mask)·V`, with the extras the problem asks for (ALiBi slopes, the log-sum-exp, sequence
    /// metadata). Every operand is checked against the problem before anything is launched
    /// (its GPU, dtype, length or extent at its strides, alignment; the output apart from every
    /// input); nothing is written on error. Returns when the work is queued (GPU backends) or
    /// done (`Cpu`).
    pub fn run<O: Operands>(&self, ops: O, extras: Extras<'_>) -> Result<()> {
        ops.run(self, extras)
    }

    /// Makes ready what the plan's backend needs (the cuBLAS handle and workspace, the scratch
    /// of the e4m3 kernels, the tile counter; for cublas one run on zeros, which loads its GEMM
    /// kernels), so that later runs allocate nothing and can be captured into a CUDA graph.
    pub fn reserve(&self) -> Result<&Plan> {
        match self.kernels[0] {
            Some(kernel) => crate::backend::fused::reserve(&kernel, &self.dev)?,
            None => reserve_backend(&self.dev, &self.p, self.backend())?,
        }
        Ok(self)
    }

    /// The core's plan for candidate `b` where it is a fused backend.
    pub(crate) fn kernel_plan(&self, b: Backend) -> Option<&KernelPlan> {
        let i = self.candidates.iter().position(|&c| c == b)?;
        self.kernels[i].as_ref()
    }

    pub(crate) fn checked(&self) -> &Checked {
        &self.p
    }

    /// The first candidate that `takes` accepts (the storage of a run's operands decides:
    /// cpu reads owned tensors, cublas the layout's own strides), or why none does.
    pub(crate) fn choose(
        &self,
        takes: impl Fn(Backend) -> std::result::Result<(), String>,
    ) -> Result<Backend> {
        let mut reasons = Vec::new();
        for &b in &self.candidates {
            match takes(b) {
                Ok(()) => return Ok(b),
                Err(why) if !self.auto => {
                    return Err(Error::Unsupported {
                        backend: b.name(),
                        reason: why,
                    });
                }
                Err(why) => reasons.push(format!("{b}: {why}")),
            }
        }
        reasons.extend(self.refusals.iter().cloned());
        Err(none_runs(&self.p, &reasons))
    }
}

/// What [`Plan::reserve`] makes ready for an unfused `backend` (resolved) on `p`.
fn reserve_backend(dev: &Device, p: &Checked, chosen: Backend) -> Result<()> {
    if chosen == Backend::Cublas {
        // cuBLAS loads a GEMM's kernels at their first launch, which a graph capture does not
        // allow: run the problem once, on zeros, besides making the handle and workspace.
        let p = p.dequantized();
        crate::backend::cublas::reserve(dev, &p)?;
        let [ql, kl, vl, ol] = p.operand_elems();
        let zeros = |n| Tensor::zeros(dev, p.dtype, n);
        let (q, k, v, mut out) = (zeros(ql)?, zeros(kl)?, zeros(vl)?, zeros(ol)?);
        let b = crate::buffers::Buffers::of_tensors(dev, &p, &q, &k, &v, &mut out);
        crate::backend::cublas::forward(dev, &p, &b)?;
        dev.synchronize()?;
    }
    Ok(())
}

/// The operands of one run, by name, whatever their storage: [`Tensors`] (owned tensors),
/// [`Views`] (views of the caller's f16/bf16 memory at any strides, the output f16, bf16 or
/// f32), [`Fp8Views`] (e4m3 codes and their scales in the caller's memory) and [`Fp8KvViews`]
/// (16-bit Q and output over an e4m3 K/V cache). Sealed: the crate checks each kind.
pub trait Operands: sealed::Sealed {
    #[doc(hidden)]
    fn run(self, plan: &Plan, extras: Extras<'_>) -> Result<()>;
}

/// Owned tensors as the operands of a run, by name: Q, K and V have one type, so positional
/// arguments would let a swap compile; a struct literal does not.
#[derive(Debug)]
pub struct Tensors<'a> {
    /// Queries, `p.q_len()` elements.
    pub q: &'a Tensor,
    /// Keys, `p.k_len()` elements.
    pub k: &'a Tensor,
    /// Values, `p.v_len()` elements.
    pub v: &'a Tensor,
    /// The output, `p.out_len()` elements of `p.output_dtype()` (f16, bf16 or f32); written only
    /// on success.
    pub out: &'a mut Tensor,
}

impl Operands for Tensors<'_> {
    fn run(self, plan: &Plan, extras: Extras<'_>) -> Result<()> {
        crate::owned::run_tensors(plan, self, extras)
    }
}

impl<T: Element, O: Element> Operands for Views<'_, '_, T, O> {
    fn run(self, plan: &Plan, extras: Extras<'_>) -> Result<()> {
        crate::view::run_views(plan, self, extras)
    }
}

impl<T: Element> Operands for Fp8Views<'_, '_, T> {
    fn run(self, plan: &Plan, extras: Extras<'_>) -> Result<()> {
        crate::fp8_view::run_fp8_views(plan, self, extras)
    }
}

impl<T: Element> Operands for Fp8KvViews<'_, '_, T> {
    fn run(self, plan: &Plan, extras: Extras<'_>) -> Result<()> {
        crate::fp8_view::run_fp8_kv_views(plan, self, extras)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Tensors<'_> {}
    impl<T: crate::tensor::Element, O: crate::tensor::Element> Sealed for super::Views<'_, '_, T, O> {}
    impl<T: crate::tensor::Element> Sealed for super::Fp8Views<'_, '_, T> {}
    impl<T: crate::tensor::Element> Sealed for super::Fp8KvViews<'_, '_, T> {}
}
