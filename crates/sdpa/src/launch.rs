//! The one pipeline behind [`crate::Plan::run`]: whatever the operands' storage, once each is
//! bound (its device address, strides and the bytes it reaches, checked against the problem by
//! its own kind: `run_tensors` in lib.rs, view.rs, fp8_view.rs), a run checks the output apart
//! from every input and the extras against the problem, picks the plan's backend that takes this
//! storage, orders the streams involved, and launches.

use crate::backend::Backend;
use crate::buffers::Buffers;
use crate::error::{Result, invalid};
use crate::extras::Extras;
use crate::footprint::out_apart;
use crate::plan::{Plan, Tensors};
use crate::problem::{Checked, DType, Scaling, Strides};
use cudarc::driver::CudaStream;
use std::ops::Range;
use std::sync::Arc;

/// How a run's operands are stored: what decides which backends can read them.
#[derive(Debug)]
pub(crate) enum Storage<'t> {
    /// Owned tensors (every backend reads them; cpu and cublas's e4m3 path copy from them).
    Tensors(Tensors<'t>),
    /// Views of the caller's memory: f16/bf16 inputs, an output of the problem's output dtype.
    Views,
    /// e4m3 codes and scales in the caller's memory, with a `out` of this dtype.
    Fp8Views { out: DType },
    /// 16-bit Q and output, e4m3 K/V codes and scales, in the caller's memory.
    Fp8KvViews,
}

/// One operand bound for a launch: its device address, its element strides (a size-1
/// dimension's as the layout's own), the bytes it reaches, and for e4m3 inputs its scales.
#[derive(Debug, Clone)]
pub(crate) struct Bound {
    pub(crate) ptr: u64,
    pub(crate) strides: Strides,
    pub(crate) span: Range<u64>,
    /// Device address and bytes of the e4m3 scales (none for f16/bf16).
    pub(crate) scales: Option<(u64, Range<u64>)>,
}

/// A run's operands, bound: Q, K, V and the output (of the problem's output dtype), the
/// streams their buffers belong to, and how they are stored.
pub(crate) struct Call<'t> {
    pub(crate) ops: [Bound; 4],
    pub(crate) streams: Vec<Arc<CudaStream>>,
    pub(crate) storage: Storage<'t>,
}

/// Checks what the operands' storage left to check, picks the backend (among the plan's, the
/// first that takes this storage), orders the streams and launches.
pub(crate) fn launch(plan: &Plan, call: Call<'_>, mut extras: Extras<'_>) -> Result<()> {
    let (dev, p) = (plan.device(), plan.checked());
    let [q, k, v, o] = &call.ops;
    if p.v_in_k && (v.ptr != k.ptr || v.strides != k.strides) {
        return Err(invalid!(
            "{p} reads V from K's rows (with_v_in_k): pass K as V, the same tensor or a view at \
             K's address with K's strides"
        ));
    }
    let names = ["q", "k", "v"];
    let scale_names = ["q's scales", "k's scales", "v's scales"];
    let mut inputs: Vec<(&str, &Range<u64>)> = names
        .iter()
        .zip([q, k, v])
        .map(|(n, b)| (*n, &b.span))
        .collect();
    for (name, b) in scale_names.iter().zip([q, k, v]) {
        if let Some((_, span)) = &b.scales {
            inputs.push((name, span));
        }
    }
    out_apart(&o.span, &inputs)?;
    let spans = [q, k, v, o].map(|b| b.span.clone());
    extras.check(dev, p, &spans)?;
    let strides = [q, k, v, o].map(|b| b.strides);
    let in_layout = strides == p.operand_strides();
    let backend = plan.choose(|b| takes(p, &call.storage, b, in_layout))?;
    let extra_streams: Vec<_> = extras.streams().cloned().collect();
    let order = dev.order_after(call.streams.iter().chain(&extra_streams))?;
    let ran = match call.storage {
        Storage::Tensors(t) => {
            let kernel = plan.kernel_plan(backend);
            crate::owned::run(dev, p, backend, kernel, t, &mut extras)
        }
        Storage::Views | Storage::Fp8Views { .. } | Storage::Fp8KvViews => {
            let stream = dev.stream().clone();
            let b = Buffers {
                q: q.ptr,
                k: k.ptr,
                v: v.ptr,
                o: o.ptr,
                scales: [q, k, v].map(|b| b.scales.as_ref().map_or(0, |s| s.0)),
                strides,
                alibi_slopes: 0,
                sinks: 0,
                lse: 0,
                seqs: [0; 4],
            }
            .with_extras(&extras.pointers(&stream));
            match plan.kernel_plan(backend) {
                Some(kernel) => crate::backend::fused::forward(kernel, dev, p, &b),
                None => crate::backend::cublas::forward(dev, p, &b),
            }
        }
    };
    order.finish(ran)
}

/// Whether `b` reads operands of this storage (`in_layout`: at the problem's own strides):
/// cpu reads owned tensors only; cublas the layout's strides and 16-bit views; the simulated
/// e4m3 path of the other fused backends dequantizes views to bf16 only (whether f16 holds
/// code · scale exactly depends on scales that stay on the GPU), per-head ones at the layout's
/// strides.
fn takes(p: &Checked, storage: &Storage<'_>, b: Backend, in_layout: bool) -> Result<(), String> {
    match (storage, b) {
        (Storage::Tensors(_), _) => Ok(()),
        (Storage::Views, Backend::Cpu) => {
            Err("reads owned tensors (Tensor), not views".to_string())
        }
        (Storage::Views, Backend::Cublas) if !in_layout => Err(format!(
            "takes views with the {} layout's own strides only",
            p.layout
        )),
        (Storage::Views, _) => Ok(()),
        (Storage::Fp8Views { .. }, Backend::Cpu | Backend::Cublas) => {
            Err("takes e4m3 as owned tensors only".to_string())
        }
        (Storage::Fp8Views { .. }, b) if b.native_fp8() => Ok(()),
        (Storage::Fp8Views { out }, _) if *out != DType::Bf16 => Err(
            "dequantizes e4m3 views to bf16 only (whether f16 holds code · scale exactly depends \
             on scales that stay on the GPU)"
                .to_string(),
        ),
        (Storage::Fp8Views { .. }, _) if p.fp8_scaling == Scaling::PerHead && !in_layout => {
            Err(format!(
                "dequantizes per-head e4m3 views at the {} layout's own strides only",
                p.layout
            ))
        }
        (Storage::Fp8Views { .. }, _) => Ok(()),
        (Storage::Fp8KvViews, Backend::Cpu) => {
            Err("takes an e4m3 K/V cache as owned tensors only".to_string())
        }
        // The backends that support such a problem read the views at any strides.
        (Storage::Fp8KvViews, _) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Problem;

    /// What each backend reads, by storage: every backend reads owned tensors; views not on cpu,
    /// and on cublas only at the layout's strides; e4m3 views on the native kernel at any
    /// strides, on the simulated path with bf16 output only (per-head scales at the layout's
    /// strides), never on cpu or cublas.
    #[test]
    fn each_backend_reads_the_storage_it_can() {
        let p16 = Problem::new(1, 2, 64, 64, 64).checked().unwrap();
        let p8 = Problem::new(1, 2, 64, 64, 64)
            .with_dtype(DType::E4m3)
            .with_out_dtype(DType::Bf16)
            .checked()
            .unwrap();
        let views = Storage::Views;
        for b in [
            Backend::Scalar,
            Backend::Wmma,
            Backend::Cutlass,
            Backend::CutlassSm80,
        ] {
            assert!(takes(&p16, &views, b, false).is_ok(), "{b}");
        }
        assert!(takes(&p16, &views, Backend::Cublas, true).is_ok());
        let e = takes(&p16, &views, Backend::Cublas, false).unwrap_err();
        assert!(e.contains("layout's own strides"), "{e}");
        let e = takes(&p16, &views, Backend::Cpu, true).unwrap_err();
        assert!(e.contains("owned tensors"), "{e}");

        let bf16 = Storage::Fp8Views { out: DType::Bf16 };
        let f16 = Storage::Fp8Views { out: DType::F16 };
        assert!(takes(&p8, &f16, Backend::Cutlass, false).is_ok());
        assert!(takes(&p8, &bf16, Backend::CutlassSm80, true).is_ok());
        let e = takes(&p8, &f16, Backend::CutlassSm80, true).unwrap_err();
        assert!(e.contains("bf16 only"), "{e}");
        let e = takes(&p8, &bf16, Backend::Scalar, false).unwrap_err();
        assert!(e.contains("per-head"), "{e}");
        for b in [Backend::Cpu, Backend::Cublas] {
            let e = takes(&p8, &bf16, b, true).unwrap_err();
            assert!(e.contains("owned tensors only"), "{b}: {e}");
        }
    }
}
