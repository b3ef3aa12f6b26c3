//! Scaled dot-product attention on NVIDIA GPUs, every fast path checked against a float64
//! reference.
//!
//! `out = softmax(scale · Q·Kᵀ + mask) · V` (forward), for f16 and bf16, BHSD or BSHD layout,
//! grouped-query attention, causal (aligned bottom-right) or not, any sequence lengths.
//!
//! ```no_run
//! use sdpa::{Backend, Device, DType, Extras, Problem, Tensor, Tensors};
//!
//! # fn main() -> sdpa::Result<()> {
//! let dev = Device::new(0)?; // Err(Error::NoDevice) on a machine without a GPU
//! let p = Problem::new(2, 8, 256, 256, 64).with_causal(true).with_dtype(DType::Bf16);
//! let (ql, kl) = (p.q_len().unwrap(), p.kv_len().unwrap());
//! let q = Tensor::from_f32(&dev, p.dtype, &vec![0.5; ql])?;
//! let k = Tensor::from_f32(&dev, p.dtype, &vec![0.25; kl])?;
//! let v = Tensor::from_f32(&dev, p.dtype, &vec![1.0; kl])?;
//! let mut out = Tensor::poisoned(&dev, p.dtype, ql)?;
//! let ops = Tensors { q: &q, k: &k, v: &v, out: &mut out };
//! sdpa::forward(&dev, &p, Backend::Auto, ops, Extras::default())?;
//! assert!(out.to_f32(&dev)?.iter().all(|&x| x == 1.0));
//! # Ok(())
//! # }
//! ```
//!
//! One way in: [`Plan::new`] checks a problem and picks its backend once, [`Plan::run`] runs it
//! on any operands ([`Tensors`], the caller's memory as [`Views`], e4m3 codes as [`Fp8Views`])
//! with the [`Extras`] the problem asks for; [`forward`] is both in one call.
//!
//! The float64 reference needs no GPU:
//!
//! ```
//! let p = sdpa::Problem::new(1, 1, 2, 3, 4);
//! let (q, kv) = (vec![0.1; 8], vec![0.2; 12]);
//! let out = sdpa::reference(&p, &q, &kv, &kv)?;
//! assert!(out.iter().all(|&x| (x - 0.2).abs() < 1e-15));
//! # Ok::<(), sdpa::Error>(())
//! ```

//! Threads: every public type is `Send + Sync`. A [`Device`] may be shared or cloned across
//! threads (its calls bind the GPU's context to the calling thread); a [`Tensor`] may be moved
//! or shared between threads, and calls through different handles are ordered as [`Device`]
//! describes.

#![warn(missing_docs)]

pub mod backend;
mod buffers;
mod codec;
mod device;
#[cfg(feature = "distributed")]
pub mod distributed;
mod error;
mod extras;
mod ffi;
mod footprint;
pub mod fp8;
mod fp8_view;
mod kv_cache;
pub mod memory;
mod plan;
mod problem;
pub mod seqs;
mod tensor;
mod view;

pub use backend::Backend;
pub use backend::cpu::{Reference, reference, reference_fp8_fast, reference_seqs, reference_with};
pub use codec::{decode, encode};
pub use device::{Device, driver_present};
pub use error::{CudaError, Error, MemoryKind, Result};
pub use extras::Extras;
pub use kv_cache::{KvAppend, append_kv};
pub use problem::{Alibi, DType, Fp8Mode, Layout, Mask, Problem, Scaling, Strides, TensorShape};
pub use seqs::{KvRows, SeqMeta, SeqSpan, Seqs, check_metadata};

use buffers::Buffers;
pub use fp8_view::{Fp8View, Fp8Views};
pub use plan::{Operands, Plan, Tensors};
use problem::Checked;
pub use tensor::{Element, Tensor};
pub use view::{View, ViewMut, Views};

use error::invalid;

/// Runs attention for `p` on `dev`'s stream once: [`Plan::new`] then [`Plan::run`], for scripts
/// and one-off calls (a loop plans once and runs each step). `ops` are [`Tensors`], [`Views`] or
/// [`Fp8Views`]; `extras` the ALiBi slopes, log-sum-exp output and sequence metadata the problem
/// asks for ([`Extras::default`] where it asks for none).
///
/// Every argument is checked before anything is launched: the problem itself, each operand's
/// dtype, extent and device, and whether `backend` supports the problem on this GPU. Returns
/// when the work is queued (GPU backends) or done (`Cpu`). Nothing is written on error.
///
/// The work is queued on `dev`'s stream. Buffers made through another handle of the same GPU
/// (another stream) may be passed: the call is ordered after the work queued on their streams,
/// and their streams after the call (see [`Device`]).
///
/// ```no_run
/// # fn main() -> sdpa::Result<()> {
/// use sdpa::{Alibi, Backend, DType, Device, Extras, Mask, Problem, Tensor, Tensors};
/// let dev = Device::new(0)?;
/// let p = Problem::new(1, 8, 4096, 4096, 128)
///     .with_mask(Mask::Window { left: Some(1024), right: Some(0) })
///     .with_softcap(30.0)
///     .with_alibi(Alibi::PerHead)
///     .with_lse(true);
/// let (ql, kl) = (p.q_len().unwrap(), p.kv_len().unwrap());
/// let q = Tensor::zeros(&dev, DType::F16, ql)?;
/// let (k, v) = (Tensor::zeros(&dev, DType::F16, kl)?, Tensor::zeros(&dev, DType::F16, kl)?);
/// let mut out = Tensor::zeros(&dev, DType::F16, ql)?;
/// let slopes: Vec<f32> = (1..=8).map(|h| 2f32.powi(-h)).collect();
/// let slopes = dev.stream().clone_htod(&slopes).expect("upload");
/// let mut lse = dev.stream().alloc_zeros::<f32>(p.lse_len()).expect("alloc");
/// let ops = Tensors { q: &q, k: &k, v: &v, out: &mut out };
/// let extras = Extras {
///     alibi_slopes: Some(slopes.as_view()),
///     lse: Some(lse.as_view_mut()),
///     ..Extras::default()
/// };
/// sdpa::forward(&dev, &p, Backend::Auto, ops, extras)?;
/// # Ok(())
/// # }
/// ```
pub fn forward<O: Operands>(
    dev: &Device,
    p: &Problem,
    backend: Backend,
    ops: O,
    extras: Extras<'_>,
) -> Result<()> {
    Plan::new(dev, p, backend)?.run(ops, extras)
}

/// A run on owned tensors: each tensor's dtype, scales, length and GPU checked against the
/// plan's problem, the extras against the problem and the tensors, the streams ordered.
pub(crate) fn run_tensors(plan: &Plan, t: Tensors<'_>, mut extras: Extras<'_>) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let Tensors { q, k, v, out } = t;
    check_tensors(dev, p, q, k, v, out)?;
    let spans = [q, k, v, &*out].map(|t| t.byte_span(dev));
    extras.check(dev, p, &spans)?;
    let backend = plan.backend();
    let extra_streams: Vec<_> = extras.streams().cloned().collect();
    let order = dev.order_after(
        [q, k, v, &*out]
            .into_iter()
            .flat_map(|t| t.streams())
            .chain(&extra_streams),
    )?;
    let t = Tensors { q, k, v, out };
    order.finish(run(dev, p, backend, t, &mut extras))
}

/// What [`Plan::reserve`] makes ready for `backend` (resolved) on `p`.
pub(crate) fn reserve_backend(dev: &Device, p: &Checked, chosen: Backend) -> Result<()> {
    if let Some(kernel) = chosen.fused_kernel() {
        backend::fused::reserve(kernel, dev, p)?;
    } else if chosen == Backend::Cublas {
        // cuBLAS loads a GEMM's kernels at their first launch, which a graph capture does not
        // allow: run the problem once, on zeros, besides making the handle and workspace.
        let p = p.dequantized();
        backend::cublas::reserve(dev, &p)?;
        let (ql, kl) = (p.q_elems(), p.kv_elems());
        let zeros = |n| Tensor::zeros(dev, p.dtype, n);
        let (q, k, v, mut out) = (zeros(ql)?, zeros(kl)?, zeros(kl)?, zeros(ql)?);
        let b = Buffers::of_tensors(dev, &p, &q, &k, &v, &mut out);
        backend::cublas::forward(dev, &p, &b)?;
        dev.synchronize()?;
    }
    Ok(())
}

/// `forward` once its arguments are checked, `backend` resolved to one that supports `p`, and
/// the streams ordered.
fn run(
    dev: &Device,
    p: &Checked,
    backend: Backend,
    t: Tensors<'_>,
    extras: &mut Extras<'_>,
) -> Result<()> {
    if p.dtype == DType::E4m3 && !backend.native_fp8() {
        return fp8_simulated(dev, p, backend, t, extras);
    }
    if let Some(kernel) = backend.fused_kernel() {
        return fused_forward(kernel, dev, p, t, extras);
    }
    let Tensors { q, k, v, out } = t;
    match backend {
        Backend::Cpu => {
            let stream = dev.stream();
            let slopes = match &extras.alibi_slopes {
                Some(s) => Some(stream.clone_dtoh(s)?),
                None => None,
            };
            let (q, k, v) = (q.to_f64(dev)?, k.to_f64(dev)?, v.to_f64(dev)?);
            let r = if p.seqs.is_dense() {
                reference_with(p, &q, &k, &v, slopes.as_deref())?
            } else {
                let meta = extras.metadata_on_host()?;
                reference_seqs(p, &q, &k, &v, slopes.as_deref(), &meta)?
            };
            if let Some(lse) = extras.lse.as_mut() {
                let l32: Vec<f32> = r.lse.iter().map(|&x| x as f32).collect();
                stream.memcpy_htod(&l32, &mut lse.slice_mut(..l32.len()))?;
            }
            let o32: Vec<f32> = r.out.iter().map(|&x| x as f32).collect();
            out.write_bits(dev, &encode(p.output_dtype(), &o32))
        }
        Backend::Cublas => {
            backend::cublas::forward(dev, p, &Buffers::of_tensors(dev, p, q, k, v, out))
        }
        Backend::Auto => unreachable!("resolve() returns a concrete backend"),
        _ => unreachable!("fused backends returned above"),
    }
}

/// A fused kernel's launch on the tensors and the extras' buffers (the guards of their
/// addresses held until the launch is queued).
fn fused_forward(
    kernel: sdpa_sys::ffi::Kernel,
    dev: &Device,
    p: &Checked,
    t: Tensors<'_>,
    extras: &mut Extras<'_>,
) -> Result<()> {
    let stream = dev.stream().clone();
    let ptrs = extras.pointers(&stream);
    let b = Buffers::of_tensors(dev, p, t.q, t.k, t.v, t.out).with_extras(&ptrs);
    backend::fused::forward(kernel, dev, p, &b)
}

/// The simulated FP8 path: Q, K, V dequantized to the output dtype (code · scale, rounded
/// once), then the backend's f16/bf16 kernel on the same problem.
fn fp8_simulated(
    dev: &Device,
    p: &Checked,
    backend: Backend,
    t: Tensors<'_>,
    extras: &mut Extras<'_>,
) -> Result<()> {
    let dtype = p.output_dtype();
    // With power-of-two scales, code·scale is exact in bf16 always and in f16 for scales in
    // [2^-15, 2^7] (the codes' 2^-9 granularity stays on f16's subnormal grid, 448·2^7 below
    // 65504). Outside that, the 16-bit kernel would not see the inputs the reference sees.
    if dtype == DType::F16 {
        let range = 2f32.powi(-15)..=2f32.powi(7);
        for (name, x) in [("q", t.q), ("k", t.k), ("v", t.v)] {
            if let Some(s) = x
                .scales()
                .unwrap_or(&[])
                .iter()
                .find(|s| !range.contains(s))
            {
                return Err(Error::Unsupported {
                    backend: backend.name(),
                    reason: format!(
                        "{name}'s e4m3 scale {s:e} puts its values outside what f16 holds \
                         exactly (scales 2^-15..2^7); the simulated path needs bf16 output here"
                    ),
                });
            }
        }
    }
    // The fused kernels dequantize into the device's scratch in one launch (C++ side,
    // cpp/src/fp8/simulated.cu); cublas and cpu take dequantized tensors.
    if let Some(kernel) = backend.fused_kernel() {
        return fused_forward(kernel, dev, p, t, extras);
    }
    let (q, k, v) = (
        t.q.dequantize(dev, dtype)?,
        t.k.dequantize(dev, dtype)?,
        t.v.dequantize(dev, dtype)?,
    );
    let t = Tensors {
        q: &q,
        k: &k,
        v: &v,
        out: t.out,
    };
    run(dev, &p.dequantized(), backend, t, extras)
}

/// Each tensor's dtype, scales, length and GPU against the (valid) problem.
fn check_tensors(
    dev: &Device,
    p: &Checked,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
) -> Result<()> {
    let (ql, kl) = (p.q_elems(), p.kv_elems());
    let (qs, ks) = (p.q_shape(), p.kv_shape());
    for (name, t, need, shape) in [
        ("q", q, ql, qs),
        ("k", k, kl, ks),
        ("v", v, kl, ks),
        ("out", out, ql, qs),
    ] {
        let want = if name == "out" {
            p.output_dtype()
        } else {
            p.dtype
        };
        if t.dtype() != want {
            return Err(invalid!("{name} is {}, the problem says {want}", t.dtype()));
        }
        if let Some((scaling, s)) = t.fp8_layout() {
            if scaling != p.fp8_scaling {
                return Err(invalid!(
                    "{name} has {} scales, the problem says {}",
                    scaling.name(),
                    p.fp8_scaling.name()
                ));
            }
            if s != shape {
                return Err(invalid!(
                    "{name} was quantized with shape {s}, the problem's {name} is {shape}"
                ));
            }
        }
        if t.len() < need {
            return Err(invalid!(
                "{name} holds {} elements, {p} needs {need}",
                t.len()
            ));
        }
        if !t.same_context(dev) {
            return Err(invalid!(
                "{name} lives on another GPU than the device handle"
            ));
        }
    }
    Ok(())
}
