//! Scaled dot-product attention on NVIDIA GPUs, every fast path checked against a float64
//! reference.
//!
//! `out = softmax(scale · Q·Kᵀ + mask) · V` (forward), for f16, bf16 and e4m3 (FP8) inputs, BHSD
//! or BSHD layout, grouped-query attention, causal (aligned bottom-right) or not, any sequence
//! lengths.
//!
//! ```no_run
//! use sdpa::{Backend, Device, DType, Extras, Problem, Tensor, Tensors};
//!
//! # fn main() -> sdpa::Result<()> {
//! let dev = Device::new(0)?; // Err(Error::NoDevice) on a machine without a GPU
//! let p = Problem::new(2, 8, 256, 256, 64).with_causal(true).with_dtype(DType::Bf16);
//! let (ql, kl) = (p.q_len().unwrap(), p.k_len().unwrap());
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
//! Every use, where to start, and an example of it (the doctests of the items named run as
//! tests; those that need a GPU are compiled only):
//!
//! | to | start at | example |
//! |---|---|---|
//! | run one attention call | [`forward`] on [`Tensors`] | above |
//! | shape a problem: sizes, GQA, layout, dtype, scale | [`Problem`] and its `with_` builders | [`Problem`] (no GPU) |
//! | plan once, run many; CUDA graphs | [`Plan`], [`Plan::reserve`] | [`Plan`]; `examples/decode_loop.rs` captures a step |
//! | read and write your own device memory, at any strides | [`Views`] of [`View`]s, [`ViewMut`] | [`Views`] (a fused QKV buffer) |
//! | masks (causal, windows, chunks), softcap, ALiBi, sinks, the log-sum-exp | [`Problem::with_mask`], [`Problem::with_softcap`], [`Problem::with_alibi`], [`Problem::with_lse`], [`Extras`] | [`forward`] |
//! | packed sequences of different lengths (varlen) | [`Problem::with_packed_q`], [`Problem::with_packed_kv`], [`Extras::cu_seqlens_q`] | [`Extras`] |
//! | a paged K/V cache, decode steps | [`Problem::with_paged_kv`], [`Problem::with_page_layout`], [`Extras::block_table`] | [`write_kv`]; `examples/decode_loop.rs` (prefill, then decode as a graph) |
//! | new K/V rows into a cache, by slot or per request | [`write_kv`] (your buffers), [`append_kv`] (the crate's tensors) | [`write_kv`], [`append_kv`] |
//! | FP8 (e4m3) inputs | [`Fp8Views`], [`Tensor::quantize`], [`Problem::with_fp8_mode`] | [`Fp8Views`]; [`fp8`] (the codec, no GPU) |
//! | V of its own head dim; MLA decode on one latent cache (V is K's first columns) | [`Problem::with_head_dim_v`], [`Problem::with_v_in_k`] | [`Problem::with_v_in_k`] (no GPU) |
//! | an FP8 (e4m3) K/V cache under 16-bit Q | [`Problem::with_kv_dtype`], [`Fp8KvViews`], [`write_kv`] into an e4m3 cache | [`Problem::with_kv_dtype`] (no GPU), [`Fp8KvViews`] |
//! | candle tensors | the `sdpa-candle` crate: candle-flash-attn's functions | its front page; `sdpa-candle/examples/serve_decoder.rs` |
#![cfg_attr(
    feature = "distributed",
    doc = "| several GPUs: ring attention over NCCL | [`distributed`] (feature `distributed`) | [`distributed::Ring`], [`distributed::Zigzag`] (no GPU) |"
)]
#![cfg_attr(
    not(feature = "distributed"),
    doc = "| several GPUs: ring attention over NCCL | `distributed` (feature `distributed`) | `distributed::Ring` |"
)]
//! | gradients (dQ, dK, dV, the sinks'): training | [`BackwardPlan`], [`BackwardViews`], [`backward`](fn@backward); [`reference_backward`] (float64) | [`BackwardPlan`]; [`reference_backward`] (no GPU) |
//! | check a result | [`reference`](fn@reference), [`reference_with`], [`reference_seqs`] (float64, no GPU) | below; [`reference_with`] |
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
mod backward;
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
mod launch;
pub mod memory;
mod owned;
mod plan;
mod problem;
pub mod seqs;
mod tensor;
mod view;

pub use backend::Backend;
pub use backend::cpu::{Reference, reference, reference_fp8_fast, reference_seqs, reference_with};
pub use backend::cpu_grad::{Gradients, reference_backward, reference_backward_seqs};
pub use backward::{BackwardOperands, BackwardPlan, BackwardTensors, BackwardViews, DqReduction};
pub use codec::{decode, encode};
pub use device::{Device, driver_present};
pub use error::{CudaError, Error, MemoryKind, Result};
pub use extras::Extras;
pub use kv_cache::{
    KvAppend, KvScales, NewRows, PagedCache, Placement, append_kv, write_kv, write_kv_fp8,
};
pub use problem::{Alibi, DType, Fp8Mode, Layout, Mask, Problem, Scaling, Strides, TensorShape};
pub use seqs::{KvRows, PageLayout, SeqMeta, SeqSpan, Seqs, check_metadata};

pub use fp8_view::{Fp8KvViews, Fp8View, Fp8Views};
pub use plan::{Operands, Plan, Tensors};
pub use tensor::{Element, Tensor};
pub use view::{View, ViewMut, Views};

/// The cudarc this crate is built against, so that a caller names its types (`CudaSlice<i32>`
/// for sequence metadata, `CudaStream` for `Device::from_stream`) without matching its version.
pub use cudarc;

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
/// let (ql, kl) = (p.q_len().unwrap(), p.k_len().unwrap());
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

/// Runs the backward of `p` on `dev`'s stream once: [`BackwardPlan::new`] then
/// [`BackwardPlan::run`] (a training loop plans once per shape). `ops` are Q, K, V, the
/// forward's output and log-sum-exp and dO in, dQ, dK, dV (and dsinks) out, as
/// [`BackwardViews`] or [`BackwardTensors`]; `extras` the
/// forward's ALiBi slopes, sinks and sequence metadata. Every argument is checked before
/// anything is launched; nothing is written on error.
pub fn backward<O: BackwardOperands>(
    dev: &Device,
    p: &Problem,
    backend: Backend,
    reduction: DqReduction,
    ops: O,
    extras: Extras<'_>,
) -> Result<()> {
    BackwardPlan::new(dev, p, backend, reduction)?.run(ops, extras)
}
