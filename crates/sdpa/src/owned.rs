//! Runs on owned tensors ([`Tensors`]): their checks against the problem, their binding to the
//! one pipeline (launch.rs), and the backends only they reach: cpu (a host copy through the
//! float64 reference) and the e4m3 simulated path of cublas and cpu (dequantized copies).

use crate::backend::{self, Backend};
use crate::buffers::Buffers;
use crate::device::Device;
use crate::error::{Error, Result, invalid};
use crate::extras::Extras;
use crate::launch;
use crate::plan::{Plan, Tensors};
use crate::problem::{Checked, DType};
use crate::tensor::Tensor;
use crate::{reference_seqs, reference_with};
use sdpa_sys::args::KernelPlan;

/// A run on owned tensors: each tensor's dtype, scales, length and GPU checked against the
/// plan's problem, then the one pipeline ([`launch::launch`]).
pub(crate) fn run_tensors(plan: &Plan, t: Tensors<'_>, extras: Extras<'_>) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let Tensors { q, k, v, out } = t;
    check_tensors(dev, p, q, k, v, out)?;
    let [qs, ks, vs, os] = p.operand_strides();
    let bind = |t: &Tensor, strides| launch::Bound {
        ptr: t.ptr(dev),
        strides,
        span: t.byte_span(dev),
        scales: t.fp8.as_ref().map(|_| {
            let at = t.scales_ptr(dev);
            (at, at..at + 4 * t.scales().map_or(0, <[f32]>::len) as u64)
        }),
    };
    let ops = [bind(q, qs), bind(k, ks), bind(v, vs), bind(out, os)];
    let streams = [q, k, v, &*out]
        .into_iter()
        .flat_map(|t| t.streams().cloned())
        .collect();
    let call = launch::Call {
        ops,
        streams,
        storage: launch::Storage::Tensors(Tensors { q, k, v, out }),
    };
    launch::launch(plan, call, extras)
}

/// A run once its arguments are checked, `backend` resolved to one that supports `p` (`kernel`:
/// the core's plan of `p` where `backend` is fused), and the streams ordered.
pub(crate) fn run(
    dev: &Device,
    p: &Checked,
    backend: Backend,
    kernel: Option<&KernelPlan>,
    t: Tensors<'_>,
    extras: &mut Extras<'_>,
) -> Result<()> {
    if p.dtype == DType::E4m3 && !backend.native_fp8() {
        return fp8_simulated(dev, p, backend, kernel, t, extras);
    }
    if let Some(kernel) = kernel {
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
            // The first `heads` logits (the buffer may be longer).
            let sinks = match &extras.sinks {
                Some(s) => Some(stream.clone_dtoh(&s.slice(..p.heads))?),
                None => None,
            };
            let (q, k, v) = (q.to_f64(dev)?, k.to_f64(dev)?, v.to_f64(dev)?);
            let r = if p.seqs.is_dense() {
                reference_with(p, &q, &k, &v, slopes.as_deref(), sinks.as_deref())?
            } else {
                let meta = extras.metadata_on_host()?;
                reference_seqs(p, &q, &k, &v, slopes.as_deref(), sinks.as_deref(), &meta)?
            };
            if let Some(lse) = extras.lse.as_mut() {
                let l32: Vec<f32> = r.lse.iter().map(|&x| x as f32).collect();
                stream.memcpy_htod(&l32, &mut lse.slice_mut(..l32.len()))?;
            }
            // Rounded once to f32, then (f16/bf16 outputs) to the output dtype.
            let o32: Vec<f32> = r.out.iter().map(|&x| x as f32).collect();
            out.write_f32(dev, &o32)
        }
        Backend::Cublas => {
            backend::cublas::forward(dev, p, &Buffers::of_tensors(dev, p, q, k, v, out))
        }
        // A plan resolves Auto and plans every fused candidate: neither reaches here.
        b => Err(Error::Unsupported {
            backend: b.name(),
            reason: "no plan of the core for this backend".to_string(),
        }),
    }
}

/// A fused kernel's launch on the tensors and the extras' buffers (the guards of their
/// addresses held until the launch is queued).
fn fused_forward(
    kernel: &KernelPlan,
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
    kernel: Option<&KernelPlan>,
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
    // sdpa-sys/cpp/src/fp8/simulated.cu); cublas and cpu take dequantized tensors.
    if let Some(kernel) = kernel {
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
    run(dev, &p.dequantized(), backend, None, t, extras)
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
    let [ql, kl, vl, ol] = p.operand_elems();
    let [qs, ks, vs, os] = p.operand_shapes();
    for (name, t, need, shape) in [
        ("q", q, ql, qs),
        ("k", k, kl, ks),
        ("v", v, vl, vs),
        ("out", out, ol, os),
    ] {
        let want = match name {
            "out" => p.output_dtype(),
            "k" | "v" => p.kv_dtype(),
            _ => p.dtype,
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
